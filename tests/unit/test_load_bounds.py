"""The API's load bounds as plain code (issue 10, findings 9 and 10): the admission queue's
bound, the SSE stream slots, the depth from which a lane sheds a priority, a lane's own
depth cap, and how the SDK reads the API's own `error` event."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from tidegate_client import StreamError
from tidegate_client.client import _failed, _SseParser

from api.admission import Admission, StreamSlots
from api.errors import ApiError
from api.limits import depth_limit
from tidegate.lanes import load_lanes


def test_a_full_admission_queue_refuses_at_once_with_503_and_retry_after() -> None:
    async def main() -> ApiError:
        admission = Admission(threads=1, max_waiting=2)
        taken, release = threading.Event(), threading.Event()

        def block() -> None:
            taken.set()
            release.wait()

        busy = asyncio.ensure_future(admission.run((0,), block))
        while not taken.is_set():  # the one thread is busy from here
            await asyncio.sleep(0.001)
        queued = [asyncio.ensure_future(admission.run((0,), len, "ab")) for _ in range(2)]
        while admission.waiting() < 2:
            await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            await admission.run((0,), len, "abc")
        release.set()
        assert await asyncio.gather(*queued) == [2, 2]  # the ones that waited still ran
        await busy
        admission.close()
        return refused.value

    error = asyncio.run(main())
    assert error.status == 503 and error.kind == "overloaded"
    assert error.headers["Retry-After"] == "1"


def test_stream_slots_cap_each_tenant_and_the_process_and_come_back_once() -> None:
    slots = StreamSlots(total=3, per_tenant=2)
    a1, _ = slots.take(1), slots.take(1)
    with pytest.raises(ApiError, match="this API key has 2 streams open") as per_tenant:
        slots.take(1)
    assert per_tenant.value.status == 429 and per_tenant.value.kind == "too_many_streams"
    slots.take(2)
    with pytest.raises(ApiError, match="this API process has 3 streams open"):
        slots.take(3)
    a1()
    a1()  # a second give-back of one slot frees nothing more
    assert slots.open() == 2
    slots.take(3)
    with pytest.raises(ApiError):
        slots.take(3 + 1)


@pytest.mark.parametrize(("priority", "limit"), [(9, 100), (4, 100), (3, 87), (1, 62),
                                                 (0, 50)])
def test_below_the_lanes_default_priority_a_job_meets_a_lower_depth(priority: int,
                                                                     limit: int) -> None:
    assert depth_limit(100, priority, default_priority=4) == limit


def test_a_lane_may_set_its_own_queue_depth(tmp_path: Path) -> None:
    lanes = tmp_path / "lanes.toml"
    lanes.write_text('[lanes.bulk]\nqueue = "bulk"\nmax_queue_depth = 50\n'
                     '[lanes.chat]\nqueue = "chat"\n')
    loaded = load_lanes(lanes)
    assert loaded["bulk"].max_queue_depth == 50 and loaded["chat"].max_queue_depth is None


def _frames(parser: _SseParser, lines: list[str]) -> list[object]:
    return [event for line in lines if (event := parser.feed(line)) is not None]


def test_the_sdk_reads_the_apis_own_error_event_and_reconnects_only_when_asked() -> None:
    parser = _SseParser()
    job_error = ['id: 3', 'event: error', 'data: {"job_id": "j", "seq": 3, "kind": "error", '
                 '"text": "", "token_ids": [], "data": {"code": "internal"}}', '']
    (event,) = _frames(parser, job_error)  # a job's error event is an event like any
    with pytest.raises(StreamError) as ended:
        _frames(parser, ['event: error', 'data: {"code": "stream_gone", "message": "gone"}', ''])
    assert ended.value.code == "stream_gone"
    with pytest.raises(StreamError):
        _failed(ended.value, 0, 5)  # gone for good: no reconnect
    assert _failed(StreamError("reconnect", "longest life"), 3, 5) == 0
    assert _failed(StreamError("unavailable", "Redis"), 3, 5) == 4
