"""The router: which queue a job goes to, and why.

For each job, in order:
0. A job that needs an engine capability (tidegate/capabilities.py: n, logprobs,
   structured output...) is routed among the lane's healthy workers that have it; when
   the lane has healthy workers and none has it, the job is refused naming the request's
   field (a 400: no worker of the lane will ever run it), not queued to fail later.
1. A LoRA job goes to the direct queue of the least busy healthy worker that has the
   adapter (a pool queue would let a worker without it take the job).
2. A session goes to its last worker's direct queue while that worker is healthy and not
   saturated: its prefix is in that worker's KV cache.
3. Otherwise the lane's pools in preference order (TensorRT-LLM, then vLLM by default):
   a pool is skipped when it has no healthy active worker for the lane, or when its
   estimated queue wait breaks the lane's TTFT objective. When every pool with workers
   breaks it, the one with the shortest estimated wait takes the job.

Healthy means a heartbeat within its TTL and state `active`; a worker that dies stops
heartbeating, so within one TTL the router stops choosing it. The router is pure: the
fleet and queue backlogs come in as values, which is what the table tests feed it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tidegate.lanes import Lane, pool_queue
from tidegate.records import Heartbeat, WorkerState

DEFAULT_JOB_MS = 1000.0  # service time assumed for a worker that has not finished a job yet


@dataclass(frozen=True)
class WorkerView:
    """A worker as its last heartbeat describes it."""

    name: str
    pool: str
    lanes: frozenset[str]
    state: WorkerState
    slots: int
    running: int = 0
    waiting: int = 0
    lora: frozenset[str] = frozenset()
    mean_job_ms: float | None = None  # recent mean service time of a job
    capabilities: frozenset[str] | None = None  # its engine's; None: unknown (assumed able)

    def can(self, capability: str) -> bool:
        return self.capabilities is None or capability in self.capabilities

    @property
    def busy(self) -> int:
        return self.running + self.waiting

    @property
    def saturated(self) -> bool:
        return self.busy >= self.slots

    @classmethod
    def from_heartbeat(cls, hb: Heartbeat) -> WorkerView:
        running, waiting = (hb.stats.running, hb.stats.waiting) if hb.stats else (0, 0)
        return cls(name=hb.name, pool=hb.pool, lanes=frozenset(hb.lanes), state=hb.state,
                   slots=hb.slots, running=running, waiting=waiting, lora=frozenset(hb.lora),
                   mean_job_ms=hb.mean_job_ms,
                   capabilities=None if hb.capabilities is None else frozenset(hb.capabilities))


@dataclass(frozen=True)
class Route:
    queue: str  # Celery queue the job is published to
    reason: str  # the decision and why, stored on the job
    worker: str | None = None  # set when the queue is one worker's direct queue


class NoRoute(Exception):
    """No worker can take the job; `field` names the request field at fault, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def route(lane: Lane, fleet: Sequence[WorkerView], backlog: Mapping[str, int],
          direct_queue: Callable[[str], str], *, lora: str | None = None,
          session_worker: str | None = None, needs: Mapping[str, str] | None = None) -> Route:
    """`backlog` maps a queue name to the messages waiting in it; `needs` the capabilities
    the job needs, each to the request field that needs it."""
    healthy = [w for w in fleet if w.state == WorkerState.ACTIVE and lane.name in w.lanes]
    healthy = _able(lane, healthy, needs or {})
    if lora is not None:
        return _route_lora(lane, healthy, lora, direct_queue)
    sticky = next((w for w in healthy if w.name == session_worker), None)
    if sticky is not None and not sticky.saturated:
        return Route(direct_queue(sticky.name), f"session affinity: {sticky.name} holds the "
                     "session's prefix", worker=sticky.name)
    notes = [f"session's worker {session_worker} unavailable"] if session_worker else []
    return _route_pools(lane, healthy, backlog, notes)


def _able(lane: Lane, healthy: list[WorkerView], needs: Mapping[str, str]) -> list[WorkerView]:
    """The healthy workers that have every capability the job needs. None left while some
    were healthy: refused, naming the field of the first capability none of them has."""
    able = [w for w in healthy if all(w.can(c) for c in needs)]
    if able or not healthy:  # no healthy worker at all: the usual 503 below
        return able
    for capability, field in needs.items():
        if not any(w.can(capability) for w in healthy):
            raise NoRoute(f"{field}: no active worker of lane {lane.name!r} can do this (its "
                          f"engines lack the {capability!r} capability)", field=field)
    raise NoRoute(f"{', '.join(needs.values())}: no active worker of lane {lane.name!r} "
                  "can do all of these at once", field=next(iter(needs.values())))


def _route_lora(lane: Lane, healthy: Sequence[WorkerView], lora: str,
                direct_queue: Callable[[str], str]) -> Route:
    having = [w for w in healthy if lora in w.lora]
    if not having:
        raise NoRoute(f"lora: no healthy worker of lane {lane.name!r} serves LoRA adapter "
                      f"{lora!r}", field="lora")
    rank = {pool: i for i, pool in enumerate(lane.pools)}
    best = min(having, key=lambda w: (w.busy / max(w.slots, 1), rank.get(w.pool, len(rank))))
    return Route(direct_queue(best.name), f"LoRA adapter {lora!r} is on {best.name}",
                 worker=best.name)


def _route_pools(lane: Lane, healthy: Sequence[WorkerView], backlog: Mapping[str, int],
                 notes: list[str]) -> Route:
    options: list[tuple[float, str]] = []
    for i, pool in enumerate(lane.pools):
        members = [w for w in healthy if w.pool == pool]
        if not members:
            notes.append(f"pool {pool}: no healthy active worker")
            continue
        queue = pool_queue(lane, pool)
        wait_ms = estimated_wait_ms(members, backlog.get(queue, 0))
        if wait_ms <= lane.ttft_p99_objective_ms:
            label = "preferred pool" if i == 0 else "fallback pool"
            notes.insert(0, f"{label} {pool} (estimated wait {wait_ms:.0f} ms)")
            return Route(queue, "; ".join(notes))
        notes.append(f"pool {pool}: estimated wait {wait_ms:.0f} ms breaks the "
                     f"{lane.ttft_p99_objective_ms:.0f} ms objective")
        options.append((wait_ms, pool))
    if not options:
        raise NoRoute(f"no healthy worker serves lane {lane.name!r} ({'; '.join(notes)})")
    wait_ms, pool = min(options)
    notes.insert(0, f"every pool is over its objective: shortest wait in {pool}")
    return Route(pool_queue(lane, pool), "; ".join(notes))


def estimated_wait_ms(members: Sequence[WorkerView], queued: int) -> float:
    """Time before a new job starts: jobs ahead of it that find no free slot, spread over
    the pool's slots, each taking the pool's recent mean service time."""
    slots = sum(w.slots for w in members)
    ahead = queued + sum(w.busy for w in members)
    if ahead < slots:
        return 0.0
    times = [w.mean_job_ms for w in members if w.mean_job_ms]
    job_ms = sum(times) / len(times) if times else DEFAULT_JOB_MS
    return (ahead - slots + 1) / slots * job_ms
