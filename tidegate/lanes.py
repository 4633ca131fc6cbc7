"""Lanes file: parsed and validated once, errors name the lane and the field."""

from __future__ import annotations

import tomllib
from datetime import datetime, time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidegate import keys

DEFAULT_LANES_FILE = Path(__file__).with_name("lanes.toml")


class PeakSpec(BaseModel):
    """A declared peak window (a festival night): expected traffic times `factor` from
    start to end, ramping linearly over `ramp_min` at each edge (scheduler/peaks.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: datetime | time = Field(
        description="When the peak window starts: an ISO datetime (once) or HH:MM in UTC (every "
        "day).")
    end: datetime | time = Field(
        description="When it ends; a daily end at or before its start ends the next day.")
    factor: float = Field(
        gt=0,
        description="Expected traffic during the window, as a multiple of the forecast without "
        "it.")
    ramp_min: float = Field(
        15.0, ge=0,
        description="Minutes over which the factor ramps linearly at each edge of the window.")


class KvPolicy(BaseModel):
    """Session-priority KV cache eviction: the parameters of workers/kvcache/policy.py.

    Priorities are on TensorRT-LLM's retention scale, 0-100, higher kept longer; a block
    whose retention lapses (`session_idle_s` without reuse) falls to 35, TensorRT-LLM's
    default. The reasoning is in workers/kvcache/policy.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_priority: int = Field(
        80, ge=0, le=100,
        description="Retention priority (0-100, higher kept longer) of a short, live session's "
        "prefix blocks.")
    short_session_turns: int = Field(
        4, ge=1,
        description="Turns a session keeps session_priority.")
    decay_per_turn: int = Field(
        5, ge=0, le=100,
        description="Priority lost by every turn after those.")
    long_session_floor: int = Field(
        40, ge=0, le=100,
        description="Where a long session's priority stops decaying.")
    one_shot_priority: int = Field(
        10, ge=0, le=100,
        description="Priority of a finished one-shot request's blocks (no session_id): evicted "
        "first.")
    shared_priority: int = Field(
        90, ge=0, le=100,
        description="Priority of blocks hit by another session or request (a lane's system "
        "prompt).")
    session_idle_s: float = Field(
        90.0, gt=0,
        description="A session quiet this long falls to the default priority (35, TensorRT-LLM's "
        "default).")


class Lane(BaseModel):
    """One lane: its queue, precision profile and limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        description="The lane's name: the NAME of its [lanes.NAME] table (not a key of the "
        "table).")
    queue: str = Field(
        description="The Celery queue this lane's workers consume (its pool queues are named from "
        "it).")
    description: str = Field(
        "",
        description="What the lane is for, in words.")
    dtype: Literal["float16", "bfloat16", "float32", "auto"] = Field(
        "float16",
        description="Model weights' precision on the lane's engines.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="KV cache precision; auto: the weights' dtype. fp8 holds about twice the "
        "tokens.")
    quantization: Literal["fp8"] | None = Field(
        None,
        description="Weight quantization, where the engine has it (fp8 on TensorRT-LLM on GPUs); "
        "none: unquantized.")
    # Engine pools in order of preference; a worker's pool defaults to its engine kind.
    pools: list[str] = Field(
        default_factory=lambda: ["trtllm", "vllm"], min_length=1,
        description="Engine pools in order of preference; the router sends a job to the first "
        "with a healthy active worker whose estimated wait keeps the lane's objective. A worker's "
        "pool defaults to its engine kind.")
    default_priority: int = Field(
        4, ge=0, le=9,
        description="A job's priority when it names none, on the public scale 0-9 (9 most "
        "urgent); also the most a tenant without max_priority may ask.")
    max_prompt_tokens: int = Field(
        1536, gt=0,
        description="A job's prompt at most, in tokens; a longer one is a 400 naming messages or "
        "prompt.")
    max_output_tokens: int = Field(
        256, gt=0,
        description="A job's max_tokens at most, and the default of the OpenAI chat route.")
    deadline_s: float = Field(
        60.0, gt=0,
        description="The longest a job may take, queue wait included, unless it asks less "
        "(deadline_s); past it the job ends expired.")
    ttft_p99_objective_ms: float = Field(
        2000.0, gt=0,
        description="The lane's TTFT p99 objective, in ms: the router's and the planner's target, "
        "and the dashboard's and the finance alert's line.")
    min_workers: int = Field(
        1, ge=0,
        description="Active workers the planner keeps at the least (0: the lane may have none and "
        "still be ready).")
    max_workers: int = Field(
        8, ge=1,
        description="Active workers the planner asks for at the most.")
    # Active workers the pre-warming planner keeps beyond its plan while a declared peak
    # window is in force (from one lead time before it): a worker that dies in the peak
    # then costs the lane no TTFT while the scheduler notices (its heartbeat's TTL) and
    # activates a standby. Not in reactive scaling, which knows no declared window.
    peak_spare_workers: int = Field(
        0, ge=0,
        description="Active workers kept beyond the plan while a declared peak window is in force "
        "(from one lead time before it), so a worker dying at the peak costs no TTFT; not in "
        "reactive scaling.")
    peaks: list[PeakSpec] = Field(
        default_factory=list,
        description="Declared peak windows ([[lanes.NAME.peaks]] tables, fields below) the "
        "forecast adds to its history.")
    # System prompts run through a worker's engine when it is activated, so the lane's
    # first real requests hit the prefix cache.
    warm_prompts: list[str] = Field(
        default_factory=list,
        description="System prompts run through a worker's engine when it is activated, so the "
        "lane's first requests hit the prefix cache (they help only a lane with "
        "share_prefix_cache = true).")
    kv_policy: KvPolicy = Field(
        default_factory=KvPolicy,
        description="Session-priority KV cache eviction parameters ([lanes.NAME.kv_policy], "
        "fields below).")
    # OS niceness of the lane's worker processes and engines (0 normal .. 19 lowest). Where
    # lanes' workers share a host's cores (their schedulers, detokenizers, CPU engines), a
    # bulk lane set higher yields the cores to a sensitive one under a peak.
    cpu_nice: int = Field(
        0, ge=0, le=19,
        description="OS niceness (0-19) of the lane's worker processes and engines: where lanes "
        "share a host's cores, a bulk lane set higher yields them to a sensitive one; the API "
        "also admits lower cpu_nice first.")
    # Messages that may wait in the lane's pool queues (None: TIDEGATE_MAX_QUEUE_DEPTH).
    max_queue_depth: int | None = Field(
        None, gt=0,
        description="Messages that may wait in the lane's pool queues; unset: "
        "TIDEGATE_MAX_QUEUE_DEPTH.")
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
    share_prefix_cache: bool = Field(
        False,
        description="False: each tenant's requests carry a cache salt of their own, so tenants "
        "never share KV blocks and cached_tokens reveals nothing across tenants. True: the lane's "
        "tenants share one prefix cache (warm_prompts and hot prefixes then help); turn it on "
        "only where they may learn of each other's prompts.")
    # The lane whose workers run this lane's jobs (None: its own). A lane that takes only
    # spare capacity (`batch`) shares its host's queue at a lower priority: Redis serves
    # its messages after every waiting one of the host's, and the host's queue-depth cap
    # refuses them first. Its queue and pools must be the host's.
    runs_on: str | None = Field(
        None,
        description="The lane whose workers run this lane's jobs (unset: its own); its queue and "
        "pools must be the host's, and Redis serves its messages after the host's waiting ones.")
    # A lane on spare capacity (runs_on) that the Batch API uses: the share of a batch's
    # jobs in flight (TIDEGATE_BATCH_IN_FLIGHT) that the batch driver queues at the host's
    # default priority, in turn with the host's own jobs rather than behind them, so a host
    # queue that never empties cannot starve a batch into expiry. The batch's other lines
    # are then queued only while the host's queues are empty. 0: all behind.
    batch_min_share: float = Field(
        0.0, ge=0.0, le=1.0,
        description="A lane on spare capacity (runs_on) used by the Batch API: the share of a "
        "batch's jobs in flight that run in turn with the host lane's jobs (at its default "
        "priority) instead of behind them, so chat traffic cannot starve a batch into expiry; "
        "its other lines are queued only while the host's queues are empty. 0: every batch "
        "job waits for spare capacity.")
    # An OpenAI-compatible request whose client goes away before the end cancels its job;
    # true: the job runs on (its row and GET /v1/jobs/{id} keep the answer).
    keep_on_disconnect: bool = Field(
        False,
        description="OpenAI-compatible routes: a client that leaves before the end cancels its "
        "job; true: the job runs on and its row keeps the answer.")
    # CUDA graphs on a GPU: decode steps replayed as captured graphs, much faster for small
    # batches, for some GPU memory and a longer engine start. False runs the engine eager
    # (to debug, or to give that memory to the KV cache). CPU engines always run eager.
    cuda_graphs: bool = Field(
        True,
        description="Capture CUDA graphs on a GPU (faster decode steps for small batches, for "
        "some GPU memory and a longer start); false runs the engine eager. CPU engines always run "
        "eager.")
    # The vLLM tool parser that reads `tool_choice: "auto"` calls out of the model's text;
    # it must match the model's chat template (hermes: <tool_call>{...}</tool_call>).
    tool_parser: str | None = Field(
        None, min_length=1, max_length=64,
        description="vLLM's tool-call parser for tool_choice \"auto\" (e.g. \"hermes\"), matching "
        "the model's chat template; unset: \"auto\" is refused (400 naming tool_choice) while "
        "\"required\" and a named function work on any model (structured output).")
    # OpenAI-compatible routes: a field neither OpenAI's, vLLM's nor tidegate's is ignored,
    # named in the `x-tidegate-ignored-fields` header and a log line, as vLLM's server
    # ignores it; true refuses it (a 400 naming it): a typo is then no silent default.
    strict_fields: bool = Field(
        False,
        description="OpenAI-compatible routes: unknown request fields are a 400 naming the field "
        "instead of being ignored (with the x-tidegate-ignored-fields header and a log line).")

    # Work-conserving lanes (tidegate/router.py): a worker of this lane lends its idle
    # slots to these lanes' jobs while their own workers have none free. A borrowed job
    # runs at the engine's lowest priority, so this lane's own arrivals preempt it at once.
    lend_to: list[str] = Field(
        default_factory=list,
        description="Lanes whose jobs may run on this lane's idle worker slots while their own "
        "workers have none free (work-conserving); a borrowed job runs at the engine's lowest "
        "priority, so this lane's arrivals preempt it at once. Empty: none.")
    lend_max_share: float = Field(
        1.0, gt=0.0, le=1.0,
        description="The share of a worker's slots lent to other lanes at most.")
    # A lane whose jobs would run at a lower precision on the lender (an FP8 KV cache or
    # FP8 weights where its own are 16-bit) borrows only with its own consent.
    borrow_lower_precision: bool = Field(
        False,
        description="This lane's jobs may borrow slots of a lane that runs at a lower precision "
        "(FP8 KV cache or weights where this lane's are 16-bit); false: only slots at least as "
        "precise as its own.")

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


_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "auto": 16}


def _precision(lane: Lane) -> tuple[int, int]:
    """(weights bits, KV cache bits) the lane's engines run at."""
    weights = 8 if lane.quantization == "fp8" else _DTYPE_BITS[lane.dtype]
    kv = 8 if lane.kv_cache_dtype.startswith("fp8") else _DTYPE_BITS[lane.dtype]
    return weights, kv


def may_borrow(guest: Lane, host: Lane) -> bool:
    """May a `guest` job run on a slot a `host` worker lends? The host must lend to it,
    and run at least the guest's precision unless the guest consents to less."""
    if guest.name not in host.lend_to:
        return False
    (hw, hk), (gw, gk) = _precision(host), _precision(guest)
    return (hw >= gw and hk >= gk) or guest.borrow_lower_precision


def lendable_slots(lane: Lane, slots: int) -> int:
    """Slots a worker of `lane` with `slots` engine slots lends at most."""
    return int(slots * lane.lend_max_share) if lane.lend_to else 0


def lenders_of(guest: Lane, lanes: dict[str, Lane]) -> list[Lane]:
    """The lanes whose workers may lend a slot to a `guest` job."""
    return [lane for lane in lanes.values() if may_borrow(guest, lane)]


def pool_queue(lane: Lane, pool: str) -> str:
    """The queue every worker of `pool` serving `lane` consumes (named in tidegate.keys)."""
    return keys.pool_queue(lane.queue, pool)


class LanesConfigError(ValueError):
    """The lanes file is missing or wrong; the message names the lane and field."""


def _read(path: Path) -> dict[str, object]:
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
        _check_lending(path, lane, lanes)
    return lanes


def _check_lending(path: Path, lane: Lane, lanes: dict[str, Lane]) -> None:
    where = f"lanes file {path}: lane {lane.name!r}: field 'lend_to'"
    if lane.lend_to and lane.runs_on is not None:
        raise LanesConfigError(f"{where}: a lane that runs on {lane.runs_on!r}'s workers has "
                               "none of its own to lend")
    for name in lane.lend_to:
        if name not in lanes or name == lane.name:
            raise LanesConfigError(f"{where}: {name!r} is not another lane of this file")


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
