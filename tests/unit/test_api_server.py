"""api/server.py: a small response goes out in one write, a stream's head without waiting
for its first event, and the access lines of a flood of refusals are thinned before they
are made. No socket: a transport that records its writes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from api.server import AccessLog, JoinedWrites
from tidegate.logs import QuietRefusals


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


HEAD = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n"


def test_a_head_and_its_body_go_out_in_one_write() -> None:
    async def run() -> list[bytes]:
        raw = Recorder()
        joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        joined.write(HEAD)
        joined.write(b"{}")
        await asyncio.sleep(0)  # the loop's next turn: nothing more to write
        return raw.writes

    assert asyncio.run(run()) == [HEAD + b"{}"]


def test_a_streams_head_goes_out_at_the_loops_next_turn_without_its_body() -> None:
    async def run() -> tuple[list[bytes], list[bytes]]:
        raw = Recorder()
        joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        joined.write(HEAD)
        before = list(raw.writes)
        await asyncio.sleep(0)
        joined.write(b"data: 1\n\n")
        return before, raw.writes

    before, after = asyncio.run(run())
    assert before == []
    assert after == [HEAD, b"data: 1\n\n"]


def test_a_close_writes_a_head_still_held_first() -> None:
    async def run() -> Recorder:
        raw = Recorder()
        joined = JoinedWrites(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        joined.write(HEAD)
        joined.close()
        return raw

    raw = asyncio.run(run())
    assert raw.writes == [HEAD] and raw.closed
    assert JoinedWrites(raw, None).get_extra_info("peername") == ("127.0.0.1", 1)  # type: ignore[arg-type]


def _scope(path: str = "/v1/jobs") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "raw_path": path.encode(), "query_string": b"",
            "http_version": "1.1", "client": ("10.0.0.9", 5)}


def test_refused_requests_past_the_budget_make_no_access_line(
        caplog: pytest.LogCaptureFixture) -> None:
    status = [429]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status[0], "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(_: Any) -> None:
        return None

    logged = AccessLog(app, QuietRefusals(per_s=3), clock=lambda: 1000.5)

    async def requests(n: int) -> None:
        for _ in range(n):
            await logged(_scope(), receive, send)

    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        asyncio.run(requests(50))
        status[0] = 202
        asyncio.run(requests(1))
    lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert len(lines) == 4, lines
    assert lines[0] == '10.0.0.9:5 - "POST /v1/jobs HTTP/1.1" 429'
    assert lines[-1] == '10.0.0.9:5 - "POST /v1/jobs HTTP/1.1" 202'
