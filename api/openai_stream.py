"""The OpenAI routes' answers from a job's events: the non-streaming answer, waited for
(`whole`), and the streamed chunks (`chunks`), both read through api/jobstream.py. A
quiet job is checked against the store once per keep-alive period, so a job whose
events Redis lost still gets its answer. The routes are api/openai_routes.py; the
chunks' shapes, api/openai_answers.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TypedDict

from fastapi import Request

from api.deps import Deps, cancel
from api.jobstream import JobStream
from api.openai_answers import (
    CANCELLED,
    Answer,
    ChoiceOut,
    EndData,
    Logprob,
    TokenData,
    collect,
    done_of,
    end_data,
    finish_reason,
    job_error,
    openai_reason,
    token_data,
)
from api.openai_tools import ToolCalls
from api.sse import KEEPALIVE, data_frame, error_frame
from store import JobRecord
from tidegate.events import Event
from tidegate.jsontypes import JSONObject
from tidegate.records import JobStatus

log = logging.getLogger("tidegate.api")

POLL_S = 1.0  # a non-streaming wait looks for its client's disconnect this often


class LogprobArgs(TypedDict, total=False):
    """A chunk's logprobs arguments (Answer.chunk): its tokens', and its choice's text so
    far (a text completion's offsets count from it)."""

    logprobs: list[Logprob]
    offset: int


class Watch:
    """One completion's job: its events as they come, its row when they are quiet, and
    the cancel when its client leaves."""

    def __init__(self, deps: Deps, job_id: str, tenant_id: int, keep: bool) -> None:
        self.deps, self.job_id, self.tenant_id, self.keep = deps, job_id, tenant_id, keep
        self.stream = JobStream(deps, job_id)

    def left(self) -> None:
        """The client went away before the end: cancel the job unless its lane keeps it.
        From a `finally` of a task being cancelled: handed to a thread, not awaited."""
        if self.keep:
            return
        log.info("job %s: its client left; cancelling", self.job_id)
        asyncio.get_running_loop().run_in_executor(None, self._cancel)

    def _cancel(self) -> None:
        try:
            cancel(self.deps, self.job_id, self.tenant_id)
        except Exception as exc:  # the reconciler ends it by its deadline
            log.warning("job %s: cancel after disconnect failed (%s)", self.job_id,
                        type(exc).__name__)


async def whole(watch: Watch, request: Request, answer: Answer) -> JSONObject:
    """The non-streaming answer: wait for the job's end (its terminal event, or its row
    when the events are quiet), then answer from the row."""
    keepalive_s = watch.deps.settings.sse_keepalive_s
    quiet_since = time.monotonic()
    seen: list[Event] = []  # every event, to answer from (choices, logprobs, tool calls)
    try:
        while True:
            events = await watch.stream.events(POLL_S)
            seen += events
            if any(e.terminal for e in events):
                break
            if events:
                quiet_since = time.monotonic()
            if await request.is_disconnected():
                watch.left()
                raise asyncio.CancelledError
            if time.monotonic() - quiet_since >= keepalive_s:
                quiet_since = time.monotonic()
                if await watch.stream.ended_row() is not None:
                    break
    except asyncio.CancelledError:
        watch.left()
        raise
    row = await watch.stream.row()
    assert row is not None, "a job's row outlives the wait for its answer (retention: hours)"
    return _answer(answer, row, seen)


def _answer(answer: Answer, row: JobRecord, events: list[Event]) -> JSONObject:
    """The answer from the job's events (every choice, logprobs, tool calls) when they are
    all there, else from its row (choice 0's text alone)."""
    failed = _row_error(row) or _event_error(events)
    if failed is not None:
        raise job_error(failed)
    choices = collect(events, answer.n)
    if choices is None:
        if answer.n > 1:  # the row keeps choice 0 alone: no answer that drops the others
            raise job_error({"code": "events_lost", "message": "the job's events were lost "
                             "before its choices were read; retry it"})
        choices = [ChoiceOut(index=0, text=row.output_text or "",
                             finish_reason=row.finish_reason)]
    return answer.whole(choices, done_of(row))


def _row_error(row: JobRecord) -> JSONObject | None:
    """An ended job's error as its event's data: expired, failed or cancelled (None: done)."""
    if row.status == JobStatus.CANCELLED:
        return {"code": CANCELLED, "message": "the job was cancelled before it ended "
                "(DELETE /v1/jobs/{id})"}
    if row.status in (JobStatus.ERROR, JobStatus.EXPIRED):
        code = "deadline_exceeded" if row.status == JobStatus.EXPIRED else "job_failed"
        return {"code": code, "message": row.error or "the job failed"}
    return None


def _event_error(events: list[Event]) -> JSONObject | None:
    """A cancelled job's end as its terminal event tells it, as the streamed answer reads
    it (`_ending`): the row read just after may not show the cancel yet."""
    end = next((e for e in reversed(events) if e.terminal), None)
    if end is not None and end.kind == "done" and end.data.get("finish_reason") == "cancelled":
        return {"code": CANCELLED, "message": "the job was cancelled before it ended "
                "(DELETE /v1/jobs/{id})"}
    return None


async def chunks(watch: Watch, answer: Answer, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunks from the job's events; an error as a chunk holding `error` (the SDK
    raises it); `[DONE]` after the end."""
    if answer.chat:  # OpenAI's first chunk of each choice: the role, no text yet
        for index in range(answer.n):
            yield data_frame(answer.chunk(first=True, index=index))
    streamed: list[str] = []
    ended = False
    try:
        async for frames, done in _frames(watch, answer, streamed):
            yield frames
            if done is not None:
                ended = True
                if include_usage and "error" not in done:
                    yield data_frame(answer.usage_chunk(done))
                yield b"data: [DONE]\n\n"
                return
    finally:
        if not ended:
            watch.left()


async def _frames(watch: Watch, answer: Answer,
                  streamed: list[str]) -> AsyncIterator[tuple[bytes, EndData | None]]:
    """(frames, the end's data or None) as events come; a keep-alive when they are quiet,
    and the row's ending when the job ended without its events."""
    keepalive_s = watch.deps.settings.sse_keepalive_s
    calls = answer.tool_calls()
    fan = _Fanout(answer)
    while True:
        events = await watch.stream.events(keepalive_s)
        if not events:
            row = await watch.stream.ended_row()
            if row is None:
                yield KEEPALIVE, None
                continue
            yield _row_ending(answer, row, "".join(streamed), calls)
            return
        out = bytearray()
        for event in events:
            if event.kind == "token":
                streamed.append(event.text)
                out += _token_frames(answer, calls, fan, event)
                continue
            ending = _ending(answer, calls, fan, event)
            if ending is not None:
                yield bytes(out) + ending[0], ending[1]
                return
        if out:
            yield bytes(out), None


def _token_frames(answer: Answer, calls: ToolCalls, fan: _Fanout, event: Event) -> bytes:
    data = token_data(event)
    if "choices" in data:  # n > 1
        return fan.frames(data["choices"])
    return _token_frame(answer, calls, event.text, data.get("tool_calls"),
                        fan.logprobs(0, event.text, data.get("logprobs")))


def _ending(answer: Answer, calls: ToolCalls, fan: _Fanout,
            event: Event) -> tuple[bytes, EndData] | None:
    """A terminal event's frames and the end's data (None for another event). A cancelled
    job ends in an error chunk: its answer is not whole, and says so."""
    if event.kind == "done" and event.data.get("finish_reason") == "cancelled":
        data = {"code": CANCELLED, "message": "the job was cancelled before it ended"}
        return _job_error_chunk(data), {"error": data}
    if event.kind == "done":
        done = end_data(event)
        frames = fan.ends(done) if answer.n > 1 else _end_frames(answer, calls, done)
        return frames, done
    if event.kind == "error":
        return _job_error_chunk(event.data), {"error": event.data}
    return None


def _row_ending(answer: Answer, row: JobRecord, streamed: str,
                calls: ToolCalls) -> tuple[bytes, EndData]:
    """The end of a stream whose events are gone, from the job's row: the text not streamed
    yet, then the end."""
    data = _row_error(row)
    if data is None and answer.n > 1:  # the row keeps choice 0 alone
        data = {"code": "events_lost", "message": "the job's events were lost before its "
                "choices were streamed"}
    if data is not None:
        return _job_error_chunk(data), {"error": data}
    done = done_of(row)
    rest = (row.output_text or "")[len(streamed):]
    out = _token_frame(answer, calls, rest, None) if rest else b""
    return out + _end_frames(answer, calls, done), done


def _token_frame(answer: Answer, calls: ToolCalls, text: str,
                 worker_calls: list[JSONObject] | None,
                 logprobs: LogprobArgs | None = None) -> bytes:
    """A token event's chunk: its text (and its tokens' logprobs: `_Fanout.logprobs`), or,
    where the request reads tool calls, the content and tool-call deltas it makes
    (api/openai_tools.py); b"" for nothing to send."""
    if not calls.active:
        return data_frame(answer.chunk(text, **(logprobs or {}))) if text or logprobs else b""
    content, deltas = calls.stream(text, worker_calls or [])
    if not content and not deltas:
        return b""
    return data_frame(answer.chunk(content or None, tool_calls=deltas))


def _end_frames(answer: Answer, calls: ToolCalls, done: EndData) -> bytes:
    """The end's chunks: tool calls held to the end (required), then the finish reason
    (tool_calls where calls were made, as OpenAI says it)."""
    if not calls.active:
        return data_frame(answer.chunk(done=done))
    out = b""
    held = calls.stream_end()
    if held:
        out += data_frame(answer.chunk(tool_calls=held))
    unsent = calls.unsent_text()
    if unsent:
        out += data_frame(answer.chunk(unsent))
    reason = calls.finish_reason(finish_reason(done), calls.streamed_any())
    return out + data_frame(answer.chunk(done=done, reason=reason))


class _Fanout:
    """A stream's choices (n > 1: a chunk per choice's new text, its end when it ends, as
    OpenAI streams them), and each choice's text so far (a text completion's logprobs
    count their offsets from it)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.offsets = [0] * answer.n
        self.ended: set[int] = set()

    def logprobs(self, index: int, text: str, entries: list[Logprob] | None) -> LogprobArgs:
        """The chunk's logprobs arguments for `text`, and the choice's offset moved on."""
        offset = self.offsets[index]
        self.offsets[index] += len(text)
        return {} if entries is None else {"logprobs": entries, "offset": offset}

    def frames(self, parts: list[TokenData]) -> bytes:
        out = b""
        for part in parts:
            index = part["index"]
            if not 0 <= index < self.answer.n:
                continue
            if part["text"] or part.get("logprobs"):
                extra = self.logprobs(index, part["text"], part.get("logprobs"))
                out += data_frame(self.answer.chunk(part["text"], index=index, **extra))
            if part.get("finish_reason") and index not in self.ended:
                self.ended.add(index)
                out += data_frame(self.answer.chunk(reason=openai_reason(part["finish_reason"]),
                                                index=index))
        return out

    def ends(self, done: EndData) -> bytes:
        """The end of every choice not ended yet (done's finish reason)."""
        return b"".join(data_frame(self.answer.chunk(done=done, index=i))
                        for i in range(self.answer.n) if i not in self.ended)


def _job_error_chunk(data: Mapping[str, object]) -> bytes:
    """A job's error (its `error` event's data) as OpenAI's error chunk."""
    error = job_error(data)
    return error_frame(error.kind, error.message, openai=True)
