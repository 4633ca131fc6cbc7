"""The body of the generate task: one job from claim to terminal event.

Idempotent on the job id. An attempt first takes the job's lease (workers/lease.py); a
second delivery while another attempt lives waits for it to end, then finds the job
finished and does nothing; a delivery of a job whose worker died resumes after the tokens
already published, so a consumer never sees a token twice or misses one. A job that was
taken up more than `max_attempts` times ends `error` with code `poison`: it is taken to
be what kills its workers.

Nothing on the way loses the job. A store or Redis call that fails for a moment is
retried with backoff (workers/retry.py); one that stays down past the retry budget ends
the attempt `requeued`: its lease released, the task rejected back to its queue, never
acked (workers/task.py), so a later attempt ends the job, and completes its
stream if only the terminal event was missing. An engine that died under the job ends the
attempt `engine-dead`: the job is not ended either; the worker leaves its message unacked
and leaseless for the recovery sweep, which hands it to another worker (workers/worker.py).

The attempt's run is here; its tokens' way to the stream is workers/job_stream.py, its end
(row, terminal event, refund) workers/endings.py, and what its thread shares with the
others workers/context.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tasks.payloads import GeneratePayload
from tidegate import keys, logs, tracing
from tidegate.events import Event
from tidegate.records import AttemptOutcome, JobStatus
from workers.context import WorkerContext
from workers.endings import done_data, end_cancelled, end_done, end_early, end_expired, fail
from workers.engine import BORROWED, OWN, EngineDead, EngineError
from workers.host import Cancelled, DeadlineExceeded
from workers.job_stream import emit, engine_request, stream_batched, stream_each
from workers.lease import Lease, LeaseLost
from workers.progress import Progress
from workers.publisher import StreamState
from workers.retry import TRANSIENT

log = logging.getLogger("tidegate.worker")


def run_job(ctx: WorkerContext, payload: GeneratePayload) -> AttemptOutcome:
    """Run one job; returns the outcome (for logs and tests). Never raises."""
    lease = Lease(ctx.streams, keys.job_lease(ctx.namespace, payload.job_id), ctx.name,
                  ctx.lease_ttl_s, stream=keys.job_events(ctx.namespace, payload.job_id))
    try:
        taken, opening = _take(ctx, payload, lease)
        if not taken:
            return AttemptOutcome.SKIPPED_TERMINAL
    except TRANSIENT as exc:
        return _requeue(payload.job_id, exc)
    ctx._hold(lease, True)
    try:
        return _run_leased(ctx, payload, lease, opening)
    except LeaseLost:
        log.warning("job %s: this attempt lost its lease to another", payload.job_id)
        ctx.host.abandon(payload.job_id)
        return AttemptOutcome.LEASE_LOST
    except EngineDead:
        log.warning("job %s: the engine died under it; left for another worker",
                    payload.job_id)
        return AttemptOutcome.ENGINE_DEAD
    except TRANSIENT as exc:
        ctx.host.abandon(payload.job_id)  # a later attempt generates the rest
        return _requeue(payload.job_id, exc)
    except Exception:  # a bug must not crash the worker; the job still ends
        log.exception("job %s failed inside the worker", payload.job_id)
        return _fail_unexpected(ctx, payload.job_id, lease)
    finally:
        ctx._hold(lease, False)
        _release(ctx, lease)


@dataclass(frozen=True)
class _Opening:
    """What a job's usual start reads with its lease, in the same round trip."""

    state: StreamState  # the job's stream so far
    cancelled: bool  # its cancel key is set


def _take(ctx: WorkerContext, payload: GeneratePayload,
          lease: Lease) -> tuple[bool, _Opening | None]:
    """(taken, what was read with it): the lease at once, else once the attempt holding
    it ends (then nothing was read)."""
    opening = ctx.retry(_take_reading, ctx, payload.job_id, lease)
    if opening is not None:
        return True, opening
    log.info("job %s: another attempt holds it; waiting for it to end", payload.job_id)
    return ctx.retry(lease.take_when_free, lambda: _ended(ctx, payload)), None


def _take_reading(ctx: WorkerContext, job_id: str, lease: Lease) -> _Opening | None:
    """The lease taken and, in the same round trip, the job's stream and cancel key read
    (two round trips fewer a job); None when another attempt holds the lease."""
    pipe = ctx.streams.pipeline(transaction=False)
    lease.take_in(pipe)
    pipe.xrange(keys.job_events(ctx.namespace, job_id))
    pipe.exists(keys.job_cancel(ctx.namespace, job_id))
    taken, entries, cancelled = pipe.execute()
    if not taken:
        return None
    return _Opening(ctx.publisher.state_of(entries), bool(cancelled))


def _requeue(job_id: str, exc: BaseException) -> AttemptOutcome:
    log.warning("job %s: the store or Redis is still failing (%s) after the retries; the "
                "job goes back to its queue", job_id, type(exc).__name__)
    return AttemptOutcome.REQUEUED


def _release(ctx: WorkerContext, lease: Lease) -> None:
    if lease.released:  # with the attempt's last event (EventPublisher.publish_last)
        return
    try:
        ctx.retry(lease.release)
    except TRANSIENT:  # Redis is down: the lease expires on its own within its TTL
        log.warning("could not release lease %s; it expires by itself", lease.key)


def _ended(ctx: WorkerContext, payload: GeneratePayload) -> bool:
    """The wait for another attempt is over: the job ended. (Not its deadline: a live
    attempt ends a late job itself, and a dead one's lease expires, so the wait is bounded
    either way, and after a death this attempt must end the job.)"""
    job = ctx.store.jobs.get_job(payload.job_id)
    return job is None or job.terminal


def _fail_unexpected(ctx: WorkerContext, job_id: str, lease: Lease) -> AttemptOutcome:
    try:
        state = ctx.retry(ctx.publisher.state, job_id)
        if not state.terminal:
            progress = Progress.of(lease, state)
            fail(ctx, job_id, "internal", "the worker failed while running this job",
                  progress)
    except LeaseLost:
        pass  # another attempt runs the job now, and ends it
    except TRANSIENT as exc:
        return _requeue(job_id, exc)
    return AttemptOutcome.ERROR


def _run_leased(ctx: WorkerContext, payload: GeneratePayload, lease: Lease,
                opening: _Opening | None) -> AttemptOutcome:
    job = ctx.retry(ctx.store.runs.claim_job, payload.job_id, ctx.name, ctx.host.engine.kind)
    if job is None:
        log.info("job %s is already finished or unknown; skipping", payload.job_id)
        _complete_stream(ctx, payload, lease)
        return AttemptOutcome.SKIPPED_TERMINAL
    logs.bind(attempt=job.attempts)  # the rest of this task's lines carry it
    state = opening.state if opening else ctx.retry(ctx.publisher.state, payload.job_id)
    if state.terminal:
        return AttemptOutcome.SKIPPED_TERMINAL
    progress = Progress.of(lease, state)
    progress.started_at = job.started_at
    tracing.annotate(attempt=job.attempts)
    if ctx.metrics is not None:
        ctx.metrics.taken(payload.lane, job.attempts)
    if job.attempts > ctx.max_attempts:
        fail(ctx, payload.job_id, "poison", f"the job was taken up {job.attempts} times; "
              "each attempt died with its worker", progress)
        if ctx.metrics is not None:  # decided here, in the worker that took it last
            ctx.metrics.poisoned(payload.lane)
        return AttemptOutcome.POISON
    if payload.session_id:  # this worker's KV cache now holds the session's prefix
        ctx.retry(ctx.store.sessions.set_session_worker, payload.session_id, job.tenant_id,
                  ctx.name)
    if progress.seq == 0:
        started = {"worker": ctx.name, "engine": ctx.host.engine.kind, "attempt": job.attempts}
        if _batched(ctx):  # out with the streamer's next batch, with other jobs' events
            progress.head = Event(job_id=payload.job_id, seq=0, kind="started", data=started)
        else:
            emit(ctx, payload.job_id, progress, "started", data=started)
    if (opening.cancelled if opening else
            ctx.retry(ctx.streams.exists, keys.job_cancel(ctx.namespace, payload.job_id))):
        return end_cancelled(ctx, payload, progress)
    return _generate(ctx, payload, progress, state)


def _complete_stream(ctx: WorkerContext, payload: GeneratePayload, lease: Lease) -> None:
    """A job whose row was ended by an attempt that then could not write the terminal
    event (Redis stayed down past the retries) gets that event now, from the row, so its
    consumers hear the end. Jobs no attempt ever ran (cancelled while queued) are the
    API's to end."""
    job = ctx.retry(ctx.store.jobs.get_job, payload.job_id)
    if job is None or not job.terminal or job.worker is None:
        return
    state = ctx.retry(ctx.publisher.state, payload.job_id)
    if state.terminal:
        return
    progress = Progress.of(lease, state)
    if job.status == JobStatus.DONE:
        emit(ctx, payload.job_id, progress, "done",
              data=done_data(payload, job, job.finish_reason or "length", progress))
    elif job.status == JobStatus.CANCELLED:
        emit(ctx, payload.job_id, progress, "done", data={"finish_reason": "cancelled"})
    else:
        code = "deadline_exceeded" if job.status == JobStatus.EXPIRED else "internal"
        emit(ctx, payload.job_id, progress, "error",
              data={"code": code, "message": job.error or "the job failed"})


def _generate(ctx: WorkerContext, payload: GeneratePayload, progress: Progress,
              state: StreamState) -> AttemptOutcome:
    remaining = payload.sampling.max_tokens - len(state.token_ids)
    timeout_s = payload.deadline_at - time.time() if payload.deadline_at else None
    if remaining <= 0 or (timeout_s is not None and timeout_s <= 0):
        return end_early(ctx, payload, progress, remaining)
    if payload.sampling.n > 1 and any(e.kind == "token" for e in state.events):
        # The choices after the first were streamed but are not resumable (a resume
        # continues one sequence): ended, not regenerated into text the client has.
        fail(ctx, payload.job_id, "not_resumable", "the worker running this job (n > 1) "
              "died after its first tokens; a job with several choices cannot resume",
              progress)
        return AttemptOutcome.ERROR
    borrowed = payload.lane not in ctx.lanes  # on a slot another lane lent (tidegate/router.py)
    request = engine_request(payload, remaining, state, BORROWED if borrowed else OWN)
    if ctx.metrics is not None:
        ctx.metrics.prefilled(payload.lane, payload.prompt_tokens)
    started = time.monotonic()
    try:
        with tracing.span("engine.generate", {"engine": ctx.host.engine.kind,
                                              "resumed_tokens": len(state.token_ids)}) as span, \
                ctx.borrowing(borrowed):
            if _batched(ctx):
                finish_reason = stream_batched(ctx, payload.job_id, progress, request,
                                                timeout_s)
            else:  # a hold armed (workers/faults.py) counts each token on this thread
                finish_reason = stream_each(ctx, payload.job_id, progress, request,
                                             timeout_s)
            span.set_attribute("tidegate.completion_tokens", progress.emitted_here)
    except Cancelled:
        return end_cancelled(ctx, payload, progress)
    except DeadlineExceeded:
        return end_expired(ctx, payload, progress)
    except EngineError as exc:
        fail(ctx, payload.job_id, "engine_rejected", str(exc), progress)
        return AttemptOutcome.ERROR
    if not borrowed:  # the router's estimate of this worker's own lanes' service time
        ctx.record_job_ms((time.monotonic() - started) * 1000)
    return end_done(ctx, payload, progress, finish_reason)


def _batched(ctx: WorkerContext) -> bool:
    """The job's events go out through the worker's streamer (a hold armed,
    workers/faults.py, counts each token on the task thread)."""
    return ctx.streamer is not None and not (ctx.hold is not None and ctx.hold.armed)
