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
4. Work-conserving lanes: when no pool of the lane has a free slot (a job would wait) and
   another lane's active worker has one, the job borrows it: it goes to that worker's
   direct queue and runs at the engine's lowest priority, so the lender's own arrivals
   preempt it at once (workers/vllm_patches/priority.py). Only a lender that lends to the
   lane (`lend_to`) at a precision the lane accepts (tidegate.lanes.may_borrow), whose own
   pool queue is empty, with no more than `lend_max_share` of its slots lent. A slot is
   free when the worker's last beat shows it idle and this process has not sent a
   borrowed job there since (`lent`). Neither LoRA nor session-affinity jobs borrow. A
   lane with no active worker of its own is served by lenders alone: an idle slot now,
   else its pool queue of a lender's pool, from which lending workers pull
   (workers/lending.py).

Healthy means a heartbeat within its TTL and state `active`; a worker that dies stops
heartbeating, so within one TTL the router stops choosing it. The router is pure: the
fleet and queue backlogs come in as values, which is what the table tests feed it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tidegate.lanes import Lane, lendable_slots, may_borrow, pool_queue
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
    borrowed: int = 0  # other lanes' jobs it runs on lent slots
    beat_ts: float = 0.0  # epoch seconds of the beat this view is of

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
                   capabilities=None if hb.capabilities is None else frozenset(hb.capabilities),
                   borrowed=hb.borrowed, beat_ts=hb.ts)


@dataclass(frozen=True)
class Route:
    queue: str  # Celery queue the job is published to
    reason: str  # the decision and why, stored on the job
    worker: str | None = None  # set when the queue is one worker's direct queue
    borrowed: bool = False  # on another lane's lent slot


class NoRoute(Exception):
    """No worker can take the job; `field` names the request field at fault, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def route(lane: Lane, fleet: Sequence[WorkerView], backlog: Mapping[str, int],
          direct_queue: Callable[[str], str], *, lora: str | None = None,
          session_worker: str | None = None, needs: Mapping[str, str] | None = None,
          lanes: Mapping[str, Lane] | None = None, lent: Mapping[str, int] | None = None,
          ) -> Route:
    """`backlog` maps a queue name to the messages waiting in it (the lenders' pool queues
    too); `needs` the capabilities the job needs, each to the request field that needs it;
    `lanes` every lane (None: no borrowing); `lent` the borrowed jobs this process sent to
    each worker since that worker's last beat."""
    healthy = [w for w in fleet if w.state == WorkerState.ACTIVE and lane.name in w.lanes]
    healthy = _able(lane, healthy, needs or {})
    if lora is not None:
        return _route_lora(lane, healthy, lora, direct_queue)
    sticky = next((w for w in healthy if w.name == session_worker), None)
    if sticky is not None and not sticky.saturated:
        return Route(direct_queue(sticky.name), f"session affinity: {sticky.name} holds the "
                     "session's prefix", worker=sticky.name)
    notes = [f"session's worker {session_worker} unavailable"] if session_worker else []
    if not healthy and lanes:
        lent_route = _lenders_only(lane, fleet, backlog, lanes, lent or {}, needs or {},
                                   direct_queue)
        if lent_route is not None:
            return lent_route
    own = _route_pools(lane, healthy, backlog, notes)
    if own.wait_ms <= 0 or not lanes:
        return own.route
    lender = _lender(lane, fleet, backlog, lanes, lent or {}, needs or {})
    if lender is None:
        return own.route
    return Route(direct_queue(lender.name), f"borrowed an idle slot of {lender.name} "
                 f"({lender.pool}, lanes {', '.join(sorted(lender.lanes))}): no pool of lane "
                 f"{lane.name!r} has a free one (estimated wait {own.wait_ms:.0f} ms)",
                 worker=lender.name, borrowed=True)


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


@dataclass(frozen=True)
class _PoolChoice:
    route: Route
    wait_ms: float  # the chosen pool's estimated wait


def _route_pools(lane: Lane, healthy: Sequence[WorkerView], backlog: Mapping[str, int],
                 notes: list[str]) -> _PoolChoice:
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
            return _PoolChoice(Route(queue, "; ".join(notes)), wait_ms)
        notes.append(f"pool {pool}: estimated wait {wait_ms:.0f} ms breaks the "
                     f"{lane.ttft_p99_objective_ms:.0f} ms objective")
        options.append((wait_ms, pool))
    if not options:
        raise NoRoute(f"no healthy worker serves lane {lane.name!r} ({'; '.join(notes)})")
    wait_ms, pool = min(options)
    notes.insert(0, f"every pool is over its objective: shortest wait in {pool}")
    return _PoolChoice(Route(pool_queue(lane, pool), "; ".join(notes)), wait_ms)


def _lender(lane: Lane, fleet: Sequence[WorkerView], backlog: Mapping[str, int],
            lanes: Mapping[str, Lane], lent: Mapping[str, int],
            needs: Mapping[str, str]) -> WorkerView | None:
    """The other lanes' active worker with the most slots to lend to a `lane` job (the
    first by name among equals)."""
    best, best_room = None, 0
    for w in sorted(fleet, key=lambda v: v.name):
        owner = _owner(w, lanes)
        if (owner is None or w.state != WorkerState.ACTIVE or lane.name in w.lanes
                or not may_borrow(lane, owner) or not all(w.can(c) for c in needs)):
            continue
        if backlog.get(pool_queue(owner, w.pool), 0):
            continue  # its own lane's jobs are waiting: no slot of it is idle
        room = _room(w, lendable_slots(owner, w.slots), lent.get(w.name, 0))
        if room > best_room:
            best, best_room = w, room
    return best


def _lenders_only(lane: Lane, fleet: Sequence[WorkerView], backlog: Mapping[str, int],
                  lanes: Mapping[str, Lane], lent: Mapping[str, int], needs: Mapping[str, str],
                  direct_queue: Callable[[str], str]) -> Route | None:
    """A lane with no active worker of its own, served by other lanes' lent slots alone:
    an idle one now, else its own pool queue of a lender's pool, which lenders pull from
    as their slots go idle (workers/lending.py). None: no lender either."""
    lender = _lender(lane, fleet, backlog, lanes, lent, needs)
    if lender is not None:
        return Route(direct_queue(lender.name), f"borrowed an idle slot of {lender.name} "
                     f"({lender.pool}): lane {lane.name!r} has no active worker of its own",
                     worker=lender.name, borrowed=True)
    pools = sorted({w.pool for w in fleet if w.state == WorkerState.ACTIVE
                    and (owner := _owner(w, lanes)) is not None and may_borrow(lane, owner)
                    and all(w.can(c) for c in needs)})
    if not pools:
        return None
    return Route(pool_queue(lane, pools[0]), f"lane {lane.name!r} has no active worker of its "
                 f"own: queued for the first slot a lending worker of pool {pools[0]} frees")


def _owner(w: WorkerView, lanes: Mapping[str, Lane]) -> Lane | None:
    """The lane a worker was started for (the others it hosts run on that one's workers)."""
    return next((lanes[n] for n in w.lanes if n in lanes and lanes[n].runs_on is None), None)


def _room(w: WorkerView, lendable: int, sent: int) -> int:
    """Slots `w` may still lend: idle at its last beat, less what was sent since, within
    its lending cap."""
    return min(w.slots - w.busy - sent, lendable - w.borrowed - sent)


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
