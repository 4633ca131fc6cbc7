"""Typed records that cross processes: worker states, job statuses, a worker's engine
figures and its heartbeat.

A heartbeat has one writer (the worker, workers/worker.py) and one reader
(`Heartbeat.from_json`, used through `tidegate.fleet`); every other module sees the
dataclass, never the JSON. Statuses and states are enums whose values are the strings
stored in the database, in Redis and in the API's JSON, so they compare equal to them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any


class WorkerState(StrEnum):
    """`starting -> standby -> active -> draining -> (restarting -> standby)`."""

    STARTING = "starting"  # loading and warming its engine
    STANDBY = "standby"  # engine warm; consumes only its direct queue
    ACTIVE = "active"  # consumes its pool's lane queue
    DRAINING = "draining"  # stopped consuming the lane queue; finishing jobs in flight
    RESTARTING = "restarting"  # exiting so that its supervisor starts a fresh process
    # Its engine died: out of rotation, consuming nothing, its jobs left to other workers;
    # it exits for its supervisor to restart it (workers/worker.py `Worker.engine_died`).
    FAILED = "failed"


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


ACTIVE_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.RUNNING})
TERMINAL_STATUSES = frozenset(set(JobStatus) - ACTIVE_STATUSES)


class BatchStatus(StrEnum):
    """A Batch API batch's status (OpenAI's names): `validating -> in_progress ->
    finalizing -> completed`, or `failed`; a cancel, or the window's end, goes through
    `cancelling` to `cancelled` or `expired`."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


# In the order a batch passes them (a tuple: the store's SQL lists them as they are).
OPEN_BATCH_STATUSES = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS,
                       BatchStatus.FINALIZING, BatchStatus.CANCELLING)
ENDED_BATCH_STATUSES = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                        BatchStatus.CANCELLED)


class DeliveryStatus(StrEnum):
    """A webhook delivery's status: `pending -> sending -> delivered`, back to `pending`
    after a failed attempt, or `failed` for good (store/webhooks.py)."""

    PENDING = "pending"
    SENDING = "sending"  # claimed by a sender until its lease ends
    DELIVERED = "delivered"
    FAILED = "failed"

# A worker process asking its supervisor (`tidegate worker`) for a fresh process exits
# with this code; any other code ends the supervisor too.
RESTART_EXIT = 75


@dataclass
class EngineStats:
    """What the engine itself reports; sampled by heartbeats and control commands."""

    kind: str = ""
    running: int = 0
    waiting: int = 0
    max_running_seen: int = 0  # highest running count of any step since start
    kv_usage: float = 0.0  # fraction of KV blocks in use
    kv_cache_dtype: str = ""
    kv_capacity_tokens: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)  # engine counters
    unfinished: int = 0  # requests the engine holds right now (live, not per step)
    aborted: int = 0  # requests aborted while the engine still held them
    kv_policy: str = ""  # the eviction order the engine runs
    # Mean time per scheduler step spent allocating KV cache, recent steps (None: unknown).
    avg_cache_allocation_latency_ms: float | None = None
    kv_evictions: int = 0  # cached blocks reused for new contents

    @property
    def prefix_hit_rate(self) -> float:
        queries = self.prefix_queries_tokens
        return self.prefix_hits_tokens / queries if queries else 0.0

    def to_dict(self) -> dict[str, object]:
        """The fields, and the hit rate for readers of the JSON (ops scripts, tests)."""
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}

    @classmethod
    def from_dict(cls, body: Mapping[str, object]) -> EngineStats:
        """From a heartbeat's JSON (`to_dict`): the fields this version knows."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: v for k, v in body.items() if k in known}
        return cls(**values)


@dataclass(frozen=True)
class Heartbeat:
    """A worker as it advertises itself every `heartbeat_s` (TTL: five periods)."""

    name: str  # the Celery node name, also the key of its direct queue
    state: WorkerState
    lanes: tuple[str, ...]
    pool: str  # the engine pool it serves (trtllm, vllm, or a lane's own pool names)
    slots: int  # sequences its engine batches at once
    queues: tuple[str, ...] = ()  # its pool queue (when active) and its direct queue
    consuming: tuple[str, ...] = ()  # the queues it consumes right now
    model: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""  # what the engine really runs (FP8 may fall back on a CPU)
    lora: tuple[str, ...] = ()  # LoRA adapters its engine serves
    pid: int = 0
    boot: str = ""  # a new value in every process: tells a restarted worker from the old
    host: str = ""
    ts: float = 0.0  # epoch seconds of this beat
    engine: str = ""  # the engine's kind once loaded ("" while it starts)
    stats: EngineStats | None = None  # None until the engine is loaded
    mean_job_ms: float | None = None  # recent mean run time of a job, for the router
    metrics_port: int = 0  # where it serves /metrics, on `host` (0: nowhere)
    # What its engine can do (tidegate/capabilities.py), sorted; None: a worker older than
    # capabilities, which says nothing and is taken to be able (it refuses on its own).
    capabilities: tuple[str, ...] | None = None
    borrowed: int = 0  # other lanes' jobs running on slots it lent (tidegate/router.py)

    def to_json(self) -> str:
        body = asdict(self)
        body["stats"] = self.stats.to_dict() if self.stats is not None else None
        return json.dumps(body)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Heartbeat:
        body = json.loads(raw)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in body.items() if k in known}
        for name in ("lanes", "queues", "consuming", "lora"):
            values[name] = tuple(values.get(name) or ())
        if values.get("capabilities") is not None:
            values["capabilities"] = tuple(values["capabilities"])
        values["state"] = WorkerState(values["state"])
        stats = values.get("stats")
        values["stats"] = EngineStats.from_dict(stats) if stats is not None else None
        return cls(**values)

    @property
    def lane(self) -> str:
        """The lane it serves (a worker serves one)."""
        return self.lanes[0]


class AttemptOutcome(StrEnum):
    """How one attempt of a job ended in its worker (workers/runner.py): in the worker's
    logs, its `tidegate_stats` outcome counts and Celery's "succeeded" line. Not the job's
    status: an attempt may end with the job left to another attempt."""

    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    ERROR = "error"  # the job ended `error` (an engine refusal, a bug, a failed resume)
    POISON = "poison"  # taken up more than max_attempts times: ended `error`, code poison
    SKIPPED_TERMINAL = "skipped-terminal"  # the job had already ended: nothing to do
    LEASE_LOST = "lease-lost"  # another attempt took the job over; not acked
    REQUEUED = "requeued"  # the store or Redis stayed down; the task goes back, unacked
    ENGINE_DEAD = "engine-dead"  # the engine died under the job; left to another worker
