"""The one settings object. Environment variables are read here and nowhere else.

Invalid settings stop the process at start with a message naming the setting.

`Settings` holds the workers', the engines', the scheduler's and operations' fields; the
other groups are its bases, each in a module of its own: tidegate/settings_connections.py
(Redis, the store, the model, the lanes file), tidegate/settings_frontdoor.py (the API,
admission, batches, files, quotas, retention) and tidegate/settings_webhooks.py.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tidegate.clock import REAL, Clock
from tidegate.lanes import Lane, LanesConfigError, load_lanes, load_service_tiers
from tidegate.settings_connections import DATA_DIR, ConnectionSettings, StoreTimeouts
from tidegate.settings_frontdoor import FrontDoorSettings
from tidegate.settings_webhooks import WebhookSettings

__all__ = ["DATA_DIR", "Settings", "SettingsError", "StoreTimeouts", "get_settings"]


# pydantic lists a base's fields before its subclass's, and the last base's first: so the
# fields read connections, front door, webhooks, then these, the order docs/settings.md
# shows them in.
class Settings(WebhookSettings, FrontDoorSettings, ConnectionSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIDEGATE_", extra="ignore")

    stream_maxlen: int = Field(
        10_000, gt=0,
        description="Events kept per job stream in Redis (an approximate trim).")
    stream_ttl_s: int = Field(
        3600, gt=0,
        description="A job's token stream lives this long in Redis after its terminal event (an "
        "EXPIRE written with that event).")
    # A lane's hot prefix (tenants' system prompts, tidegate/hot.py) is forgotten this
    # long after its last use: a day keeps a daily peak's prompts for the next one.
    hot_prefix_ttl_s: int = Field(
        86400, gt=0,
        description="A lane's hot prefix (a system prompt warmed into activated workers) is "
        "forgotten this long after its last use; a day keeps a daily peak's prompts for the next "
        "one.")
    heartbeat_s: float = Field(
        2.0, gt=0,
        description="Worker heartbeat period; a worker's record and its jobs' leases live 5 "
        "periods + 1 s, at least 10 s (a cleanly stopped worker removes its record at once).")
    # A SCAN per submit was a large share of the API's time; an activation is announced,
    # so the cache's age only bounds how late the API sees a beat nobody announced.
    fleet_cache_s: float = Field(
        0.25, gt=0,
        description="The API's routers read the workers' heartbeats again after this long; a "
        "worker's activation is announced and seen at once.")
    # A job taken up this many times, each attempt dying with its worker, ends `poison`.
    max_attempts: int = Field(
        3, ge=1,
        description="A job taken up more often than this, each attempt dying with its worker, "
        "ends error with code poison.")
    # A worker retries a failed store or Redis call this long (backoff) before it gives
    # the job back to its queue rather than acking a job it could not end (workers/retry.py).
    io_retry_s: float = Field(
        15.0, gt=0,
        description="A worker retries a failed store or Redis call this long (backoff), then "
        "gives the job back to its queue rather than acking a job it could not end.")
    # Fault injection (workers/fault_commands.py): the control commands that make a worker's
    # store fail, hold a job mid-stream or report a slow allocator. Off in production; the
    # tests and drills turn it on.
    fault_commands: bool = Field(
        False,
        description="Register the fault-injection control commands on workers (tidegate_fault, "
        "tidegate_store_fault, tidegate_hold): for tests and drills, never in production.")

    engine_slots: int = Field(
        64, gt=0,
        description="Sequences one engine runs at once, and the worker's Celery thread "
        "concurrency (plus the slots it may lend, for a lane with lend_to).")
    max_model_len: int = Field(
        2048, gt=0,
        description="The engine's context length in tokens (vLLM's max_model_len, TensorRT-LLM's "
        "max_seq_len); the API refuses a job whose prompt plus max_tokens exceeds it (400 naming "
        "messages or prompt).")
    kv_cache_gib: int = Field(
        1, gt=0,
        description="CPU engines: KV cache space per worker, in GiB.")
    vllm_cpu_executor: Literal["mp", "uni"] = Field(
        "mp",
        description="vLLM on a CPU: mp (vLLM's CPU default) runs the model in a process of its "
        "own under the engine core; uni runs it in the engine core process, as vLLM does for "
        "one GPU: a worker starts 6-16 s sooner (one process fewer to start and import vLLM "
        "in), the tests' choice, but under bench/chaos.py's load on two pinned cores it fell "
        "behind (the engine's scheduler shares the model's core).")
    kv_cache_blocks: int = Field(
        0, ge=0,
        description="A fixed KV cache of this many blocks; 0: sized by memory, the engine's own "
        "way.")
    kv_block_size: int = Field(
        0, ge=0,
        description="Tokens per KV cache block; 0: the engine's default.")
    # KV cache eviction: "session" (session priority, workers/kvcache) or "lru" (vLLM's own).
    kv_policy: Literal["session", "lru"] = Field(
        "session",
        description="KV cache eviction: session (session priority, workers/kvcache) or lru "
        "(vLLM's own).")
    # The simulated engine's timing profile (`tidegate worker --engine sim`): a table of
    # workers/sim_profiles.toml; an unknown name stops the worker naming the known ones.
    sim_profile: str = Field(
        "llama-3.1-8b-fp8-h100",
        description="The simulated engine's timing profile (tidegate worker --engine sim): a "
        "table of workers/sim_profiles.toml; an unknown name stops the worker naming the known "
        "ones.")

    # LoRA adapters a worker serves: "name=path,name2=path2" (a worker-side setting).
    lora_adapters: str = Field(
        "",
        description="LoRA adapters a worker serves, name=path,name2=path2 (a worker setting); the "
        "router sends a job naming an adapter to a worker that has it.")

    # Route a session's turns to the worker holding its prefix (off: any worker of the pool).
    session_affinity: bool = Field(
        True,
        description="Send a session's turns to the worker holding its prefix while it is healthy "
        "(false: any worker of the pool).")

    scheduler_tick_s: float = Field(
        10.0, gt=0,
        description="Period of the scheduler's tick: traffic sampling, planning, pre-warming, "
        "health.")
    # The reconciler (scheduler/reconcile.py) runs this often; a job it finds with no
    # message and no lease for this long is sent again or ended.
    reconcile_s: float = Field(
        2.0, gt=0,
        description="The reconciler's period (scheduler/reconcile.py): how often unfinished jobs "
        "are checked against Redis.")
    reconcile_grace_s: float = Field(
        5.0, gt=0,
        description="How long a job must look orphaned (no lease, no message, no live attempt) "
        "before the reconciler sends it again or ends it.")
    alloc_latency_threshold_ms: float = Field(
        200.0, gt=0,
        description="The health check: a worker's KV cache allocation latency per engine step "
        "over this, two checks in a row, gets its prefix cache reset, then a rolling restart.")
    # health: how long a rolling restart waits for the worker's new process to load its
    # engine and report standby (a GPU node's cold start is minutes: sim_profiles.toml)
    restart_timeout_s: float = Field(
        300.0, gt=0,
        description="How long a rolling restart waits for the worker's new process to load its "
        "engine and report standby (a large model's cold start needs more).")
    # Pre-warming (scheduler/autoscale.py): on, each lane is planned on the forecast
    # (history and declared peaks) one lead time ahead, and capacity for the next 30
    # minutes is asked for; off, reactive scaling only: planned on the mean arrivals of
    # the last 5 complete minutes, nothing ahead of the traffic.
    prewarm: bool = Field(
        True,
        description="Plan each lane on the forecast (history and declared peaks) one lead time "
        "ahead and ask for capacity for the next 30 minutes; false: reactive scaling only, on the "
        "mean arrivals of the last 5 complete minutes.")
    # A replay clock (tidegate/clock.py; bench/festival.py): the simulated moment the
    # replay begins (unset: the real clock), the real Unix time at which the simulated
    # clock reads it, and simulated seconds per real second. Read by the API's arrival
    # counts and the scheduler's planning, and by sim engines for their modelled load.
    replay_start: datetime | None = Field(
        None,
        description="A replay clock (tidegate/clock.py, bench/festival.py): the simulated moment "
        "a replay begins. Unset: the real clock. The API's arrival counts and the scheduler's "
        "planning run on it.")
    replay_wall_start: float = Field(
        0.0, ge=0,
        description="A replay clock: the real Unix time at which the clock reads "
        "TIDEGATE_REPLAY_START (needs it).")
    replay_speedup: float = Field(
        1.0, gt=0,
        description="A replay clock: simulated seconds per real second; sim workers play their "
        "profile's cold start and activation divided by it (needs TIDEGATE_REPLAY_START).")

    # Operations (docs/operations.md). Bind addresses: 127.0.0.1 keeps a process off the
    # network; a container or a cluster sets 0.0.0.0.
    # Each worker serves its own /metrics (tidegate's and its engine's) here, the scheduler
    # its own (queue depth, workers by state, recoveries); 0 turns one off. A worker's is
    # this port plus its --gpu index, or the next free one (workers/metrics.py `reserve`).
    metrics_host: str = Field(
        "127.0.0.1",
        description="Bind address of the workers' and the scheduler's /metrics; set 0.0.0.0 where "
        "Prometheus scrapes from another host or pod.")
    worker_metrics_port: int = Field(
        9400, ge=0, le=65535,
        description="A worker's first /metrics port: a worker takes this port plus its --gpu "
        "index, or the next free port above it when that one is taken, and announces it (its "
        "heartbeat, tidegate status); tidegate worker --metrics-port names one exactly; 0: off.")
    scheduler_metrics_port: int = Field(
        9399, ge=0, le=65535,
        description="The scheduler's /metrics port: fleet-wide gauges (queue depth, workers by "
        "state, recoveries); 0: off.")
    # Logs: "json" (one object a line), "text" (for a person), "auto" (text on a terminal,
    # JSON otherwise). Never prompt or output text, in either.
    log_format: Literal["auto", "json", "text"] = Field(
        "auto",
        description="Log lines: json (one object a line), text (for a person), auto (text on a "
        "terminal, JSON otherwise). Never prompt or output text in either.")
    log_level: str = Field(
        "INFO",
        description="Log level of every process, uvicorn's, Celery's and vLLM's loggers included.")
    # Traces: an OTLP/HTTP endpoint (http://collector:4318); empty turns tracing off.
    otlp_endpoint: str = Field(
        "",
        description="An OTLP/HTTP collector for traces (http://otel-collector:4318; spans go to "
        "its /v1/traces); empty: tracing off.")
    # The API's tokenizer files (tokenizer.json, tokenizer_config.json); empty: the
    # model's folder. An API pod needs these, not the weights.
    tokenizer: str = Field(
        "",
        description="Where the API reads its tokenizer: a folder with tokenizer.json and "
        "tokenizer_config.json (and chat_template.jinja, special_tokens_map.json where the "
        "checkpoint has them). Empty: the model's folder. An API pod needs these, not the "
        "weights.")

    flower_host: str = Field(
        "127.0.0.1",
        description="Bind address of tidegate flower (also --host).")
    flower_port: int = Field(
        5555, ge=1, le=65535,
        description="Flower's port (also --port).")
    flower_user: str = Field(
        "admin",
        description="Flower's basic-auth user.")
    # No default: `tidegate flower` refuses to start without one (tidegate_tools/cli.py).
    flower_password: str = Field(
        "",
        description="Flower's basic-auth password; no default: tidegate flower refuses to start "
        "without one, or with the old default tidegate.")

    @field_validator("replay_start")
    @classmethod
    def _replay_start_utc(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v

    @field_validator("replay_wall_start", "replay_speedup")
    @classmethod
    def _replay_needs_start(cls, v: float, info: ValidationInfo) -> float:
        default = 0.0 if info.field_name == "replay_wall_start" else 1.0
        if info.data.get("replay_start") is None and v != default:
            raise ValueError("needs TIDEGATE_REPLAY_START (a replay clock)")
        if info.field_name == "replay_wall_start" and info.data.get("replay_start") and v <= 0:
            raise ValueError("a replay clock needs the real Unix time it starts at (> 0)")
        return v

    @field_validator("lora_adapters")
    @classmethod
    def _lora_pairs(cls, v: str) -> str:
        for item in filter(None, (p.strip() for p in v.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"{item!r} is not name=path")
        return v

    @property
    def lora(self) -> tuple[tuple[str, str], ...]:
        pairs = (p.strip().partition("=") for p in self.lora_adapters.split(",") if p.strip())
        return tuple((name.strip(), path.strip()) for name, _, path in pairs)

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else self.data_dir / "models" / "tidegate-test"

    @property
    def tokenizer_path(self) -> Path:
        """Where the API reads its tokenizer: TIDEGATE_TOKENIZER, else the model's folder."""
        return Path(self.tokenizer) if self.tokenizer else self.model_path

    @functools.cached_property
    def clock(self) -> Clock:
        """Planning time: the real clock, or the replay clock the replay_* settings give."""
        if self.replay_start is None:
            return REAL
        return Clock(self.replay_start, self.replay_wall_start, self.replay_speedup)

    @functools.cached_property
    def lanes(self) -> dict[str, Lane]:
        return load_lanes(self.lanes_file)

    @functools.cached_property
    def service_tiers(self) -> dict[str, str]:
        """OpenAI's `service_tier` -> lane, from the lanes file's [service_tiers]."""
        return load_service_tiers(self.lanes_file, self.lanes)


class SettingsError(SystemExit):
    """Raised at start when a setting is invalid; exits with a message naming it."""


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    try:
        settings = Settings()
        settings.lanes  # noqa: B018 - validate the lanes file at start, not on first job
        settings.service_tiers  # noqa: B018
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "TIDEGATE_" + str(err["loc"][0]).upper()
        raise SettingsError(f"invalid setting {name}: {err['msg']}") from None
    except LanesConfigError as exc:
        raise SettingsError(f"invalid setting TIDEGATE_LANES_FILE: {exc}") from None
    return settings


