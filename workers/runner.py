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
acked (workers/celery_hooks.py), so a later attempt ends the job, and completes its
stream if only the terminal event was missing. An engine that died under the job ends the
attempt `engine-dead`: the job is not ended either; the worker leaves its message unacked
and leaseless for the recovery sweep, which hands it to another worker (workers/worker.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis

from store import FirstToken, Store
from tasks.payloads import GeneratePayload
from tidegate import keys, logs, ratelimit, tracing
from tidegate.events import Event
from tidegate.records import JobStatus
from workers import streamer
from workers.engine import BORROWED, OWN, Delta, EngineDead, EngineError, EngineRequest
from workers.faults import TokenHold
from workers.host import Cancelled, DeadlineExceeded, EngineHost
from workers.lease import Lease, LeaseLost
from workers.metrics import JobMetrics
from workers.progress import Progress
from workers.publisher import EventPublisher, StreamState
from workers.retry import TRANSIENT, Retrier
from workers.streamer import Feed, Streamer

log = logging.getLogger("tidegate.worker")


@dataclass
class WorkerContext:
    """Everything a task thread needs; built once by the engine bootstep."""

    name: str
    namespace: str
    store: Store
    redis: redis.Redis  # the main Redis: rate limits
    # The token streams' Redis (TIDEGATE_STREAMS_URL; maybe a cluster, maybe `redis`): a
    # job's lease, stream and cancel key.
    streams: Any
    publisher: EventPublisher
    host: EngineHost
    lease_ttl_s: int  # keys.lease_ttl_s of the worker's heartbeat period
    max_attempts: int  # takes of one job before it is ended as poison
    retry: Retrier  # every store and Redis call of a job goes through it
    lanes: list[str] = field(default_factory=list)
    hold: TokenHold | None = None  # fault injection (workers/faults.py): unarmed in production
    metrics: JobMetrics | None = None  # Prometheus (workers/metrics.py); None: not counted
    # Publishes every job's token events in one round trip per engine step; None: each
    # task thread publishes its own job's (workers/streamer.py).
    streamer: Streamer | None = None
    mean_job_ms: float | None = None  # moving average of a job's run time, for the router
    leases: set[Lease] = field(default_factory=set)  # held now; the heartbeat renews them
    borrowed: int = 0  # other lanes' jobs running on slots this worker lent
    _leases_lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def borrowing(self, borrowed: bool) -> Iterator[None]:
        """Counts the borrowed jobs running here, for the heartbeat (the router's cap)."""
        if not borrowed:
            yield
            return
        with self._leases_lock:
            self.borrowed += 1
        try:
            yield
        finally:
            with self._leases_lock:
                self.borrowed -= 1

    def record_job_ms(self, ms: float) -> None:
        old = self.mean_job_ms
        self.mean_job_ms = ms if old is None else 0.8 * old + 0.2 * ms

    def held_leases(self) -> list[Lease]:
        with self._leases_lock:
            return list(self.leases)

    def _hold(self, lease: Lease, held: bool) -> None:
        with self._leases_lock:
            (self.leases.add if held else self.leases.discard)(lease)


LEASE_LOST = "lease-lost"  # outcome: another attempt took the job over; not acked
REQUEUED = "requeued"  # outcome: the store or Redis stayed down; the task goes back, unacked
ENGINE_DEAD = "engine-dead"  # outcome: the engine died under the job; left to another worker


def run_job(ctx: WorkerContext, body: dict[str, Any]) -> str:
    """Run one job; returns the outcome (for logs and tests). Never raises."""
    payload = GeneratePayload.from_dict(body)
    lease = Lease(ctx.streams, keys.job_lease(ctx.namespace, payload.job_id), ctx.name,
                  ctx.lease_ttl_s, stream=keys.job_events(ctx.namespace, payload.job_id))
    try:
        taken, opening = _take(ctx, payload, lease)
        if not taken:
            return "skipped-terminal"
    except TRANSIENT as exc:
        return _requeue(payload.job_id, exc)
    ctx._hold(lease, True)
    try:
        return _run_leased(ctx, payload, lease, opening)
    except LeaseLost:
        log.warning("job %s: this attempt lost its lease to another", payload.job_id)
        ctx.host.abandon(payload.job_id)
        return LEASE_LOST
    except EngineDead:
        log.warning("job %s: the engine died under it; left for another worker",
                    payload.job_id)
        return ENGINE_DEAD
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


def _requeue(job_id: str, exc: BaseException) -> str:
    log.warning("job %s: the store or Redis is still failing (%s) after the retries; the "
                "job goes back to its queue", job_id, type(exc).__name__)
    return REQUEUED


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


def _fail_unexpected(ctx: WorkerContext, job_id: str, lease: Lease) -> str:
    try:
        state = ctx.retry(ctx.publisher.state, job_id)
        if not state.terminal:
            progress = Progress.of(lease, state)
            _fail(ctx, job_id, "internal", "the worker failed while running this job",
                  progress)
    except LeaseLost:
        pass  # another attempt runs the job now, and ends it
    except TRANSIENT as exc:
        return _requeue(job_id, exc)
    return "error"


def _run_leased(ctx: WorkerContext, payload: GeneratePayload, lease: Lease,
                opening: _Opening | None) -> str:
    job = ctx.retry(ctx.store.runs.claim_job, payload.job_id, ctx.name, ctx.host.engine.kind)
    if job is None:
        log.info("job %s is already finished or unknown; skipping", payload.job_id)
        _complete_stream(ctx, payload, lease)
        return "skipped-terminal"
    logs.bind(attempt=job.attempts)  # the rest of this task's lines carry it
    state = opening.state if opening else ctx.retry(ctx.publisher.state, payload.job_id)
    if state.terminal:
        return "skipped-terminal"
    progress = Progress.of(lease, state)
    progress.started_at = job.started_at
    tracing.annotate(attempt=job.attempts)
    if ctx.metrics is not None:
        ctx.metrics.taken(payload.lane, job.attempts)
    if job.attempts > ctx.max_attempts:
        _fail(ctx, payload.job_id, "poison", f"the job was taken up {job.attempts} times; "
              "each attempt died with its worker", progress)
        if ctx.metrics is not None:  # decided here, in the worker that took it last
            ctx.metrics.poisoned(payload.lane)
        return "poison"
    if payload.session_id:  # this worker's KV cache now holds the session's prefix
        ctx.retry(ctx.store.sessions.set_session_worker, payload.session_id, job.tenant_id,
                  ctx.name)
    if progress.seq == 0:
        started = {"worker": ctx.name, "engine": ctx.host.engine.kind, "attempt": job.attempts}
        if _batched(ctx):  # out with the streamer's next batch, with other jobs' events
            progress.head = Event(job_id=payload.job_id, seq=0, kind="started", data=started)
        else:
            _emit(ctx, payload.job_id, progress, "started", data=started)
    if (opening.cancelled if opening else
            ctx.retry(ctx.streams.exists, keys.job_cancel(ctx.namespace, payload.job_id))):
        return _end_cancelled(ctx, payload, progress)
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
        _emit(ctx, payload.job_id, progress, "done",
              data=_done_data(payload, job, job.finish_reason or "length", progress))
    elif job.status == JobStatus.CANCELLED:
        _emit(ctx, payload.job_id, progress, "done", data={"finish_reason": "cancelled"})
    else:
        code = "deadline_exceeded" if job.status == JobStatus.EXPIRED else "internal"
        _emit(ctx, payload.job_id, progress, "error",
              data={"code": code, "message": job.error or "the job failed"})


def _generate(ctx: WorkerContext, payload: GeneratePayload, progress: Progress,
              state: StreamState) -> str:
    remaining = payload.sampling.max_tokens - len(state.token_ids)
    timeout_s = payload.deadline_at - time.time() if payload.deadline_at else None
    if remaining <= 0 or (timeout_s is not None and timeout_s <= 0):
        return _end_early(ctx, payload, progress, remaining)
    if payload.sampling.n > 1 and any(e.kind == "token" for e in state.events):
        # The choices after the first were streamed but are not resumable (a resume
        # continues one sequence): ended, not regenerated into text the client has.
        _fail(ctx, payload.job_id, "not_resumable", "the worker running this job (n > 1) "
              "died after its first tokens; a job with several choices cannot resume",
              progress)
        return "error"
    borrowed = payload.lane not in ctx.lanes  # on a slot another lane lent (scheduler/router.py)
    request = _engine_request(payload, remaining, state, BORROWED if borrowed else OWN)
    if ctx.metrics is not None:
        ctx.metrics.prefilled(payload.lane, payload.prompt_tokens)
    started = time.monotonic()
    try:
        with tracing.span("engine.generate", {"engine": ctx.host.engine.kind,
                                              "resumed_tokens": len(state.token_ids)}) as span, \
                ctx.borrowing(borrowed):
            if _batched(ctx):
                finish_reason = _stream_batched(ctx, payload.job_id, progress, request,
                                                timeout_s)
            else:  # a hold armed (workers/faults.py) counts each token on this thread
                finish_reason = _stream_each(ctx, payload.job_id, progress, request,
                                             timeout_s)
            span.set_attribute("tidegate.completion_tokens", progress.emitted_here)
    except Cancelled:
        return _end_cancelled(ctx, payload, progress)
    except DeadlineExceeded:
        return _end_expired(ctx, payload, progress)
    except EngineError as exc:
        _fail(ctx, payload.job_id, "engine_rejected", str(exc), progress)
        return "error"
    if not borrowed:  # the router's estimate of this worker's own lanes' service time
        ctx.record_job_ms((time.monotonic() - started) * 1000)
    return _end_done(ctx, payload, progress, finish_reason)


def _batched(ctx: WorkerContext) -> bool:
    """The job's events go out through the worker's streamer (a hold armed,
    workers/faults.py, counts each token on the task thread)."""
    return ctx.streamer is not None and not (ctx.hold is not None and ctx.hold.armed)


def _stream_each(ctx: WorkerContext, job_id: str, progress: Progress,
                 request: EngineRequest, timeout_s: float | None) -> str:
    """The job's events published from this thread, one round trip each; its finish
    reason."""
    finish_reason = "length"
    watch = _CancelWatch(ctx, job_id)
    for delta in ctx.host.run(request, timeout_s=timeout_s):
        _on_delta(ctx, job_id, progress, delta)
        finish_reason = delta.finish_reason or finish_reason
        watch.check()
    return finish_reason


def _stream_batched(ctx: WorkerContext, job_id: str, progress: Progress,
                    request: EngineRequest, timeout_s: float | None) -> str:
    """The job's token events published by the worker's streamer (workers/streamer.py),
    with every other job's of the same engine step; this thread writes the first token
    to the store, and takes over what the streamer gives back. The finish reason."""
    assert ctx.streamer is not None
    feed = ctx.streamer.open(job_id, progress, keys.job_cancel(ctx.namespace, job_id))
    try:
        ctx.host.start_request(request, feed, timeout_s)
        return _follow(ctx, job_id, progress, feed)
    finally:
        ctx.streamer.detach(feed)


def _follow(ctx: WorkerContext, job_id: str, progress: Progress, feed: Feed) -> str:
    finish_reason = "length"
    watch: _CancelWatch | None = None  # once the streamer gave the job back
    while True:
        kind, value = feed.inbox.get()
        if kind == streamer.FIRST:
            if ctx.retry(ctx.store.runs.mark_first_token, job_id, value, progress.cached_tokens,
                         progress.started_at):
                progress.first_token_at = value
        elif kind == streamer.END:
            if value is not None:
                raise value
            return finish_reason if watch is not None else feed.finish_reason
        elif kind == streamer.CANCELLED:
            ctx.host.cancel(job_id)
            raise Cancelled(job_id)
        else:  # SLOW (the deltas the streamer did not publish), then each DELTA
            watch = watch or _CancelWatch(ctx, job_id)
            finish_reason = feed.finish_reason if kind == streamer.SLOW else finish_reason
            for delta in (value if kind == streamer.SLOW else [value]):
                _on_delta(ctx, job_id, progress, delta)
                finish_reason = delta.finish_reason or finish_reason
            watch.check()


class _CancelWatch:
    """Cancels arrive on a pub/sub channel, which is at most once; polling the job's
    cancel key a few times a second catches any broadcast this worker missed."""

    PERIOD_S = 0.25

    def __init__(self, ctx: WorkerContext, job_id: str) -> None:
        self.ctx, self.job_id = ctx, job_id
        self.next_check = time.monotonic() + self.PERIOD_S
        self.fired = False

    def check(self) -> None:
        now = time.monotonic()
        if self.fired or now < self.next_check:
            return
        self.next_check = now + self.PERIOD_S
        if self.ctx.retry(self.ctx.streams.exists, keys.job_cancel(self.ctx.namespace,
                                                                 self.job_id)):
            self.fired = True
            self.ctx.host.cancel(self.job_id)
            # Stop here even if the engine has already finished and its remaining deltas
            # wait in the queue: the API told the client "cancelled", so the stream must
            # not go on to end in `done`/`length`.
            raise Cancelled(self.job_id)


def _engine_request(payload: GeneratePayload, remaining: int, state: StreamState,
                    priority: int = OWN) -> EngineRequest:
    s = payload.sampling
    return EngineRequest(
        request_id=payload.job_id, prompt=payload.prompt, max_tokens=remaining,
        temperature=s.temperature, top_p=s.top_p, seed=s.seed, stop=s.stop,
        n=s.n, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, top_k=s.top_k, min_p=s.min_p,
        logit_bias=s.logit_bias, logprobs=s.logprobs,
        resume_token_ids=state.token_ids, session_id=payload.session_key, turn=payload.turn,
        lane=payload.lane, lora=payload.lora, shared_prefix_tokens=payload.shared_prefix_tokens,
        cache_salt=payload.cache_salt, guided=payload.guided, tool_parse=payload.tool_parse,
        priority=priority,
    )


def _end_early(ctx: WorkerContext, payload: GeneratePayload, progress: Progress,
               remaining: int) -> str:
    if remaining <= 0:  # an earlier attempt generated everything but died before `done`
        return _end_done(ctx, payload, progress, "length")
    return _end_expired(ctx, payload, progress)


def _on_delta(ctx: WorkerContext, job_id: str, progress: Progress, delta: Delta) -> None:
    text, token_ids = delta.text, delta.token_ids
    if delta.cached_tokens is not None:
        progress.cached_tokens = delta.cached_tokens
    if delta.empty:
        return
    if not progress.token_ids:
        at = datetime.now(UTC)
        if ctx.retry(ctx.store.runs.mark_first_token, job_id, at, progress.cached_tokens,
                     progress.started_at):
            progress.first_token_at = at
    progress.add_tokens(text, token_ids, delta.other_tokens)
    _emit(ctx, job_id, progress, "token", text=text, token_ids=list(token_ids),
          data=delta.event_data())
    if ctx.hold is not None:
        ctx.hold.check(job_id, len(progress.token_ids))


def _emit(ctx: WorkerContext, job_id: str, progress: Progress, kind: Any, *, text: str = "",
          token_ids: list[int] | None = None, data: dict[str, Any] | None = None) -> None:
    if progress.head is not None:  # the streamer did not send `started`: it goes first
        _publish(ctx, progress, progress.head)
        progress.head = None
    _publish(ctx, progress, Event(job_id=job_id, seq=progress.seq, kind=kind, text=text,
                                  token_ids=token_ids or [], data=data or {}))


def _publish(ctx: WorkerContext, progress: Progress, event: Event) -> None:
    # A retry after a lost reply finds its seq already appended: Redis refuses it, and
    # publish() says so instead of raising (the stream id is the seq). The attempt's last
    # event releases its lease in the same round trip.
    publish = ctx.publisher.publish_last if event.terminal else ctx.publisher.publish
    ctx.retry(publish, event, progress.lease, progress.history)
    progress.appended(event)


def _end_done(ctx: WorkerContext, payload: GeneratePayload, progress: Progress,
              finish_reason: str) -> str:
    ended, job = _finish(ctx, payload.job_id, progress, JobStatus.DONE,
                         finish_reason=finish_reason)
    if not ended:
        # A DELETE landed between the last cancel check and here: the API answered
        # "cancelled", and the store, where the row is already cancelled, is the truth.
        return _end_cancelled(ctx, payload, progress)
    _emit(ctx, payload.job_id, progress, "done",
          data=_done_data(payload, job, finish_reason, progress))
    _count_end(ctx, JobStatus.DONE, job, progress)
    return "done"


def _done_data(payload: GeneratePayload, job: Any, finish_reason: str,
               progress: Progress) -> dict[str, Any]:
    return {
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": payload.prompt_tokens,
                  "completion_tokens": progress.completion_tokens,
                  "cached_tokens": job.cached_tokens if job else None},
        "queue_wait_ms": job.queue_wait_ms if job else None,
        "ttft_ms": job.ttft_ms if job else None,
        "tpot_ms": job.tpot_ms if job else None,
    }


def _end_cancelled(ctx: WorkerContext, payload: GeneratePayload, progress: Progress) -> str:
    _, job = _finish(ctx, payload.job_id, progress, JobStatus.CANCELLED,
                     finish_reason="cancelled")
    _emit(ctx, payload.job_id, progress, "done", data={
        "finish_reason": "cancelled",
        "usage": {"prompt_tokens": payload.prompt_tokens,
                  "completion_tokens": progress.completion_tokens}})
    _count_end(ctx, JobStatus.CANCELLED, job, progress)
    return "cancelled"


def _end_expired(ctx: WorkerContext, payload: GeneratePayload, progress: Progress) -> str:
    _, job = _finish(ctx, payload.job_id, progress, JobStatus.EXPIRED, finish_reason="deadline",
                     error="the job's deadline passed")
    _emit(ctx, payload.job_id, progress, "error",
          data={"code": "deadline_exceeded", "message": "the job's deadline passed"})
    _count_end(ctx, JobStatus.EXPIRED, job, progress)
    return "expired"


def _fail(ctx: WorkerContext, job_id: str, code: str, message: str,
          progress: Progress) -> None:
    _, job = _finish(ctx, job_id, progress, JobStatus.ERROR, error=message)
    _emit(ctx, job_id, progress, "error", data={"code": code, "message": message})
    _count_end(ctx, JobStatus.ERROR, job, progress)


def _finish(ctx: WorkerContext, job_id: str, progress: Progress, status: JobStatus,
            **values: Any) -> tuple[bool, Any]:
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


def _refund(ctx: WorkerContext, job: Any) -> None:
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


def _count_end(ctx: WorkerContext, status: JobStatus, job: Any, progress: Progress) -> None:
    """The attempt's end in this worker's metrics, its terminal event out: the job's
    status and timings (from its row), and the tokens this attempt generated."""
    if ctx.metrics is None or job is None:
        return
    ctx.metrics.generated(job.lane, progress.emitted_here)
    ctx.metrics.ended(job.lane, status.value, job)
