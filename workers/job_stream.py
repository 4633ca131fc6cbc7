"""A job's tokens, from the engine to its event stream: through the worker's streamer with
every other job of the engine step (the usual path), or published from the task thread,
one round trip per event (while a fault-injection hold is armed, workers/faults.py, which
counts each token on that thread). Each event is published under the job's lease."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from tasks.payloads import GeneratePayload
from tidegate import keys
from tidegate.events import Event, Kind
from workers import streamer
from workers.context import WorkerContext
from workers.engine import OWN, Delta, EngineRequest
from workers.host import Cancelled
from workers.progress import Progress
from workers.publisher import StreamState
from workers.streamer import Feed


def stream_each(ctx: WorkerContext, job_id: str, progress: Progress,
                 request: EngineRequest, timeout_s: float | None) -> str:
    """The job's events published from this thread, one round trip each; its finish
    reason."""
    finish_reason = "length"
    watch = _CancelWatch(ctx, job_id)
    for delta in ctx.host.run(request, timeout_s=timeout_s):
        on_delta(ctx, job_id, progress, delta)
        finish_reason = delta.finish_reason or finish_reason
        watch.check()
    return finish_reason


def stream_batched(ctx: WorkerContext, job_id: str, progress: Progress,
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
                on_delta(ctx, job_id, progress, delta)
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


def engine_request(payload: GeneratePayload, remaining: int, state: StreamState,
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


def on_delta(ctx: WorkerContext, job_id: str, progress: Progress, delta: Delta) -> None:
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
    emit(ctx, job_id, progress, "token", text=text, token_ids=list(token_ids),
          data=delta.event_data())
    if ctx.hold is not None:
        ctx.hold.check(job_id, len(progress.token_ids))


def emit(ctx: WorkerContext, job_id: str, progress: Progress, kind: Kind, *, text: str = "",
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
