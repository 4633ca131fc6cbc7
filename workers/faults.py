"""Fault injection for tests and drills, armed by control commands
(workers/fault_commands.py): store statements that fail, and a job held mid-generation.
Unarmed, each costs an attribute test or two on its path."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import psutil
from sqlalchemy import event
from sqlalchemy.engine import Connection

from store import Store


class StoreFault:
    """Fault injection for tests and drills: the worker's store statements fail as those
    of an unreachable database do (the driver's OperationalError, raised before the
    statement runs), either the next `failures` of them, or all of them for `outage_s`
    seconds counted from the first one that runs after arming."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures = 0
        self._outage_s = 0.0
        self._until: float | None = None
        self.fired = 0  # statements failed so far

    def arm(self, failures: int = 0, outage_s: float = 0.0) -> None:
        with self._lock:
            self._failures, self._outage_s, self._until = failures, outage_s, None

    def install(self, store: Store) -> None:
        event.listen(store.engine, "before_cursor_execute", self._before_execute)

    def _fails_now(self) -> bool:
        with self._lock:
            if self._outage_s and self._until is None:
                self._until = time.monotonic() + self._outage_s
            if self._until is not None and time.monotonic() < self._until:
                self.fired += 1
                return True
            if self._failures > 0:
                self._failures -= 1
                self.fired += 1
                return True
            return False

    def _before_execute(self, conn: Connection, *_: object) -> None:
        # Unarmed, a statement costs two attribute tests.
        if (self._outage_s or self._failures) and self._fails_now():
            raise conn.dialect.loaded_dbapi.OperationalError(
                "tidegate fault injection: the store is unreachable")


class TokenHold:
    """The next job to stream `after_tokens` tokens waits there, before its next token is
    read from the engine, until released (or for MAX_HOLD_S): a fault is then applied to a
    job known to be mid-generation, however fast the engine and however loaded the host.
    Its lease is renewed meanwhile, as for any running job; the engine runs on, unless
    armed with `freeze_engine`: the engine's processes are then stopped (SIGSTOP) from the
    moment the job is held until it is let go, so a fast engine cannot finish the request
    meanwhile (a deadline that passes during generation, tests/stack/test_deadlines.py)."""

    MAX_HOLD_S = 120.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._after = 0
        self._freeze = False
        self._released = threading.Event()
        self.held: str | None = None  # the job held (or let go), since the last arming

    def arm(self, after_tokens: int, freeze_engine: bool = False) -> None:
        with self._lock:
            self._after, self._freeze, self.held = after_tokens, freeze_engine, None
            self._released.clear()

    def release(self) -> None:
        with self._lock:
            self._after = 0
        self._released.set()

    @property
    def armed(self) -> bool:
        """A job will be held: jobs starting now count their tokens on their task thread."""
        return self._after > 0

    def check(self, job_id: str, tokens: int) -> None:
        """Called by the task thread after each token event it published."""
        if not self._after or tokens < self._after:
            return
        with self._lock:
            if not self._after or self.held is not None:
                return
            self.held = job_id
            freeze = self._freeze
        with frozen(engine_processes(os.getpid()) if freeze else []):
            self._released.wait(self.MAX_HOLD_S)
        with self._lock:
            self._after = 0  # one job per arming


def engine_processes(pid: int) -> list[psutil.Process]:
    """The vLLM engine core processes under process `pid` and what they spawned (none for
    an engine that runs in that process, as the sim's and TensorRT-LLM's do)."""
    cores = [c for c in psutil.Process(pid).children(recursive=True)
             if c.name().startswith("VLLM::")]
    return [q for core in cores for q in (core, *core.children(recursive=True))]


@contextlib.contextmanager
def frozen(procs: list[psutil.Process]) -> Iterator[None]:
    """`procs` stopped (SIGSTOP) for the block, let go (SIGCONT) whatever happens."""
    for proc in procs:
        proc.suspend()
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()
