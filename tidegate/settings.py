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

    data_dir: Path = Field(
        DATA_DIR,
        description="Where tidegate keeps its local files: the test and fetched checkpoints "
        "(models/), the SQLite database when TIDEGATE_DATABASE_URL is empty, the development "
        "webhook key, the demo's logs.")
    # Broker, token streams, heartbeats: one server, or sentinel://... (tidegate/redisconn.py)
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis for the broker, heartbeats, and the token streams and leases unless "
        "TIDEGATE_STREAMS_URL puts them apart: "
        "redis://[:PASSWORD@]host:6379/0, or a master behind Redis Sentinel, "
        "sentinel://host:26379;host2:26379/0?master=NAME (docs/operations.md, Redis Sentinel).")
    # Token streams apart from the broker (tidegate/redisconn.py, "token streams").
    streams_url: str = Field(
        "",
        description="Redis for the jobs' token streams, leases and cancel keys, apart from the "
        "broker: redis://..., sentinel://..., or a Redis Cluster, "
        "redis+cluster://host:7000,host2:7000 (the shards share the token traffic). Empty: "
        "TIDEGATE_REDIS_URL. Every process of a deployment must name the same one.")
    database_url: str = Field(
        "",
        description="The store: sqlite:///PATH or postgresql://...; empty: the SQLite file "
        "tidegate.db in TIDEGATE_DATA_DIR.")
    # Every call to Redis or PostgreSQL is bounded (the invariant): past a bound it fails,
    # and the API answers 503 with Retry-After, a worker retries. Redis (tidegate/
    # redisconn.py): connecting, and each reply. PostgreSQL (store/engine.py): connecting,
    # in whole seconds (libpq's least is 2), and each statement, which the server cancels
    # (0: no bound); the defaults are store/engine.py's.
    redis_connect_timeout_s: float = Field(
        redisconn.CONNECT_TIMEOUT_S, gt=0,
        description="Every Redis client (API, workers, scheduler, the Celery broker, Sentinel's "
        "sentinels): a connection not made in this long fails (the API answers 503 with "
        "Retry-After, a worker retries).")
    redis_socket_timeout_s: float = Field(
        redisconn.SOCKET_TIMEOUT_S, gt=0,
        description="The same clients: a reply not read in this long fails. The API's SSE client "
        "waits TIDEGATE_SSE_KEEPALIVE_S + 10 s (its XREAD blocks 1 s); on a Sentinel URL a "
        "command is tried 16 times over about 12.5 s, each try so bounded.")
    database_connect_timeout_s: int = Field(
        5, ge=2,
        description="PostgreSQL: a connection not made in this long fails (whole seconds, at "
        "least 2, libpq's least); a peer that stops acknowledging is dropped after 10 s (TCP "
        "keepalives, tcp_user_timeout).")
    database_statement_timeout_s: float = Field(
        30.0, ge=0,
        description="PostgreSQL's statement_timeout on every connection: the server cancels a "
        "statement running longer (0: no bound). Migrations (tidegate db upgrade) are not "
        "bounded.")
    model: str = Field(
        "",
        description="A Hugging Face checkpoint folder the workers load; the API names the model "
        "by its last part (and reads only its tokenizer, or none when TIDEGATE_TOKENIZER is set). "
        "Empty: the toy test checkpoint, TIDEGATE_DATA_DIR/models/tidegate-test, for a worker; "
        "make demo and tidegate up serve SmolLM2-135M-Instruct (tidegate_tools/realmodel.py).")
    lanes_file: Path = Field(
        DEFAULT_LANES_FILE,
        description="The lanes file: each lane's queue, precision, engine pools, limits, workers "
        "and peaks, and the [service_tiers] table (the lane fields below).")
    # Pub/sub channels ignore the Redis DB number: tidegate's keys and channels get this prefix.
    namespace: str = Field(
        "tidegate",
        description="Prefix of tidegate's own Redis keys and channels and of each worker's direct "
        "queue. The lanes' queues are named by the lanes file and Celery's own keys have no "
        "prefix: two deployments on one Redis need a database number each (the /N of "
        "TIDEGATE_REDIS_URL) and a namespace each (pub/sub channels ignore the database "
        "number).")

    api_host: str = Field(
        "127.0.0.1",
        description="Bind address of tidegate api (also --host); a container or a cluster sets "
        "0.0.0.0.")
    api_port: int = Field(
        8000, ge=1, le=65535,
        description="The API's port (also --port); its /metrics is served here too.")
    max_body_bytes: int = Field(
        256 * 1024, gt=0,
        description="A request body's limit on the bytes read, chunked included: past it a 413 "
        "naming body, and nothing more is read.")
    # 401s one client address may get per window in one API process (api/auth.py
    # FailedAuth); past them its unknown keys get 429 without a store lookup.
    auth_failures: int = Field(
        100, gt=0,
        description="401s one client address may get per window in one API process; past them it "
        "gets 429 auth_failures, without a key lookup, until the window ends (a key that was "
        "valid before is not held back).")
    auth_failure_window_s: int = Field(
        60, gt=0,
        description="The window of TIDEGATE_AUTH_FAILURES, in seconds.")
    # A flood holds a connection's next request behind the answer to its last: holding the
    # 429 cuts what each of its connections sends from as fast as it is answered to one a
    # hold, at the cost of a sleeping coroutine (api/frontgate.py).
    auth_failure_hold_s: float = Field(
        2.0, ge=0,
        description="An address past its TIDEGATE_AUTH_FAILURES gets its 429 after this many "
        "seconds (at most its Retry-After; 0: at once), so each of its connections sends one "
        "request a hold instead of as many as the API answers.")
    auth_failure_holds: int = Field(
        4096, ge=0,
        description="429s held at once at most (TIDEGATE_AUTH_FAILURE_HOLD_S); past them a 429 "
        "is answered at once.")

    # Load bounds (api/limits.py): over one, a 429 or 503 with Retry-After, never a wait.
    # Non-terminal jobs (queued or running) one tenant may have; the store counts them.
    max_in_flight_per_tenant: int = Field(
        1000, gt=0,
        description="Jobs queued or running one tenant may have (the store counts them); past it "
        "a 429 too_many_in_flight.")
    # Weighted fair queuing of tenants in each queue and priority step (tidegate/fairq.py).
    fair_queuing: bool = Field(
        True,
        description="Order the waiting jobs of one priority step by weighted fair queuing "
        "between tenants (a tenant's weight: the admin API's fair_weight, default 1), so a "
        "tenant that floods a lane does not put other tenants behind its backlog; false: "
        "arrival order. Applies where the API writes the broker's lists itself (the broker "
        "is the API's Redis, the default).")
    fair_burst_jobs: int = Field(
        4, ge=0,
        description="Fair queuing: how many jobs of a tenant that has used less than its "
        "share may go ahead of other tenants' backlogs at once (each job's own cost before "
        "the lane's virtual time); 0: none, plain start-time fair queuing.")
    # Messages waiting in a lane's pool queues; a lane's `max_queue_depth` overrides it.
    # Jobs below the lane's default priority are refused at a lower depth (shed first).
    max_queue_depth: int = Field(
        10_000, gt=0,
        description="Messages waiting in a lane's pool queues; past it a 429 queue_full (jobs "
        "below the lane's default priority are refused from a lower depth, half the cap at "
        "priority 0). A lane's max_queue_depth overrides it.")
    # Submits and stream openings waiting for an admission thread (api/admission.py).
    max_admission_waiting: int = Field(
        1000, gt=0,
        description="Submits and stream openings waiting for an admission thread in one API "
        "process; past it a 503 overloaded with Retry-After.")
    # SSE streams (api/app.py): open at once per API process, and per tenant in a process;
    # each holds a Redis connection, from a pool bounded by the first plus a few.
    sse_max_streams: int = Field(
        1000, gt=0,
        description="SSE streams open at once in one API process (past it a 429 "
        "too_many_streams); the API's Redis pool holds this many plus 8 connections.")
    sse_max_streams_per_tenant: int = Field(
        100, gt=0,
        description="SSE streams one tenant may have open in one API process (past it a 429 "
        "too_many_streams).")
    # A quiet stream sends a keep-alive, and checks the job's row, this often.
    sse_keepalive_s: float = Field(
        15.0, gt=0,
        description="A quiet stream sends a keep-alive comment, and looks at the job's row, this "
        "often.")
    # The store says the job ended: its end event gets this long to reach the stream
    # before the SSE ends with an `error` event (`stream_gone`).
    sse_end_grace_s: float = Field(
        10.0, gt=0,
        description="When the store says a job ended, its end event gets this long to reach the "
        "stream before the stream ends with an error event (stream_gone).")
    # A stream older than this ends with an `error` event (`reconnect`): the client
    # reconnects with Last-Event-ID (and may land on another API replica).
    sse_max_lifetime_s: float = Field(
        1800.0, gt=0,
        description="A stream's longest life: it then ends with an error event (reconnect), and "
        "the client reconnects with Last-Event-ID (maybe to another API replica).")

    # The Batch API (api/batches.py): an input file's size and lines at most, the jobs one
    # batch keeps queued or running at once (its lines wait in the store, not in Redis),
    # and how often the batch driver (`tidegate batches`) advances the open batches.
    batch_max_file_bytes: int = Field(
        50 * 1024 * 1024, gt=0,
        description="The Batch API: an input file's size at most (413 as soon as the bytes read "
        "pass it; nothing is spooled to disk).")
    batch_max_lines: int = Field(
        10_000, gt=0,
        description="The Batch API: request lines in one input file at most.")
    batch_in_flight: int = Field(
        64, gt=0,
        description="The Batch API: a batch's jobs queued or running at once; its other lines "
        "wait in the store, not in Redis.")
    batch_poll_s: float = Field(
        1.0, gt=0,
        description="How often the batch driver (tidegate batches) advances the open batches.")
    # What OpenAI's one completion window, "24h", lasts here: a batch not ended by then
    # expires (its unfinished lines `batch_expired`). Shorter for demos and tests only.
    batch_completion_window_s: float = Field(
        86400.0, gt=0,
        description="The Batch API: how long the `24h` completion window lasts, in seconds; a "
        "batch not ended by then expires. Shorten it for demos and tests only.")
    # The driver's lock: a holder that dies is replaced this long after its last extend.
    batch_driver_lock_s: float = Field(
        30.0, gt=0,
        description="The batch driver's lock TTL: a driver that dies is replaced this long after "
        "its last extend.")
    # A batch whose step raises this many times in a row ends `failed` (the others go on).
    batch_step_failures: int = Field(
        5, gt=0,
        description="A batch whose step fails this many times in a row ends failed, alone; the "
        "other batches go on.")
    # The input files the driver keeps read (by batch, least recently used goes first).
    batch_cache_files: int = Field(
        4, gt=0,
        description="Input files the batch driver keeps read in memory (least recently used goes "
        "first).")
    # A batch input file's line at most (bytes); a longer one is refused at upload, naming
    # its line. 0: TIDEGATE_MAX_BODY_BYTES, the limit of the same request sent alone.
    batch_max_line_bytes: int = Field(
        0, ge=0,
        description="A batch input file's line at most, in bytes; a longer line is a 400 at "
        "upload naming its line. 0: TIDEGATE_MAX_BODY_BYTES, the limit of the same request sent "
        "alone.")

    # Per-tenant quotas (api/files.py): files stored (uploads and batch outputs), their
    # bytes, and batches not ended. Over one: 429 `quota_exceeded`, naming it.
    tenant_max_files: int = Field(
        500, gt=0,
        description="Files one tenant may have stored (uploads and batch outputs); over it a 429 "
        "quota_exceeded naming it.")
    tenant_max_file_bytes: int = Field(
        1024**3, gt=0,
        description="Bytes of one tenant's stored files; over it a 429 quota_exceeded naming it.")
    tenant_max_open_batches: int = Field(
        20, gt=0,
        description="Batches not ended one tenant may have; over it a 429 quota_exceeded naming "
        "it.")
    # What one tenant may upload to /v1/files a minute, refused uploads' bytes included
    # (api/files.py): the API's time parsing uploads is shared by every tenant.
    tenant_upload_bytes_per_minute: int = Field(
        256 * 1024**2, gt=0,
        description="What one tenant may upload to /v1/files a minute, the bytes read of refused "
        "uploads included; spent: 429 rate_limited with Retry-After before the next upload is "
        "read.")

    # Retention (scheduler/retention.py; docs/operations.md, "What is kept"), in
    # days, purged by the scheduler every `retention_purge_s`: a job's output text (the row
    # and its usage stay), an uploaded file (kept while an open batch reads it), and a
    # batch's output and error files when the batch gave no `output_expires_after`.
    job_text_retention_days: float = Field(
        30.0, ge=0,
        description="Days a job's output text is kept after its end (the row, its usage and "
        "timings stay); longer while an open batch or an undelivered webhook needs it.")
    file_retention_days: float = Field(
        30.0, ge=0,
        description="Days an uploaded file is kept (or its expires_after, if sooner); kept while "
        "a batch not ended reads it.")
    batch_output_retention_days: float = Field(
        30.0, ge=0,
        description="Days a batch's output and error files are kept: the default, and the most a "
        "batch's output_expires_after may ask.")
    retention_purge_s: float = Field(
        3600.0, gt=0,
        description="How often the scheduler purges what retention lets go (one scheduler at a "
        "time, 500 rows a transaction).")

    # Webhooks (tasks/webhooks.py, `tidegate webhooks`): the URL policy, each attempt's
    # total deadline (DNS, connect, TLS, send and read together), the first retry's delay
    # (doubling, capped at an hour, with jitter), when a delivery gives up, the delivery
    # threads, the dispatcher's period, and how long a rotated signing secret keeps
    # signing beside the new one.
    # The batch driver and the webhook sender are background work: what a hostile tenant's
    # bad batches or slow receivers cost them must come after the API's and the workers'
    # CPU on a node they share (tidegate/niceness.py).
    background_nice: int = Field(
        5, ge=0, le=19,
        description="OS niceness (0-19) of the batch driver (`tidegate batches`) and the "
        "webhook sender (`tidegate webhooks`): their CPU comes after the API's and the "
        "lanes' workers' at a lower cpu_nice on a shared node.")
    webhook_allow_private: bool = Field(
        False,
        description="Let callback URLs reach private, loopback, link-local and CGNAT addresses "
        "(the unspecified address, multicast and 240/4 never pass).")
    webhook_allow_hosts: str = Field(
        "",
        description="Comma-separated hosts allowed even on private addresses.")
    webhook_deny_hosts: str = Field(
        "",
        description="Comma-separated hosts never called.")
    webhook_timeout_s: float = Field(
        10.0, gt=0,
        description="Each webhook attempt's total deadline: DNS, connect, TLS, send and read "
        "together.")
    webhook_backoff_s: float = Field(
        5.0, gt=0,
        description="The first webhook retry's delay, doubling after each failure, capped at an "
        "hour, with jitter.")
    webhook_give_up_s: float = Field(
        86400.0, gt=0,
        description="A webhook delivery gives up (failed, gave_up) this long after its job's end.")
    webhook_concurrency: int = Field(
        16, gt=0,
        description="Delivery threads per tidegate webhooks process.")
    webhook_dispatch_s: float = Field(
        1.0, gt=0,
        description="The webhook dispatcher's period: how often due deliveries are claimed.")
    webhook_secret_overlap_s: float = Field(
        86400.0, ge=0,
        description="How long a rotated signing secret keeps signing beside the new one.")
    # Webhooks, hardened (docs/api.md, "Webhooks"): deliveries in flight at once per tenant and
    # per host across every webhook process (over a cap a delivery waits, it does not
    # fail); a proxy every delivery goes through (empty: none; the proxy then decides
    # where a delivery may go); the key(s) sealing signing secrets at rest (Fernet keys,
    # comma-separated, the first seals; empty: a development key file in data_dir,
    # tidegate/sealing.py); live signing secrets a tenant may hold (rotation ends the
    # oldest beyond it).
    webhook_tenant_concurrency: int = Field(
        8, gt=0,
        description="Webhook deliveries in flight at once per tenant, across every webhook "
        "process; over the cap a delivery waits (deferred, not failed).")
    webhook_host_concurrency: int = Field(
        8, gt=0,
        description="Webhook deliveries in flight at once per receiving host, across every "
        "webhook process; over the cap a delivery waits (deferred, not failed).")
    webhook_proxy_url: str = Field(
        "",
        description="An http:// or https:// proxy every webhook delivery goes through; the proxy "
        "then resolves names and must enforce egress itself. Empty: none.")
    webhook_secret_key: str = Field(
        "", repr=False,
        description="The Fernet key(s) sealing webhook signing secrets at rest, comma-separated; "
        "the first seals, every one opens. Required on containers and across machines; empty: a "
        "development key file in TIDEGATE_DATA_DIR.")
    webhook_max_secrets: int = Field(
        3, gt=0,
        description="Live signing secrets per tenant; a rotation ends the oldest beyond it.")

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

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return redisconn.validate(v)  # one server, or Sentinel (tidegate/redisconn.py)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        # A job's keys carry a hash tag in braces (tidegate/keys.py): a brace before it
        # would make Redis Cluster hash the wrong part.
        if not v or "{" in v or "}" in v or any(c.isspace() for c in v):
            raise ValueError("must be a non-empty name without braces or spaces")
        return v

    @field_validator("streams_url")
    @classmethod
    def _streams_url(cls, v: str) -> str:
        return redisconn.validate_streams(v)

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
    def streams_redis_url(self) -> str:
        """Where the token streams live: TIDEGATE_STREAMS_URL, else TIDEGATE_REDIS_URL."""
        return self.streams_url or self.redis_url

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


