"""How a job's attempt ends it: the terminal row (written only under the job's lease), the
terminal event, the tenant's token refund and the worker's metrics."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from store import FirstToken, JobRecord
from tasks.payloads import GeneratePayload
from tidegate import ratelimit
from tidegate.records import AttemptOutcome, JobStatus
from workers.context import WorkerContext
from workers.job_stream import emit
from workers.lease import LeaseLost
from workers.progress import Progress

log = logging.getLogger("tidegate.worker")


def end_early(ctx: WorkerContext, payload: GeneratePayload, progress: Progress,
               remaining: int) -> AttemptOutcome:
    if remaining <= 0:  # an earlier attempt generated everything but died before `done`
        return end_done(ctx, payload, progress, "length")
    return end_expired(ctx, payload, progress)


def end_done(ctx: WorkerContext, payload: GeneratePayload, progress: Progress,
              finish_reason: str) -> AttemptOutcome:
    ended, job = _finish(ctx, payload.job_id, progress, JobStatus.DONE,
                         finish_reason=finish_reason)
    if not ended:
        # A DELETE landed between the last cancel check and here: the API answered
        # "cancelled", and the store, where the row is already cancelled, is the truth.
        return end_cancelled(ctx, payload, progress)
    emit(ctx, payload.job_id, progress, "done",
          data=done_data(payload, job, finish_reason, progress))
    _count_end(ctx, JobStatus.DONE, job, progress)
    return AttemptOutcome.DONE


def done_data(payload: GeneratePayload, job: JobRecord | None, finish_reason: str,
               progress: Progress) -> dict[str, object]:
    return {
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": payload.prompt_tokens,
                  "completion_tokens": progress.completion_tokens,
                  "cached_tokens": job.cached_tokens if job else None},
        "queue_wait_ms": job.queue_wait_ms if job else None,
        "ttft_ms": job.ttft_ms if job else None,
        "tpot_ms": job.tpot_ms if job else None,
    }


def end_cancelled(ctx: WorkerContext, payload: GeneratePayload,
                  progress: Progress) -> AttemptOutcome:
    _, job = _finish(ctx, payload.job_id, progress, JobStatus.CANCELLED,
                     finish_reason="cancelled")
    emit(ctx, payload.job_id, progress, "done", data={
        "finish_reason": "cancelled",
        "usage": {"prompt_tokens": payload.prompt_tokens,
                  "completion_tokens": progress.completion_tokens}})
    _count_end(ctx, JobStatus.CANCELLED, job, progress)
    return AttemptOutcome.CANCELLED


def end_expired(ctx: WorkerContext, payload: GeneratePayload,
                progress: Progress) -> AttemptOutcome:
    _, job = _finish(ctx, payload.job_id, progress, JobStatus.EXPIRED, finish_reason="deadline",
                     error="the job's deadline passed")
    emit(ctx, payload.job_id, progress, "error",
          data={"code": "deadline_exceeded", "message": "the job's deadline passed"})
    _count_end(ctx, JobStatus.EXPIRED, job, progress)
    return AttemptOutcome.EXPIRED


def fail(ctx: WorkerContext, job_id: str, code: str, message: str,
          progress: Progress) -> None:
    _, job = _finish(ctx, job_id, progress, JobStatus.ERROR, error=message)
    emit(ctx, job_id, progress, "error", data={"code": code, "message": message})
    _count_end(ctx, JobStatus.ERROR, job, progress)


def _finish(ctx: WorkerContext, job_id: str, progress: Progress, status: JobStatus,
            **values: str) -> tuple[bool, JobRecord | None]:
    """The job's terminal row, written only while this attempt holds the lease: an attempt
    that was replaced must not end a job that another attempt runs. (False, row) when the
    row was already cancelled or expired (it keeps that status and gets the usage)."""
    if not _renewed_lately(progress) and not ctx.retry(progress.lease.renew):
        raise LeaseLost(job_id)
    first = None
    if progress.first_token_at is None and progress.first_token_out is not None:
        first = FirstToken(progress.first_token_out, progress.started_at, progress.cached_tokens)
    ended = ctx.retry(ctx.store.runs.end_job, job_id, status, output_text=progress.text,
                      completion_tokens=progress.completion_tokens,
                      finished_at=datetime.now(UTC), first_token_at=progress.first_token_at,
                      first_token=first, **values)
    _refund(ctx, ended[1])
    return ended


def _refund(ctx: WorkerContext, job: JobRecord | None) -> None:
    """The tenant's token window gets back the max_tokens the job did not generate (the
    API charged prompt plus max_tokens; tidegate/ratelimit.py says why this is safe). Here,
    once per job: this attempt holds its lease and just wrote its end. A refund lost to a
    Redis error is a charge that ages out in two minutes: never a reason to fail the job."""
    if job is None:
        return
    unused = ratelimit.unused_tokens(job.sampling.get("max_tokens"), job.completion_tokens)
    try:
        ratelimit.refund(ctx.redis, ctx.namespace, job.tenant_id, unused,
                         job.enqueued_at.timestamp())
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("rate limit refund of job %s failed: %s", job.id, type(exc).__name__,
                    extra={"job_id": job.id})


RENEWED_LATELY_S = 1.0  # a lease renewed this recently needs no renew before the end


def _renewed_lately(progress: Progress) -> bool:
    """The streamer renewed the lease with the job's last batch of tokens, a moment ago
    (workers/streamer.py): it is this attempt's for a lease's life from then, since another
    attempt takes a job only once its lease expired, so the fence is as exact as a renew
    here, and the job's end saves a round trip."""
    at = progress.renewed_at
    return at is not None and time.monotonic() - at < RENEWED_LATELY_S


def _count_end(ctx: WorkerContext, status: JobStatus, job: JobRecord | None,
               progress: Progress) -> None:
    """The attempt's end in this worker's metrics, its terminal event out: the job's
    status and timings (from its row), and the tokens this attempt generated."""
    if ctx.metrics is None or job is None:
        return
    ctx.metrics.generated(job.lane, progress.emitted_here)
    ctx.metrics.ended(job.lane, status.value, job)
