"""Every SSE stream ends (issue 10, finding 9): with the job's terminal event, or with an
`error` event of the API's own (no id; data {"code", "message"}) when the job's events
are gone, the client asks past their end, or the stream reached its longest life. A
Last-Event-ID Redis cannot read is a 400 before the stream starts.

The API runs in this process (tests/helpers.py `served`: real HTTP) with short periods
(keep-alive 0.25 s, end grace 1 s, longest life 3 s), on a Redis DB and a database of its
own. Jobs are real submits, to a chat worker that is only advertised, so they stay queued;
the test then writes what a worker would (stream entries, the row's end) or loses it.
Every read of a stream is bounded by a deadline, so a stream that never ends fails here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from tidegate_client import Client, StreamError

from store import Store
from tests.helpers import api_of_its_own, own_db
from tidegate import keys
from tidegate.events import Event
from tidegate.records import JobStatus

PERIODS = {"sse_keepalive_s": 0.25, "sse_end_grace_s": 1.0, "sse_max_lifetime_s": 3.0}
ASK = [{"role": "user", "content": "Where is my parcel?"}]
DEADLINE_S = 15.0  # a stream that has not ended by then never will


@dataclass
class Api:
    base_url: str
    key: str
    store: Store
    redis: redis.Redis
    namespace: str

    def submit(self) -> str:
        with httpx.Client(base_url=self.base_url, timeout=30) as http:
            resp = http.post("/v1/jobs", json={"lane": "chat", "messages": ASK, "max_tokens": 8},
                             headers={"Authorization": f"Bearer {self.key}"})
        assert resp.status_code == 202, resp.text
        return str(resp.json()["job_id"])

    def append(self, job_id: str, seq: int, kind: Any) -> None:
        """An event as a worker's publisher appends it."""
        event = Event(job_id=job_id, seq=seq, kind=kind, text="x" if kind == "token" else "")
        self.redis.xadd(keys.job_events(self.namespace, job_id),
                        event.stream_fields(), id=keys.stream_id(seq))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Api]:
    with api_of_its_own(redis_server, tmp_root, "sse", own_db(__name__, "13"), [("chat", "vllm")],
                        **PERIODS) as own:
        _, key = own.store.tenants.create_tenant("sse", ["chat"])
        yield Api(own.base_url, key, own.store, own.redis, own.namespace)


@dataclass
class Frame:
    id: str | None
    event: str
    data: dict[str, Any]


@dataclass
class Read:
    status: int
    frames: list[Frame]
    keepalives: int
    seconds: float
    body: Any = None  # the JSON of a refusal


def read(api: Api, job_id: str, headers: dict[str, str] | None = None,
         params: dict[str, str] | None = None, on_keepalive: Any = None) -> Read:
    """The job's stream read to its end, which must come within DEADLINE_S."""
    started = time.monotonic()
    frames: list[Frame] = []
    keepalives, frame = 0, {}
    with httpx.Client(base_url=api.base_url, timeout=DEADLINE_S) as http, http.stream(
            "GET", f"/v1/jobs/{job_id}/events", params=params,
            headers={"Authorization": f"Bearer {api.key}", **(headers or {})}) as resp:
        if resp.status_code != 200:
            return Read(resp.status_code, [], 0, 0.0, json.loads(resp.read()))
        for line in resp.iter_lines():
            assert time.monotonic() - started < DEADLINE_S, f"stream open after {DEADLINE_S} s"
            if line.startswith(":"):
                keepalives += 1
                if on_keepalive is not None:
                    on_keepalive(keepalives)
            elif line:
                name, _, value = line.partition(":")
                frame[name] = value.lstrip()
            elif frame:
                frames.append(Frame(frame.get("id"), frame["event"], json.loads(frame["data"])))
                frame = {}
    return Read(200, frames, keepalives, time.monotonic() - started)


def ends_with_error(got: Read, code: str) -> str:
    """The message of the API's own error event that ended the stream."""
    assert got.status == 200 and got.frames, got
    last = got.frames[-1]
    assert last.event == "error" and last.id is None, last
    assert last.data["code"] == code, last.data
    return str(last.data["message"])


def test_a_stream_without_its_end_event_ends_once_the_job_has_ended(api: Api) -> None:
    """A worker wrote `started` and a token, then the job's row ended without an end event
    in the stream: the events that are there, then `stream_gone` after the grace."""
    job_id = api.submit()
    api.append(job_id, 0, "started")
    api.append(job_id, 1, "token")
    assert api.store.runs.expire_job(job_id)
    got = read(api, job_id)
    assert [(f.id, f.event) for f in got.frames[:2]] == [("0", "started"), ("1", "token")]
    assert f"GET /v1/jobs/{job_id}" in ends_with_error(got, "stream_gone")
    assert len(got.frames) == 3


def test_a_quiet_stream_ends_when_its_job_ends_with_no_event(api: Api) -> None:
    """While the job is queued its stream stays open on keep-alives; the store's end (no
    event written) ends it within the grace and a few keep-alives."""
    job_id = api.submit()
    expired = []

    def expire_after_two(keepalives: int) -> None:
        if keepalives == 2:
            expired.append(api.store.runs.expire_job(job_id))

    got = read(api, job_id, on_keepalive=expire_after_two)
    assert expired == [True] and got.keepalives >= 2
    assert "expired" in ends_with_error(got, "stream_gone") and len(got.frames) == 1
    assert got.seconds >= PERIODS["sse_end_grace_s"]


def test_an_expired_stream_of_a_long_ended_job_ends_at_once(api: Api) -> None:
    job_id = api.submit()
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    assert api.store.runs.end_job(job_id, JobStatus.DONE, finish_reason="length",
                                  finished_at=long_ago)[0]
    got = read(api, job_id)
    assert "done" in ends_with_error(got, "stream_gone") and len(got.frames) == 1
    assert got.keepalives == 0  # no wait: it ended before the grace began
    with Client(api.base_url, api.key) as sdk, pytest.raises(StreamError) as raised:
        list(sdk.stream(job_id))
    assert raised.value.code == "stream_gone"


@pytest.mark.parametrize("last", [1, 7])
def test_a_last_event_id_at_or_past_the_end_gets_past_end(api: Api, last: int) -> None:
    job_id = api.submit()
    api.append(job_id, 0, "started")
    api.append(job_id, 1, "done")
    got = read(api, job_id, headers={"Last-Event-ID": str(last)})
    assert f"ended at id 1: none follow Last-Event-ID {last}" in ends_with_error(got, "past_end")
    assert len(got.frames) == 1
    control = read(api, job_id, headers={"Last-Event-ID": "0"})
    assert [(f.id, f.event) for f in control.frames] == [("1", "done")]


@pytest.mark.parametrize(("where", "value"), [
    ("header", str(2**64)), ("header", str(2**63)), ("header", "-2"), ("header", "1e3"),
    ("header", "5.0"), ("query", str(2**64)),
])
def test_a_last_event_id_redis_cannot_read_is_400(api: Api, where: str, value: str) -> None:
    job_id = api.submit()
    api.append(job_id, 0, "started")
    field = "last-event-id" if where == "header" else "last_event_id"
    got = read(api, job_id, headers={"Last-Event-ID": value} if where == "header" else None,
               params={"last_event_id": value} if where == "query" else None)
    assert got.status == 400, got
    assert got.body["error"]["field"] == field and field in got.body["error"]["message"]


def test_a_stream_at_its_longest_life_asks_for_a_reconnect(api: Api) -> None:
    job_id = api.submit()
    api.append(job_id, 0, "started")
    got = read(api, job_id)
    assert [(f.id, f.event) for f in got.frames[:1]] == [("0", "started")]
    assert "reconnect with Last-Event-ID 0" in ends_with_error(got, "reconnect")
    assert got.seconds >= PERIODS["sse_max_lifetime_s"] and len(got.frames) == 2
    api.append(job_id, 1, "done")
    again = read(api, job_id, headers={"Last-Event-ID": "0"})
    assert [(f.id, f.event) for f in again.frames] == [("1", "done")]


def test_streams_read_at_once_each_get_their_own_events_in_order(api: Api) -> None:
    """The API reads every waiting stream with one XREAD (api/streamhub.py): streams that
    wait at once, two of them on one job from different places, each get exactly their
    job's events after their Last-Event-ID, in order, as a worker appends them
    interleaved across the jobs."""
    import threading

    jobs = [api.submit() for _ in range(6)]
    readers: dict[str, Read] = {}
    starts = [(job_id, job_id, None) for job_id in jobs]
    api.append(jobs[0], 0, "started")
    api.append(jobs[0], 1, "token")
    starts.append(("second reader", jobs[0], "0"))  # has event 0 already

    def reader(name: str, job_id: str, last: str | None) -> None:
        readers[name] = read(api, job_id, headers={"Last-Event-ID": last} if last else None)

    threads = [threading.Thread(target=reader, args=start) for start in starts]
    for thread in threads:
        thread.start()
    for seq in range(4):
        for job_id in jobs:
            if job_id == jobs[0] and seq < 2:
                continue  # written before the readers started
            api.append(job_id, seq, "started" if seq == 0 else "token")
    for job_id in reversed(jobs):
        api.append(job_id, 4, "done")
    for thread in threads:
        thread.join(DEADLINE_S + 5)
    for name, job_id, last in starts:
        got = readers[name]
        first = 0 if last is None else int(last) + 1
        assert got.status == 200
        assert [f.id for f in got.frames] == [str(s) for s in range(first, 5)], (name, got)
        assert [f.event for f in got.frames][-1] == "done"
        assert all(f.data["job_id"] == job_id for f in got.frames)
