"""The one reader of a job's events (api/jobstream.py) and what the two front doors render
from it: the jobs API's SSE (api/job_sse.py: ids, the stream's own `error` events, the
quiet checks) and the OpenAI routes' chunks (api/openai_stream.py), on a stand-in stream
hub, Redis and store: the frames a client would get."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from api.job_sse import JustAccepted, job_sse
from api.jobstream import JobStream
from api.openai_answers import Answer
from api.openai_api import parse_chat
from api.openai_stream import Watch, chunks
from api.streamhub import Entry
from store import JobRecord
from tidegate import keys
from tidegate.events import Event
from tidegate.records import JobStatus
from tidegate.settings import Settings

ENDED_AT = datetime(2026, 1, 1, tzinfo=UTC)  # long past: any grace is over


def _entry(seq: int, kind: str, text: str = "", **data: Any) -> Entry:
    event = Event(job_id="j1", seq=seq, kind=kind, text=text, data=data)
    return keys.stream_id(seq).encode(), {b"e": event.to_json().encode(),
                                          b"k": kind.encode()}


def _row(status: JobStatus = JobStatus.DONE, text: str = "hello") -> JobRecord:
    ended = status in (JobStatus.DONE, JobStatus.ERROR, JobStatus.EXPIRED,
                       JobStatus.CANCELLED)
    return JobRecord(
        id="j1", tenant_id=1, lane="interactive", queue="q", priority=5, session_id=None,
        status=status, idempotency_key=None, sampling={}, prompt_tokens=3,
        completion_tokens=2, finish_reason="stop", error=None, output_text=text,
        enqueued_at=ENDED_AT, started_at=ENDED_AT, first_token_at=ENDED_AT,
        finished_at=ENDED_AT if ended else None, queue_wait_ms=None, ttft_ms=None,
        tpot_ms=None, worker=None, engine=None, attempts=1)


class _Hub:
    """Hands out the reads given, one a call, then nothing (a quiet stream)."""

    def __init__(self, reads: list[list[Entry]]) -> None:
        self.reads, self.cursors = list(reads), []

    async def read(self, key: str, cursor: str | bytes, wait_s: float) -> list[Entry]:
        self.cursors.append(cursor)
        return self.reads.pop(0) if self.reads else []


class _Redis:
    def __init__(self, last: list[Entry], fails: bool = False) -> None:
        self.last, self.fails = last, fails

    async def xrevrange(self, key: str, count: int = 1) -> list[Entry]:
        if self.fails:
            raise aioredis.ConnectionError("gone")
        return self.last


def _deps(reads: list[list[Entry]], row: JobRecord | None, last: list[Entry] | None = None,
          fails: bool = False) -> Any:
    settings = Settings().model_copy(update={"sse_keepalive_s": 0.01,
                                             "sse_max_lifetime_s": 5.0})
    store = types.SimpleNamespace(jobs=types.SimpleNamespace(
        get_job=lambda job_id, tenant_id=None: row))
    return types.SimpleNamespace(settings=settings, stream_hub=_Hub(reads), store=store,
                                 stream_redis=_Redis(last or [], fails))


def _take(stream: AsyncIterator[bytes], n: int = 10) -> list[bytes]:
    async def run() -> list[bytes]:
        out = []
        async for chunk in stream:
            out.append(chunk)
            if len(out) == n:
                break
        return out

    return asyncio.run(run())


def test_the_reader_moves_past_what_it_read_and_reads_rows_on_a_thread() -> None:
    deps = _deps([[_entry(0, "started"), _entry(1, "token", "hi")]], _row())
    stream = JobStream(deps, "j1", after=-1)

    async def run() -> tuple[list[Event], list[Event], JobRecord | None]:
        return await stream.events(1.0), await stream.events(1.0), await stream.ended_row()

    first, second, row = asyncio.run(run())
    assert [e.kind for e in first] == ["started", "token"] and second == []
    assert stream.seq == 1 and deps.stream_hub.cursors == ["0-0", b"2-0"]
    assert row is not None and row.terminal


def test_a_resumed_reader_starts_after_the_last_event_id() -> None:
    stream = JobStream(_deps([], None), "j1", after=4)
    assert stream.cursor == keys.stream_id(4) and stream.seq == 4


def test_sse_sends_the_events_with_their_ids_and_ends_at_the_terminal_one() -> None:
    reads = [[_entry(0, "started"), _entry(1, "token", "he")], [_entry(2, "done")]]
    frames = _take(job_sse(_deps(reads, None), JustAccepted("j1", 1), -1))
    assert [f.split(b"\n")[:2] for f in frames] == [
        [b"id: 0", b"event: started"], [b"id: 2", b"event: done"]]
    assert b"id: 1\nevent: token\n" in frames[0]


def _error_of(frame: bytes) -> dict[str, str]:
    head, data = frame.split(b"\ndata: ")
    assert head == b"event: error"  # no id: the client's Last-Event-ID stays its last event
    parsed: dict[str, str] = json.loads(data)
    return parsed


def test_sse_resumed_past_the_end_says_nothing_follows() -> None:
    frames = _take(job_sse(_deps([], _row(), last=[_entry(3, "done")]), _row(), 3))
    assert _error_of(frames[-1])["code"] == "past_end"


def test_sse_of_an_ended_job_whose_events_are_gone_says_so_after_the_grace() -> None:
    frames = _take(job_sse(_deps([], _row()), _row(), 1))
    assert [_error_of(f)["code"] for f in frames] == ["stream_gone"]


def test_sse_of_a_quiet_job_not_ended_keeps_the_stream_open() -> None:
    running = _row(JobStatus.RUNNING)
    assert _take(job_sse(_deps([], running), running, 1), 3) == [b": keep-alive\n\n"] * 3


def test_sse_when_redis_fails_says_where_to_resume() -> None:
    (frame,) = _take(job_sse(_deps([], _row(), fails=True), _row(), 1))
    error = _error_of(frame)
    assert error["code"] == "unavailable" and "Last-Event-ID 1" in error["message"]


def _chat() -> Answer:
    req = parse_chat({"model": "interactive", "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]})
    return Answer.of("j1", req, "default")


def _data(frames: list[bytes]) -> list[Any]:
    """Each `data:` frame's JSON, "[DONE]" for the last."""
    out: list[Any] = []
    for chunk in frames:
        for part in chunk.split(b"\n\n")[:-1]:
            body = part.removeprefix(b"data: ")
            out.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    return out


def test_openai_chunks_from_a_row_when_the_events_were_lost_mid_stream() -> None:
    watch = Watch(_deps([[_entry(0, "token", "he")]], _row(text="hello")), "j1", 1, True)
    out = _data(_take(chunks(watch, _chat(), include_usage=False), 20))
    deltas = [c["choices"][0]["delta"].get("content") for c in out[:-1]]
    assert deltas == ["", "he", "llo", None] and out[-2]["choices"][0]["finish_reason"] == "stop"
    assert out[-1] == "[DONE]"


def test_openai_chunks_end_a_failed_job_in_an_error_chunk() -> None:
    failed = _entry(0, "error", code="engine_failed", message="the engine failed")
    watch = Watch(_deps([[failed]], _row()), "j1", 1, True)
    out = _data(_take(chunks(watch, _chat(), include_usage=False), 20))
    assert out[-2] == {"error": {"message": "the engine failed", "type": "server_error",
                                 "param": None, "code": "engine_failed"}}
    assert out[-1] == "[DONE]"
