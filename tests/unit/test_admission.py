"""The API's submit admission (most urgent lane first), SSE framing of stored events and
the lanes' cpu_nice field: parts tested without an engine."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from api.admission import Admission, RecentLanes
from api.deps import stream_rank
from api.sse import job_frames
from tidegate.events import Event
from tidegate.lanes import LanesConfigError, load_lanes

FINANCE, CHAT = (0, -7), (10, -4)  # (cpu_nice, -priority) of the shipped lanes


async def _order_served(submits: list[tuple[str, tuple[int, int]]]) -> list[str]:
    """Runs `submits` on one thread held busy until all are queued; the order they ran in."""
    admission = Admission(threads=1)
    release, served = threading.Event(), []
    busy = asyncio.ensure_future(admission.run((0,), release.wait))
    while admission.waiting():  # the blocker has been taken by the thread
        await asyncio.sleep(0)
    calls = [asyncio.ensure_future(admission.run(rank, served.append, name))
             for name, rank in submits]
    while admission.waiting() < len(submits):
        await asyncio.sleep(0)
    release.set()
    await asyncio.gather(busy, *calls)
    admission.close()
    return served


def test_a_finance_submit_waiting_behind_chat_submits_runs_first() -> None:
    order = asyncio.run(_order_served([("chat-1", CHAT), ("chat-2", CHAT),
                                       ("finance-1", FINANCE), ("chat-3", CHAT)]))
    assert order == ["finance-1", "chat-1", "chat-2", "chat-3"]


def test_inside_a_lane_higher_priority_first_then_arrival() -> None:
    order = asyncio.run(_order_served([("p4-a", (10, -4)), ("p9", (10, -9)),
                                       ("p4-b", (10, -4))]))
    assert order == ["p9", "p4-a", "p4-b"]


def test_a_resumed_stream_opens_before_every_lanes_submits() -> None:
    """A consumer that resumes (Last-Event-ID) a job this process accepted for its tenant
    goes before every lane's submits; a resume of a job it does not know (after an API
    restart) goes with its tenant's most urgent lane (issue 28, finding 5)."""
    recent = RecentLanes(size=4)
    recent.add("job-f", "finance", tenant_id=7)
    deps = SimpleNamespace(settings=SimpleNamespace(lanes=load_lanes()),
                           recent_lanes=recent)
    tenant = SimpleNamespace(id=7, lanes=frozenset({"finance", "chat"}))
    resumed = stream_rank(deps, "job-f", 41, tenant)  # type: ignore[arg-type]
    unknown = stream_rank(deps, "job-unknown", 41, tenant)  # type: ignore[arg-type]
    assert stream_rank(deps, "job-f", -1, tenant) == FINANCE  # type: ignore[arg-type]
    assert unknown == FINANCE
    order = asyncio.run(_order_served([("chat-1", CHAT), ("finance-1", FINANCE),
                                       ("resume", resumed), ("resume-unknown", unknown)]))
    assert order == ["resume", "finance-1", "resume-unknown", "chat-1"]


def test_an_error_in_a_submit_reaches_its_caller_and_the_thread_serves_on() -> None:
    def fail() -> None:
        raise ValueError("lane: unknown lane")

    async def main() -> tuple[str, int]:
        admission = Admission(threads=1)
        with pytest.raises(ValueError, match="unknown lane"):
            await admission.run(FINANCE, fail)
        result = await admission.run(FINANCE, len, "abc")
        admission.close()
        return "ok", result

    assert asyncio.run(main()) == ("ok", 3)


def test_recent_lanes_keeps_the_last_jobs_only() -> None:
    recent = RecentLanes(size=2)
    for job, lane in (("a", "chat"), ("b", "finance"), ("c", "chat")):
        recent.add(job, lane)
    assert [recent.get(j) for j in "abc"] == [None, "finance", "chat"]


def test_a_job_is_fresh_for_its_own_tenant_only_and_only_for_a_while() -> None:
    """What lets a stream opened right after its submit skip the row read (api/job_routes.py)."""
    now = [100.0]
    recent = RecentLanes(size=4, clock=lambda: now[0])
    recent.add("a", "chat", tenant_id=7)
    assert recent.fresh("a", 7, within_s=60)
    assert not recent.fresh("a", 8, within_s=60)  # another tenant's
    assert not recent.fresh("unknown", 7, within_s=60)
    now[0] += 61
    assert not recent.fresh("a", 7, within_s=60)


def _entry(event: Event, with_kind: bool = True) -> tuple[bytes, dict[bytes, bytes]]:
    fields = {b"e": event.to_json().encode()}
    if with_kind:
        fields[b"k"] = event.kind.encode()
    return f"{event.seq + 1}-0".encode(), fields


def test_sse_frames_carry_the_stored_json_and_stop_at_the_terminal_event() -> None:
    token = Event(job_id="j", seq=1, kind="token", text="héllo\n", token_ids=[5])
    done = Event(job_id="j", seq=2, kind="done", data={"finish_reason": "length"})
    started = Event(job_id="j", seq=0, kind="started")
    # The first entry has no kind field, as an older worker wrote it.
    chunk, ended = job_frames([_entry(started, with_kind=False), _entry(token),
                                _entry(done), _entry(token)])
    frames = chunk.decode().split("\n\n")[:-1]
    assert ended and len(frames) == 3
    assert frames[0].startswith("id: 0\nevent: started\ndata: ")
    assert frames[1] == f"id: 1\nevent: token\ndata: {token.to_json()}"
    assert Event.from_json(frames[1].split("data: ", 1)[1]) == token
    assert frames[2].startswith("id: 2\nevent: done\n")


def test_sse_frames_without_a_terminal_event_say_so() -> None:
    token = Event(job_id="j", seq=4, kind="token", text="a", token_ids=[1])
    chunk, ended = job_frames([_entry(token)])
    assert not ended and chunk.startswith(b"id: 4\nevent: token\n")


def test_cpu_nice_outside_0_to_19_is_refused_naming_lane_and_field(tmp_path: Path) -> None:
    lanes = tmp_path / "lanes.toml"
    lanes.write_text('[lanes.chat]\nqueue = "chat"\ncpu_nice = 20\n')
    with pytest.raises(LanesConfigError, match="'chat'.*cpu_nice"):
        load_lanes(lanes)


def test_shipped_lanes_let_chat_yield_the_cpu_to_finance() -> None:
    lanes = load_lanes()
    assert lanes["finance"].cpu_nice < lanes["chat"].cpu_nice
