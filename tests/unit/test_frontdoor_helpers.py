"""bench/frontdoor.py's pure parts: CPU time from /proc stat lines, the engine thread's OS
name (workers/host.py) as the bench finds it, SSE frames as the API writes them, and the
join of receipts with the workers' write times."""

from __future__ import annotations

import os
import threading

from api.sse import job_frames
from bench.frontdoor import (
    CLOCK_TICKS,
    ENGINE_THREAD,
    delivery_lags_ms,
    parse_frame,
    split_frames,
    stat_cpu_s,
    threads_cpu_s,
)
from tidegate import keys
from tidegate.events import Event
from workers import host


def test_stat_cpu_counts_utime_and_stime_after_a_name_with_spaces_and_parens() -> None:
    fields = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", "250", "50", "7", "9"]
    line = "4242 (a (weird) name) " + " ".join(fields)
    assert stat_cpu_s(line) == (250 + 50) / CLOCK_TICKS


def test_the_engine_threads_os_name_is_what_the_bench_looks_for() -> None:
    assert host.ENGINE_THREAD == ENGINE_THREAD
    named, stop = threading.Event(), threading.Event()

    def engine_like() -> None:
        host.name_os_thread(ENGINE_THREAD)
        named.set()
        stop.wait(5)

    # Engine threads of earlier tests in this process may still be alive: count the new one.
    _, before = threads_cpu_s(os.getpid(), ENGINE_THREAD)
    thread = threading.Thread(target=engine_like)
    thread.start()
    try:
        named.wait(5)
        cpu_s, found = threads_cpu_s(os.getpid(), ENGINE_THREAD)
        assert found == before + 1
        assert cpu_s >= 0
    finally:
        stop.set()
        thread.join()


def test_frames_written_by_the_api_parse_back_to_ids_and_kinds() -> None:
    events = [Event(job_id="j", seq=1, kind="token", text="a", token_ids=[5]),
              Event(job_id="j", seq=2, kind="done", data={"ttft_ms": 3.0})]
    entries = [(keys.stream_id(e.seq).encode(),
                {b"e": e.to_json().encode(), b"k": e.kind.encode(), b"t": b"1.5"})
               for e in events]
    body, ended = job_frames(entries)
    assert ended
    # Split anywhere: a frame cut by the chunk boundary waits for its rest.
    frames, rest = split_frames(body[:-5])
    assert len(frames) == 1 and rest
    frames, rest = split_frames(rest + body[-5:])
    assert rest == b""
    seq, kind, data = parse_frame(frames[0])
    assert (seq, kind) == (2, "done") and Event.from_json(data).data == {"ttft_ms": 3.0}
    assert parse_frame(b": keep-alive")[0] is None


def test_delivery_lag_joins_receipts_with_write_times_on_the_event_id() -> None:
    published = {0: ("started", 10.0), 1: ("token", 10.5)}
    lags = delivery_lags_ms([(0, 10.002), (1, 10.51), (2, 11.0)], published)
    assert [round(lag, 3) for lag in lags] == [2.0, 10.0]  # seq 2 has no write time
