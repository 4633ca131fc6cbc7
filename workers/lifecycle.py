"""A worker's lifecycle: `starting -> standby -> active -> draining -> (restarting ->
standby)`, and the control commands the scheduler steers it with.

The state is derived, not stored, where Celery already knows the truth: a ready worker
is `active` while it consumes its pool queue (the scheduler's `add_consumer`), `draining`
once it stopped consuming but still runs jobs, `standby` when idle on its direct queue
alone. Only `starting` and `restarting` are set here, around engine loads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from celery.worker.control import control_command

from tidegate_tools.supervise import RESTART_EXIT

log = logging.getLogger("tidegate.worker")


@dataclass
class Lifecycle:
    phase: str = "starting"  # starting | ready | restarting
    pool_queue: str = ""  # the lane queue of this worker's pool
    worker: Any = None  # the Celery worker, for the queues it consumes now
    # Fault injection for health tests and drills: the allocation latency this worker
    # reports instead of the engine's own (None: report the engine's).
    forced_alloc_latency_ms: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def consumed(self) -> set[str]:
        consumer = getattr(self.worker, "consumer", None)
        task_consumer = getattr(consumer, "task_consumer", None)
        return {q.name for q in getattr(task_consumer, "queues", [])}

    def state(self, in_flight: int) -> str:
        if self.phase != "ready":
            return self.phase
        if self.pool_queue in self.consumed():
            return "active"
        return "draining" if in_flight else "standby"


LIFECYCLE = Lifecycle()


def _host() -> Any:
    from workers.service import context  # the engine host lives in the worker's context

    return context().host


@control_command(args=[("prompts", list), ("system_prompts", list)],
                 signature="<prompts> <system_prompts>")
def tidegate_warm(state: Any, prompts: list[str] | None = None,
                  system_prompts: list[str] | None = None) -> dict[str, Any]:
    """Runs prompts through the engine so their prefixes sit in its KV cache; system
    prompts are first rendered as the start of a chat with the model's template."""
    started = time.monotonic()
    texts = list(prompts or []) + [render_system(p) for p in system_prompts or []]
    _host().warm(texts)
    return {"ok": True, "warmed": len(texts), "ms": (time.monotonic() - started) * 1000}


_tokenizers: dict[str, Any] = {}


def render_system(prompt: str) -> str:
    """The chat-template rendering of a conversation's system turn: the prefix every
    request of that conversation starts with."""
    from tidegate.settings import get_settings

    model = str(get_settings().model_path)
    if model not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[model] = AutoTokenizer.from_pretrained(model)
    tok = _tokenizers[model]
    if not getattr(tok, "chat_template", None):
        return prompt
    return str(tok.apply_chat_template([{"role": "system", "content": prompt}], tokenize=False))


@control_command()
def tidegate_reset_prefix_cache(state: Any) -> dict[str, Any]:
    """The cheap fix for a slow allocator: drop the cached prefixes."""
    return {"ok": bool(_host().reset_prefix_cache())}


@control_command()
def tidegate_restart_engine(state: Any) -> dict[str, Any]:
    """Restarts the worker with a fresh engine; the scheduler drains it first.

    The worker process exits with RESTART_EXIT and its supervisor (`tidegate worker`)
    starts a fresh one in standby. A second engine inside the same process, or in the same
    pid after exec, hung here while its engine core started; a new process does not.
    """
    LIFECYCLE.phase = "restarting"
    threading.Thread(target=_exit_for_restart, name="restart", daemon=True).start()
    return {"ok": True, "restarting": True}


def _exit_for_restart() -> None:
    time.sleep(0.5)  # let the control reply reach the scheduler
    try:
        _host().stop()  # the engine core is a child process: stop it first
    except Exception:
        log.exception("engine shutdown before restart failed; restarting anyway")
    log.warning("worker process exits to be restarted by its supervisor")
    os._exit(RESTART_EXIT)


@control_command(args=[("alloc_latency_ms", float)], signature="<alloc_latency_ms>")
def tidegate_fault(state: Any, alloc_latency_ms: float | None = None) -> dict[str, Any]:
    """Fault injection: report this allocation latency until the next engine restart."""
    LIFECYCLE.forced_alloc_latency_ms = alloc_latency_ms
    log.warning("fault injected: reporting allocation latency %s ms", alloc_latency_ms)
    return {"ok": True}
