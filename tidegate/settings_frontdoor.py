"""Settings of the API process: its address, the bounds every request meets (auth
failures, tenants' jobs in flight, fair queuing, queue depth, admission, SSE streams), the
Batch API and files, each tenant's quotas, and retention. One group of
`tidegate.settings.Settings`' fields.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class FrontDoorSettings(BaseModel):
    """The API and admission, the Batch API and files, quotas and retention."""

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
