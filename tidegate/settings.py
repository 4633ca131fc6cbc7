"""The one settings object. Environment variables are read here and nowhere else.

Invalid settings stop the process at start with a message naming the setting.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tidegate import redisconn
from tidegate.clock import REAL, Clock
from tidegate.lanes import (
    DEFAULT_LANES_FILE,
    Lane,
    LanesConfigError,
    load_lanes,
    load_service_tiers,
)

DATA_DIR = Path("data")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIDEGATE_", extra="ignore")

    data_dir: Path = DATA_DIR  # models, SQLite file, logs of the demo
    # Broker, token streams, heartbeats: one server, or sentinel://... (tidegate/redisconn.py)
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = ""  # empty: a SQLite file in data_dir
    # Every call to Redis or PostgreSQL is bounded (the invariant): past a bound it fails,
    # and the API answers 503 with Retry-After, a worker retries. Redis (tidegate/
    # redisconn.py): connecting, and each reply. PostgreSQL (store/engine.py): connecting,
    # in whole seconds (libpq's least is 2), and each statement, which the server cancels
    # (0: no bound); the defaults are store/engine.py's.
    redis_connect_timeout_s: float = Field(redisconn.CONNECT_TIMEOUT_S, gt=0)
    redis_socket_timeout_s: float = Field(redisconn.SOCKET_TIMEOUT_S, gt=0)
    database_connect_timeout_s: int = Field(5, ge=2)
    database_statement_timeout_s: float = Field(30.0, ge=0)
    model: str = ""  # path of a HF checkpoint; empty: the local test checkpoint
    lanes_file: Path = DEFAULT_LANES_FILE
    # Pub/sub channels ignore the Redis DB number: every key and channel gets this prefix.
    namespace: str = "tidegate"

    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    max_body_bytes: int = Field(256 * 1024, gt=0)  # request bodies above this get 413
    # 401s one client address may get per window in one API process (api/auth.py
    # FailedAuth); past them its unknown keys get 429 without a store lookup.
    auth_failures: int = Field(100, gt=0)
    auth_failure_window_s: int = Field(60, gt=0)

    # Load bounds (api/limits.py): over one, a 429 or 503 with Retry-After, never a wait.
    # Non-terminal jobs (queued or running) one tenant may have; the store counts them.
    max_in_flight_per_tenant: int = Field(1000, gt=0)
    # Messages waiting in a lane's pool queues; a lane's `max_queue_depth` overrides it.
    # Jobs below the lane's default priority are refused at a lower depth (shed first).
    max_queue_depth: int = Field(10_000, gt=0)
    # Submits and stream openings waiting for an admission thread (api/admission.py).
    max_admission_waiting: int = Field(1000, gt=0)
    # SSE streams (api/app.py): open at once per API process, and per tenant in a process;
    # each holds a Redis connection, from a pool bounded by the first plus a few.
    sse_max_streams: int = Field(1000, gt=0)
    sse_max_streams_per_tenant: int = Field(100, gt=0)
    # A quiet stream sends a keep-alive, and checks the job's row, this often.
    sse_keepalive_s: float = Field(15.0, gt=0)
    # The store says the job ended: its end event gets this long to reach the stream
    # before the SSE ends with an `error` event (`stream_gone`).
    sse_end_grace_s: float = Field(10.0, gt=0)
    # A stream older than this ends with an `error` event (`reconnect`): the client
    # reconnects with Last-Event-ID (and may land on another API replica).
    sse_max_lifetime_s: float = Field(1800.0, gt=0)

    # The Batch API (api/batches.py): an input file's size and lines at most, the jobs one
    # batch keeps queued or running at once (its lines wait in the store, not in Redis),
    # and how often the batch driver (`tidegate batches`) advances the open batches.
    batch_max_file_bytes: int = Field(50 * 1024 * 1024, gt=0)
    batch_max_lines: int = Field(10_000, gt=0)
    batch_in_flight: int = Field(64, gt=0)
    batch_poll_s: float = Field(1.0, gt=0)
    # The driver's lock: a holder that dies is replaced this long after its last extend.
    batch_driver_lock_s: float = Field(30.0, gt=0)
    # A batch whose step raises this many times in a row ends `failed` (the others go on).
    batch_step_failures: int = Field(5, gt=0)
    # The input files the driver keeps read (by batch, least recently used goes first).
    batch_cache_files: int = Field(4, gt=0)
    # A batch input file's line at most (bytes); a longer one is refused at upload, naming
    # its line. 0: TIDEGATE_MAX_BODY_BYTES, the limit of the same request sent alone.
    batch_max_line_bytes: int = Field(0, ge=0)

    # Per-tenant quotas (api/files.py): files stored (uploads and batch outputs), their
    # bytes, and batches not ended. Over one: 429 `quota_exceeded`, naming it.
    tenant_max_files: int = Field(500, gt=0)
    tenant_max_file_bytes: int = Field(1024**3, gt=0)
    tenant_max_open_batches: int = Field(20, gt=0)
    # What one tenant may upload to /v1/files a minute, refused uploads' bytes included
    # (api/files.py): the API's time parsing uploads is shared by every tenant.
    tenant_upload_bytes_per_minute: int = Field(256 * 1024**2, gt=0)

    # Retention (scheduler/retention.py; README, "What is kept, and for how long"), in
    # days, purged by the scheduler every `retention_purge_s`: a job's output text (the row
    # and its usage stay), an uploaded file (kept while an open batch reads it), and a
    # batch's output and error files when the batch gave no `output_expires_after`.
    job_text_retention_days: float = Field(30.0, ge=0)
    file_retention_days: float = Field(30.0, ge=0)
    batch_output_retention_days: float = Field(30.0, ge=0)
    retention_purge_s: float = Field(3600.0, gt=0)

    # Webhooks (tasks/webhooks.py, `tidegate webhooks`): the URL policy, each attempt's
    # total deadline (DNS, connect, TLS, send and read together), the first retry's delay
    # (doubling, capped at an hour, with jitter), when a delivery gives up, the delivery
    # threads, the dispatcher's period, and how long a rotated signing secret keeps
    # signing beside the new one.
    webhook_allow_private: bool = False
    webhook_allow_hosts: str = ""  # comma-separated hosts allowed even on private addresses
    webhook_deny_hosts: str = ""  # comma-separated hosts never called
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_backoff_s: float = Field(5.0, gt=0)
    webhook_give_up_s: float = Field(86400.0, gt=0)
    webhook_concurrency: int = Field(16, gt=0)
    webhook_dispatch_s: float = Field(1.0, gt=0)
    webhook_secret_overlap_s: float = Field(86400.0, ge=0)
    # Webhooks, hardened (README, "Webhooks"): deliveries in flight at once per tenant and
    # per host across every webhook process (over a cap a delivery waits, it does not
    # fail); a proxy every delivery goes through (empty: none; the proxy then decides
    # where a delivery may go); the key(s) sealing signing secrets at rest (Fernet keys,
    # comma-separated, the first seals; empty: a development key file in data_dir,
    # tidegate/sealing.py); live signing secrets a tenant may hold (rotation ends the
    # oldest beyond it).
    webhook_tenant_concurrency: int = Field(8, gt=0)
    webhook_host_concurrency: int = Field(8, gt=0)
    webhook_proxy_url: str = ""
    webhook_secret_key: str = Field("", repr=False)
    webhook_max_secrets: int = Field(3, gt=0)

    stream_maxlen: int = Field(10_000, gt=0)  # events kept per job stream (approximate trim)
    stream_ttl_s: int = Field(3600, gt=0)  # job stream lifetime after its terminal event
    # A lane's hot prefix (tenants' system prompts, tidegate/hot.py) is forgotten this
    # long after its last use: a day keeps a daily peak's prompts for the next one.
    hot_prefix_ttl_s: int = Field(86400, gt=0)
    heartbeat_s: float = Field(2.0, gt=0)  # worker heartbeat period; TTL is 5 periods
    # A job taken up this many times, each attempt dying with its worker, ends `poison`.
    max_attempts: int = Field(3, ge=1)
    # A worker retries a failed store or Redis call this long (backoff) before it gives
    # the job back to its queue rather than acking a job it could not end (workers/retry.py).
    io_retry_s: float = Field(15.0, gt=0)

    engine_slots: int = Field(64, gt=0)  # sequences per engine = Celery thread concurrency
    max_model_len: int = Field(2048, gt=0)
    kv_cache_gib: int = Field(1, gt=0)  # CPU engines: KV cache space per worker (GiB)
    kv_cache_blocks: int = Field(0, ge=0)  # a fixed KV cache of this many blocks; 0: by memory
    kv_block_size: int = Field(0, ge=0)  # tokens per KV block; 0: the engine's default
    # KV cache eviction: "session" (session priority, workers/kvcache) or "lru" (vLLM's own).
    kv_policy: Literal["session", "lru"] = "session"
    # The simulated engine's timing profile (`tidegate worker --engine sim`): a table of
    # workers/sim_profiles.toml; an unknown name stops the worker naming the known ones.
    sim_profile: str = "llama-3.1-8b-fp8-h100"

    # LoRA adapters a worker serves: "name=path,name2=path2" (a worker-side setting).
    lora_adapters: str = ""

    # Route a session's turns to the worker holding its prefix (off: any worker of the pool).
    session_affinity: bool = True

    scheduler_tick_s: float = Field(10.0, gt=0)  # period of the scheduler's beat
    # The reconciler (scheduler/reconcile.py) runs this often; a job it finds with no
    # message and no lease for this long is sent again or ended.
    reconcile_s: float = Field(2.0, gt=0)
    reconcile_grace_s: float = Field(5.0, gt=0)
    alloc_latency_threshold_ms: float = Field(200.0, gt=0)  # health: KV allocation latency
    # health: how long a rolling restart waits for the worker's new process to load its
    # engine and report standby (a GPU node's cold start is minutes: sim_profiles.toml)
    restart_timeout_s: float = Field(300.0, gt=0)
    # Pre-warming (scheduler/autoscale.py): on, each lane is planned on the forecast
    # (history and declared peaks) one lead time ahead, and capacity for the next 30
    # minutes is asked for; off, reactive scaling only: planned on the mean arrivals of
    # the last 5 complete minutes, nothing ahead of the traffic.
    prewarm: bool = True
    # A replay clock (tidegate/clock.py; bench/festival.py): the simulated moment the
    # replay begins (unset: the real clock), the real Unix time at which the simulated
    # clock reads it, and simulated seconds per real second. Read by the API's arrival
    # counts and the scheduler's planning, and by sim engines for their modelled load.
    replay_start: datetime | None = None
    replay_wall_start: float = Field(0.0, ge=0)
    replay_speedup: float = Field(1.0, gt=0)

    # Operations (README, "Operations"). Bind addresses: 127.0.0.1 keeps a process off the
    # network; a container or a cluster sets 0.0.0.0.
    # Each worker serves its own /metrics (tidegate's and its engine's) here, the scheduler
    # its own (queue depth, workers by state, recoveries); 0 turns one off. Two workers on
    # one machine need two ports (`tidegate worker --metrics-port`).
    metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = Field(9400, ge=0, le=65535)
    scheduler_metrics_port: int = Field(9399, ge=0, le=65535)
    # Logs: "json" (one object a line), "text" (for a person), "auto" (text on a terminal,
    # JSON otherwise). Never prompt or output text, in either.
    log_format: Literal["auto", "json", "text"] = "auto"
    log_level: str = "INFO"
    # Traces: an OTLP/HTTP endpoint (http://collector:4318); empty turns tracing off.
    otlp_endpoint: str = ""
    # The API's tokenizer files (tokenizer.json, tokenizer_config.json); empty: the
    # model's folder. An API pod needs these, not the weights.
    tokenizer: str = ""

    flower_host: str = "127.0.0.1"
    flower_port: int = Field(5555, ge=1, le=65535)
    flower_user: str = "admin"
    # No default: `tidegate flower` refuses to start without one (tidegate_tools/cli.py).
    flower_password: str = ""

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return redisconn.validate(v)  # one server, or Sentinel (tidegate/redisconn.py)

    @field_validator("webhook_proxy_url")
    @classmethod
    def _proxy_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// proxy URL")
        return v

    @field_validator("webhook_secret_key")
    @classmethod
    def _fernet_keys(cls, v: str) -> str:
        from cryptography.fernet import Fernet

        for key in filter(None, (k.strip() for k in v.split(","))):
            try:
                Fernet(key)
            except ValueError:
                raise ValueError("each key must be a Fernet key (32 url-safe base64-encoded "
                                 "bytes: Fernet.generate_key())") from None
        return v

    @field_validator("database_url")
    @classmethod
    def _db_scheme(cls, v: str) -> str:
        if v and not v.startswith(("sqlite", "postgresql")):
            raise ValueError("must be a sqlite:// or postgresql:// URL")
        return v

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
    def redis_timeouts(self) -> dict[str, float]:
        """redis-py's timeout options: `redisconn.sync_client(url, **redis_timeouts)`."""
        return redisconn.timeouts(self.redis_connect_timeout_s, self.redis_socket_timeout_s)

    @property
    def store_timeouts(self) -> dict[str, Any]:
        """The Store's timeouts: `Store(settings.db_url, **settings.store_timeouts)`."""
        return {"connect_timeout_s": self.database_connect_timeout_s,
                "statement_timeout_s": self.database_statement_timeout_s}

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'tidegate.db').resolve()}"

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


