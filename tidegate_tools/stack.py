"""The one stack launcher: `make demo`, the stack tests and the benchmarks start tidegate's
processes (an optional private Redis, one worker per entry, the API and the batch driver)
with it, wait for them with its one readiness poll, and have them all stopped on the way
out, also when a start fails."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api.fleet import active_workers
from tidegate_tools.procs import (
    Proc,
    free_port,
    start_api,
    start_batches,
    start_redis,
    start_worker,
    wait_until,
)

START_TIMEOUT_S = 240.0  # vLLM engines loading at once on two cores


@dataclass(frozen=True)
class WorkerSpec:
    lane: str
    name: str  # its Celery node name
    cpus: str | None = None  # CPU build: the cores its engine is pinned to
    pool: str | None = None  # default: its engine's kind
    engine: str | None = None  # `tidegate worker --engine`; default: vllm


@dataclass
class RunningStack:
    base_url: str  # the API
    workers: list[str]  # worker names
    # In start order: Redis, workers, the API, the batch driver (`tidegate batches`).
    procs: list[Proc] = field(default_factory=list)
    redis_url: str | None = None  # the private Redis, when the launcher started one


def api_ready(base_url: str, workers: Collection[str]) -> bool:
    """The API answers /readyz with 200 and /fleetz shows every one of `workers` active;
    with no worker to wait for, /readyz alone. Not /fleetz's `ready`: a stack serves some
    lanes, not every lane of its lanes file."""
    try:
        if httpx.get(f"{base_url}/readyz", timeout=2).status_code != 200:
            return False
        if not workers:
            return True
        report = httpx.get(f"{base_url}/fleetz", timeout=2).json()
        return set(workers) <= active_workers(report)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextmanager
def running_stack(env: Mapping[str, str], workers: Sequence[WorkerSpec], logs: Path, *,
                  private_redis: bool = False, api_port: int | None = None,
                  timeout_s: float = START_TIMEOUT_S,
                  waiting: Callable[[float], None] | None = None) -> Iterator[RunningStack]:
    """Starts the stack and yields it once ready; stops every process it started on exit.

    env: the processes' environment (TIDEGATE_* settings). private_redis: a redis-server
    of its own on a free port, its URL put in the processes' TIDEGATE_REDIS_URL.
    waiting: called with the seconds waited so far, about once a second, while engines load.
    """
    env = dict(env)
    stack = RunningStack(base_url="", workers=[w.name for w in workers])
    try:
        if private_redis:
            port = free_port()
            stack.procs.append(start_redis(port, logs))
            stack.redis_url = env["TIDEGATE_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        # Workers first: their engines load while the API starts.
        stack.procs += [start_worker(env, w.lane, w.name, logs, pool=w.pool, cpus=w.cpus,
                                     engine=w.engine)
                        for w in workers]
        port = api_port or free_port()
        stack.procs.append(start_api(env, port, logs))
        stack.base_url = f"http://127.0.0.1:{port}"
        stack.procs.append(start_batches(env, logs))
        _wait_ready(stack, timeout_s, waiting)
        yield stack
    finally:
        for proc in reversed(stack.procs):
            proc.stop()


def _wait_ready(stack: RunningStack, timeout_s: float,
                waiting: Callable[[float], None] | None) -> None:
    started, told = time.monotonic(), [0]

    def ready() -> bool:
        waited = time.monotonic() - started
        if waiting is not None and int(waited) > told[0]:
            told[0] = int(waited)
            waiting(waited)
        return api_ready(stack.base_url, stack.workers)

    wait_until(ready, timeout_s, f"the API's /readyz, and /fleetz with workers "
               f"{sorted(stack.workers)} active", stack.procs, poll_s=0.5)
