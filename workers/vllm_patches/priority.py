"""tidegate's vLLM patch: a more urgent request takes a slot from a less urgent one.

With `scheduling_policy="priority"` vLLM orders its waiting requests by priority and, when
KV blocks run out, preempts the least urgent running request. It does not preempt for a
*slot*: once `max_num_seqs` requests run, a waiting request of any priority waits for one
of them to end. A worker that lends its idle slots to another lane's jobs (the router's
borrowing, tidegate/router.py) needs its own lane's arrivals to take a slot back at once,
not after a borrowed request's hundreds of tokens.

Before each step, while every slot is taken and the most urgent waiting request is more
urgent than the least urgent running one, that running request is preempted the way vLLM
preempts for blocks (`Scheduler._preempt_request`: its blocks freed, back to waiting). It
is resumed when a slot frees, recomputing its prompt and the tokens it already made (the
prefix cache keeps most of them), and its output goes on where it stopped: the client
sees a pause, never a gap or a repeat. Requests of equal priority never preempt each
other, so a worker whose requests all carry one priority schedules exactly as vLLM does.

Turned on by TIDEGATE_VLLM_SLOT_PREEMPT=1 (the adapter sets it, workers/vllm_engine.py);
a vLLM sharing the environment without it (the benchmarks' peer) runs untouched. vLLM
internals touched: `Scheduler.schedule` (wrapped), `.running`, `.waiting`, `.policy`,
`.max_num_running_reqs`, `._request_blocks_can_be_freed`, `._preempt_request`,
`.requires_kv_delivery`, as vLLM 0.32.0 has them (PINNED_VLLM); on another vLLM it logs a
warning and leaves vLLM as it is (borrowers then wait for a slot like anyone else).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from workers.vllm_patches import on_pinned_vllm

if TYPE_CHECKING:  # vLLM's scheduler, which this patch extends (PINNED_VLLM's)
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

log = logging.getLogger("tidegate.vllm")

SLOT_PREEMPT_ENV = "TIDEGATE_VLLM_SLOT_PREEMPT"


def register() -> None:
    """The entry point vLLM calls in each process."""
    if os.environ.get(SLOT_PREEMPT_ENV) != "1":
        return
    import vllm

    if on_pinned_vllm(vllm.__version__, SLOT_PREEMPT_ENV, "no preemption for a slot"):
        _install()


_installed = False


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.core.sched.scheduler import Scheduler

    original: Callable[..., SchedulerOutput] = Scheduler.schedule  # its arguments, as given

    @functools.wraps(original)
    def schedule(self: Scheduler, *args: object, **kwargs: object) -> SchedulerOutput:
        make_room(self)
        return original(self, *args, **kwargs)

    setattr(Scheduler, "schedule", schedule)  # noqa: B010  (mypy: no method assignment)
    log.info("vLLM: a more urgent request preempts a less urgent one for a slot")


def make_room(scheduler: Scheduler) -> int:
    """Preempt, for each waiting request more urgent than the least urgent running one,
    that running one, while every slot is taken. Returns how many were preempted."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    if (scheduler.policy != SchedulingPolicy.PRIORITY or not scheduler.waiting
            or len(scheduler.running) < scheduler.max_num_running_reqs):
        return 0  # a slot is free, or nobody waits
    # Every slot taken is the steady state of a loaded engine: compare the heap's head
    # (the most urgent waiting request) first, and sort the waiting queue only when one
    # will preempt, not at every step.
    least = max(r.priority for r in scheduler.running)
    if scheduler.waiting.peek_request().priority >= least:
        return 0
    preempted = 0
    now = time.monotonic()
    for request in sorted(scheduler.waiting):  # most urgent first (Request.__lt__)
        if len(scheduler.running) < scheduler.max_num_running_reqs:
            break
        victim = max(scheduler.running, key=lambda r: (r.priority, r.arrival_time))
        if request.priority >= victim.priority:
            break  # equal priorities never preempt: vLLM's own order among them
        if not scheduler._request_blocks_can_be_freed(victim):
            break
        scheduler.running.remove(victim)
        scheduler._preempt_request(victim, now, drop_stale_output=scheduler.requires_kv_delivery)
        preempted += 1
    return preempted
