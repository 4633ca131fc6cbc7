"""GET /v1/jobs/{id}/events: a job's events as server-sent events, read through
api/jobstream.py and rendered with api/sse.py. The route is api/job_routes.py."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException
from sqlalchemy.exc import SQLAlchemyError

from api.deps import Deps
from api.jobstream import JobStream
from api.sse import KEEPALIVE, TERMINAL_KINDS, error_frame, job_frames, kind_of
from store import JobRecord
from tidegate import keys

log = logging.getLogger("tidegate.api")

End = tuple[str, str]  # (code, message) of the `error` event that ends a stream


@dataclass(frozen=True)
class JustAccepted:
    """What a stream needs of a job's row, for a job this process has just accepted."""

    id: str
    tenant_id: int
    terminal: bool = False  # as far as the stream's start needs to know: its events say


async def job_sse(deps: Deps, job: JobRecord | JustAccepted, after: int) -> AsyncIterator[bytes]:
    """Events after seq `after`, from the job's stream: resumable, never repeated, and
    never a wait without end.

    Events go out as they come. A quiet stream sends a keep-alive each `sse_keepalive_s`
    and looks at the stream's last entry and the job's row: one store read per quiet
    period, none per event. While the job is not terminal in the store the stream stays
    open, however quiet (queued; or its worker died and another attempt will resume).
    Otherwise it ends with an `error` event of its own, with no id (the client's
    Last-Event-ID stays its last job event) and data {"code", "message"}:

        past_end     the job's stream ended at or before Last-Event-ID: nothing follows
        stream_gone  the job ended, and `sse_end_grace_s` later its end is not in the
                     stream (expired, lost by Redis, never written); GET /v1/jobs/{id}
                     has the result
        reconnect    the stream reached `sse_max_lifetime_s`: reconnect with Last-Event-ID
        unavailable  Redis failed: reconnect with Last-Event-ID in a few seconds
    """
    s = deps.settings
    stream = JobStream(deps, job.id, after)
    ending = _Ending(stream)
    closes_at = time.monotonic() + s.sse_max_lifetime_s
    try:
        end = await ending.verdict(job)  # the row the handler read: no second store read
        while end is None:
            wait_s = min(s.sse_keepalive_s, closes_at - time.monotonic())
            if wait_s <= 0:
                end = ("reconnect", f"this stream reached its longest life, "
                       f"{s.sse_max_lifetime_s:g} s: reconnect with Last-Event-ID {stream.seq}")
                break
            frames, ended = job_frames(await stream.entries(wait_s))
            if frames:
                yield frames
                if ended:
                    return
                continue
            end = await ending.verdict()
            if end is None:
                yield KEEPALIVE
    except (aioredis.RedisError, RedisClusterException) as exc:
        log.warning("SSE of job %s: Redis failed (%s)", job.id, type(exc).__name__,
                    extra={"job_id": job.id})
        end = ("unavailable", f"Redis is unavailable: reconnect with Last-Event-ID {stream.seq} "
               "in a few seconds")
    yield error_frame(*end)


class _Ending:
    """What tells a quiet stream that the job's events ended, or will never come."""

    def __init__(self, stream: JobStream) -> None:
        self.stream = stream
        self.ended_at: float | None = None  # when the job ended, as the store first said

    async def verdict(self, job: JobRecord | JustAccepted | None = None) -> End | None:
        """(code, message) of the error event that ends the stream now; None: wait on.
        `job`: the row the handler read; None: read it from the store."""
        seq = self.stream.seq  # the last event the client has
        if seq < 0 and job is not None and not job.terminal:
            # From the start, a job not ended: neither its stream's end (ahead of any
            # Last-Event-ID) nor its row can end it, so the stream's last entry is not read.
            return None
        last = await self.stream.last_entry()
        if last is not None and kind_of(last[1]) in TERMINAL_KINDS:
            end_seq = keys.seq_of(last[0])
            if end_seq > seq:
                return None  # the end is in the stream, ahead: the next read brings it
            return ("past_end", f"the job's events ended at id {end_seq}: none follow "
                    f"Last-Event-ID {seq}")
        if isinstance(job, JustAccepted):
            return None  # not ended, as far as this process knows: its events will say
        if job is None:
            try:
                job = await self.stream.row()
            except SQLAlchemyError as exc:  # the store's outage must not end a stream
                log.warning("SSE of job %s: store failed (%s)", self.stream.job_id,
                            type(exc).__name__, extra={"job_id": self.stream.job_id})
                return None
        return self._job_ended(job)

    def _job_ended(self, job: JobRecord | None) -> End | None:
        if job is None:
            return ("stream_gone", "the job no longer exists")
        if not job.terminal:
            return None
        if self.ended_at is None:
            self.ended_at = job.finished_at.timestamp() if job.finished_at else time.time()
        if time.time() < self.ended_at + self.stream.deps.settings.sse_end_grace_s:
            return None  # its end event may be on its way (written after the row)
        return ("stream_gone", f"the job ended ({job.status.value}) and its events are gone "
                f"(expired, or lost by Redis): GET /v1/jobs/{job.id} has its result")
