"""The control commands the scheduler steers workers with
(`app.control.broadcast(name, destination=[worker])`), registered with Celery when this
module is imported (workers/celery_setup.py). The fault-injection ones are apart, in
workers/fault_commands.py, registered only where a setting asks for them."""

from __future__ import annotations

import logging
import os
import threading

from celery.utils.collections import AttributeDict
from celery.worker.consumer import Consumer
from celery.worker.control import control_command, inspect_command

from tidegate.records import RESTART_EXIT
from workers import warming
from workers.consumer import wake_consumer
from workers.warming import WarmReply
from workers.worker import Phase, current

log = logging.getLogger("tidegate.worker")

# A restarting worker waits this long at most for its reply to go out before it exits (the
# consumer's loop sends it; a loop stuck that long is not waited for).
REPLY_WAIT_S = 5.0

# `state`, in every command: Celery's AttributeDict of the worker's app, hostname and
# consumer. Replies are JSON objects, keyed by the worker's name in what the caller gets.


@inspect_command(name="tidegate_stats")
def tidegate_stats(state: AttributeDict) -> dict[str, object]:
    """Engine stats on demand, with the worker's state, jobs in flight and outcomes."""
    me = current()
    stats = me.engine_stats()
    in_flight, outcomes = me.counts()
    return {**(stats.to_dict() if stats else {}), "state": me.state(), "outcomes": outcomes,
            "in_flight": in_flight, "store_faults": me.store_fault.fired, "held": me.hold.held}


@control_command(args=[("prompts", list), ("system_prompts", list)],
                 signature="<prompts> <system_prompts>")
def tidegate_warm(state: AttributeDict, prompts: list[str] | None = None,
                  system_prompts: list[str] | None = None) -> WarmReply:
    """Runs prompts through the engine so their prefixes sit in its KV cache; system
    prompts are first rendered as the start of a chat with the model's template."""
    return warming.warm(prompts or [], system_prompts or [])


@control_command(args=[("queue", str)], signature="<queue>")
def tidegate_consume(state: AttributeDict, queue: str) -> dict[str, bool]:
    """Celery's `add_consumer`, and once the queue is consumed, the fleet told at once
    (scheduler/control.py `add_consumer` waits for that, not for a heartbeat period). The
    add runs in the consumer's loop after this reply, as Celery's own command does it."""
    state.consumer.call_soon(_consume, state.consumer, queue)
    return {"ok": True}


def _consume(consumer: Consumer, queue: str) -> None:
    consumer.add_task_queue(queue)
    try:
        wake_consumer(consumer)
    except Exception as exc:  # CLIENT LIST refused (a managed Redis): the BRPOP times out
        log.warning("could not wake the consumer for %s: %s", queue, exc)
    try:
        current().announce()
    except Exception:  # the heartbeat says it at its next beat all the same
        log.exception("could not announce consuming %s at once", queue)


@control_command()
def tidegate_reset_prefix_cache(state: AttributeDict) -> dict[str, bool]:
    """The cheap fix for a slow allocator: drop the cached prefixes."""
    warming.forget()
    return {"ok": bool(current().host.reset_prefix_cache())}


@control_command()
def tidegate_restart_engine(state: AttributeDict) -> dict[str, bool]:
    """Restarts the worker with a fresh engine; the scheduler drains it first.

    The worker process exits with RESTART_EXIT and its supervisor (`tidegate worker`)
    starts a fresh one in standby. A second engine inside the same process, or in the same
    pid after exec, hung here while its engine core started; a new process does not.
    """
    current().phase = Phase.RESTARTING
    replied = threading.Event()
    # The consumer's loop sends this command's reply as soon as it returns, then runs what
    # was scheduled meanwhile: once `replied` is set, the reply is on the broker.
    state.consumer.call_soon(replied.set)
    threading.Thread(target=_exit_for_restart, args=(replied,), name="restart",
                     daemon=True).start()
    return {"ok": True, "restarting": True}


def _exit_for_restart(replied: threading.Event) -> None:
    if not replied.wait(REPLY_WAIT_S):  # the scheduler waits for this reply
        log.warning("the restart's reply did not go out within %.0f s; exiting anyway",
                    REPLY_WAIT_S)
    try:
        current().stop()  # the engine core is a child process: stop it first
    except Exception:
        log.exception("engine shutdown before restart failed; restarting anyway")
    log.warning("worker process exits to be restarted by its supervisor")
    os._exit(RESTART_EXIT)
