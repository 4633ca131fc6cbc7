"""Lanes file: parsed and validated once, errors name the lane and the field."""

from __future__ import annotations

import tomllib
from datetime import datetime, time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate import keys

DEFAULT_LANES_FILE = Path(__file__).with_name("lanes.toml")


class PeakSpec(BaseModel):
    """A declared peak window (a festival night): expected traffic times `factor` from
    start to end, ramping linearly over `ramp_min` at each edge (scheduler/peaks.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: datetime | time  # ISO datetime: once; "HH:MM" (UTC): every day
    end: datetime | time  # a daily end at or before start ends the next day
    factor: float = Field(gt=0)
    ramp_min: float = Field(15.0, ge=0)


class KvPolicy(BaseModel):
    """Session-priority KV cache eviction: the parameters of workers/kvcache/policy.py.

    Priorities are on TensorRT-LLM's retention scale, 0-100, higher kept longer; a block
    whose retention lapses (`session_idle_s` without reuse) falls to 35, TensorRT-LLM's
    default. The reasoning is in workers/kvcache/policy.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_priority: int = Field(80, ge=0, le=100)  # a short, live session's prefix
    short_session_turns: int = Field(4, ge=1)  # turns a session keeps session_priority
    decay_per_turn: int = Field(5, ge=0, le=100)  # lost by every turn after those
    long_session_floor: int = Field(40, ge=0, le=100)  # where a long session stops decaying
    one_shot_priority: int = Field(10, ge=0, le=100)  # finished one-shot requests: first out
    shared_priority: int = Field(90, ge=0, le=100)  # blocks hit by another session or request
    session_idle_s: float = Field(90.0, gt=0)  # a session's prefix outlives its last use


class Lane(BaseModel):
    """One lane: its queue, precision profile and limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    queue: str  # Celery queue consumed by this lane's workers
    description: str = ""
    dtype: Literal["float16", "bfloat16", "float32", "auto"] = "float16"  # weights
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    quantization: Literal["fp8"] | None = None  # weights, where the engine has it
    # Engine pools in order of preference; a worker's pool defaults to its engine kind.
    pools: list[str] = Field(default_factory=lambda: ["trtllm", "vllm"], min_length=1)
    default_priority: int = Field(4, ge=0, le=9)  # public scale: 9 is the most urgent
    max_prompt_tokens: int = Field(1536, gt=0)
    max_output_tokens: int = Field(256, gt=0)
    deadline_s: float = Field(60.0, gt=0)  # longest a job may take, queue wait included
    ttft_p99_objective_ms: float = Field(2000.0, gt=0)
    min_workers: int = Field(1, ge=0)  # active workers the planner keeps at the least
    max_workers: int = Field(8, ge=1)  # and at the most
    # Active workers the pre-warming planner keeps beyond its plan while a declared peak
    # window is in force (from one lead time before it): a worker that dies in the peak
    # then costs the lane no TTFT while the scheduler notices (its heartbeat's TTL) and
    # activates a standby. Not in reactive scaling, which knows no declared window.
    peak_spare_workers: int = Field(0, ge=0)
    peaks: list[PeakSpec] = Field(default_factory=list)
    # System prompts run through a worker's engine when it is activated, so the lane's
    # first real requests hit the prefix cache.
    warm_prompts: list[str] = Field(default_factory=list)
    kv_policy: KvPolicy = Field(default_factory=KvPolicy)
    # OS niceness of the lane's worker processes and engines (0 normal .. 19 lowest). Where
    # lanes' workers share a host's cores (their schedulers, detokenizers, CPU engines), a
    # bulk lane set higher yields the cores to a sensitive one under a peak.
    cpu_nice: int = Field(0, ge=0, le=19)
    # Messages that may wait in the lane's pool queues (None: TIDEGATE_MAX_QUEUE_DEPTH).
    max_queue_depth: int | None = Field(None, gt=0)
    # Prefix-cache isolation. False (the default): each tenant's requests carry a cache
    # salt of their own (vLLM's `cache_salt`), tenants never share KV blocks, and the
    # `cached_tokens` (and TTFT) a tenant sees says nothing about another tenant's
    # prompts. True: the lane's tenants share one cache: a system prompt common to the
    # lane is computed once for all of them, and `warm_prompts` and the hot prefixes
    # warmed into activated workers (unsalted) serve their requests. vLLM salts a
    # prompt's first block and chains every later block's hash from it, so a salt covers
    # the whole prompt: a lane cannot share its system prompt while isolating what
    # follows. Turn it on only where the lane's tenants may learn of each other's prompts
    # (one organisation, or prompts that are not secret).
    share_prefix_cache: bool = False
    # The lane whose workers run this lane's jobs (None: its own). A lane that takes only
    # spare capacity (`batch`) shares its host's queue at a lower priority: Redis serves
    # its messages after every waiting one of the host's, and the host's queue-depth cap
    # refuses them first. Its queue and pools must be the host's.
    runs_on: str | None = None
    # An OpenAI-compatible request whose client goes away before the end cancels its job;
    # true: the job runs on (its row and GET /v1/jobs/{id} keep the answer).
    keep_on_disconnect: bool = False
    # CUDA graphs on a GPU: decode steps replayed as captured graphs, much faster for small
    # batches, for some GPU memory and a longer engine start. False runs the engine eager
    # (to debug, or to give that memory to the KV cache). CPU engines always run eager.
    cuda_graphs: bool = True

    def cache_salt(self, tenant_id: int) -> str | None:
        """The prefix-cache salt of a tenant's requests on this lane (None: shared)."""
        return None if self.share_prefix_cache else f"tenant-{tenant_id}"


PRIORITY_MIN, PRIORITY_MAX = 0, 9


def redis_priority(public: int) -> int:
    """The public scale (0 lowest .. 9 most urgent) onto Redis' steps, where 0 is served
    first."""
    if not PRIORITY_MIN <= public <= PRIORITY_MAX:
        raise ValueError(f"priority {public} is outside {PRIORITY_MIN}-{PRIORITY_MAX}")
    return PRIORITY_MAX - public


def pool_queue(lane: Lane, pool: str) -> str:
    """The queue every worker of `pool` serving `lane` consumes (named in tidegate.keys)."""
    return keys.pool_queue(lane.queue, pool)


class LanesConfigError(ValueError):
    """The lanes file is missing or wrong; the message names the lane and field."""


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LanesConfigError(f"lanes file {path}: {exc}") from exc


def load_lanes(path: Path | str | None = None) -> dict[str, Lane]:
    path = Path(path) if path else DEFAULT_LANES_FILE
    raw = _read(path)
    lanes_raw = raw.get("lanes")
    if not isinstance(lanes_raw, dict) or not lanes_raw:
        raise LanesConfigError(f"lanes file {path}: needs at least one [lanes.NAME] table")
    lanes = {}
    for name, body in lanes_raw.items():
        try:
            lanes[name] = Lane(name=name, **body)
        except (ValidationError, TypeError) as exc:
            raise LanesConfigError(f"lanes file {path}: lane {name!r}: {_first(exc)}") from exc
    for lane in lanes.values():
        _check_host(path, lane, lanes)
    return lanes


def _check_host(path: Path, lane: Lane, lanes: dict[str, Lane]) -> None:
    if lane.runs_on is None:
        return
    host = lanes.get(lane.runs_on)
    where = f"lanes file {path}: lane {lane.name!r}: field 'runs_on'"
    if host is None or host.runs_on is not None:
        raise LanesConfigError(f"{where}: {lane.runs_on!r} is not a lane with workers of its own")
    if (lane.queue, lane.pools) != (host.queue, host.pools):
        raise LanesConfigError(f"{where}: its queue and pools must be {host.name!r}'s "
                               f"({host.queue!r}, {host.pools})")


def hosted_lanes(lanes: dict[str, Lane], host: str) -> tuple[str, ...]:
    """The lane `host` and every lane that runs on its workers."""
    return (host, *sorted(name for name, lane in lanes.items() if lane.runs_on == host))


# OpenAI's `service_tier` values a lanes file may map (api/openai_api.py).
SERVICE_TIERS = ("auto", "default", "flex", "priority", "scale")


def load_service_tiers(path: Path | str | None, lanes: dict[str, Lane]) -> dict[str, str]:
    """The `[service_tiers]` table: an OpenAI service tier -> the lane it runs on."""
    path = Path(path) if path else DEFAULT_LANES_FILE
    tiers = _read(path).get("service_tiers", {})
    if not isinstance(tiers, dict):
        raise LanesConfigError(f"lanes file {path}: [service_tiers] must be a table")
    for tier, lane in tiers.items():
        if tier not in SERVICE_TIERS:
            raise LanesConfigError(f"lanes file {path}: [service_tiers]: unknown tier {tier!r}; "
                                   f"tiers are {', '.join(SERVICE_TIERS)}")
        if lane not in lanes:
            raise LanesConfigError(f"lanes file {path}: [service_tiers]: tier {tier!r} names "
                                   f"no lane ({lane!r})")
    return dict(tiers)


def _first(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        return f"field {field!r}: {err['msg']}"
    return str(exc)
