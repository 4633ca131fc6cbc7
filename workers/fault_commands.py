"""Fault-injection control commands, for tests and drills: a worker that reports a slow
allocator, whose store statements fail, or that holds a job mid-stream
(workers/faults.py). Registered only when `Settings.fault_commands` is on
(TIDEGATE_FAULT_COMMANDS; the tests turn it on): a production worker has no such command,
so no broadcast can break it on purpose."""

from __future__ import annotations

import logging

from celery.utils.collections import AttributeDict
from celery.worker.control import control_command

from workers.worker import current

log = logging.getLogger("tidegate.worker")


def tidegate_fault(state: AttributeDict,
                   alloc_latency_ms: float | None = None) -> dict[str, bool]:
    """Fault injection: report this allocation latency until the next engine restart."""
    current().forced_alloc_latency_ms = alloc_latency_ms
    log.warning("fault injected: reporting allocation latency %s ms", alloc_latency_ms)
    return {"ok": True}


def tidegate_store_fault(state: AttributeDict, failures: int = 0,
                         outage_s: float = 0.0) -> dict[str, bool]:
    """Fault injection: the next `failures` store statements of this worker fail, or all of
    them for `outage_s` seconds from the next one (workers/faults.py `StoreFault`)."""
    current().store_fault.arm(failures=failures, outage_s=outage_s)
    log.warning("fault injected: store statements fail (%d, or for %.1f s)", failures, outage_s)
    return {"ok": True}


def tidegate_hold(state: AttributeDict, after_tokens: int = 0,
                  freeze_engine: bool = False) -> dict[str, bool]:
    """Fault injection: the next job to stream `after_tokens` tokens waits there until a
    `tidegate_hold` with 0 lets it go, its engine stopped meanwhile if `freeze_engine`
    (workers/faults.py `TokenHold`)."""
    hold = current().hold
    if after_tokens > 0:
        hold.arm(after_tokens, freeze_engine)
    else:
        hold.release()
    log.warning("fault injected: hold a job after %d tokens", after_tokens)
    return {"ok": True}


def install() -> None:
    """Registers the three commands with Celery's control panel (process-wide), as the
    `control_command` decorator would have at import."""
    control_command(args=[("alloc_latency_ms", float)],
                    signature="<alloc_latency_ms>")(tidegate_fault)
    control_command(args=[("failures", int), ("outage_s", float)],
                    signature="<failures> <outage_s>")(tidegate_store_fault)
    control_command(args=[("after_tokens", int), ("freeze_engine", bool)],
                    signature="<after_tokens> [freeze_engine]")(tidegate_hold)
