"""The SDK's SSE line reading: lines end at CR, LF or CRLF only, whatever the chunks."""

from __future__ import annotations

import asyncio
import json

from tidegate_client import AsyncClient
from tidegate_client.client import _sse_lines, _SseParser


def frames(text: str, size: int) -> list[bytes]:
    raw = text.encode()
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def test_a_token_holding_line_separators_stays_one_event() -> None:
    token = "a\u2028b\u2029c\x85d"  # str.splitlines (and httpx's iter_lines) split at these
    data = json.dumps({"job_id": "j", "seq": 3, "kind": "token", "text": token,
                       "token_ids": [1]}, ensure_ascii=False)
    stream = f": keep-alive\r\n\r\nid: 3\r\nevent: token\r\ndata: {data}\r\n\r\n"
    for size in (1, 2, 3, 7, len(stream.encode())):  # CRLF and UTF-8 split across chunks
        parser = _SseParser()
        events = [e for line in _sse_lines(frames(stream, size))
                  if (e := parser.feed(line)) is not None]
        assert [(e.seq, e.text) for e in events] == [(3, token)], size


def test_the_async_client_closes_with_async_with() -> None:
    async def run() -> bool:
        async with AsyncClient("http://127.0.0.1:9", "tg_x") as client:
            pass
        return client.http.is_closed

    assert asyncio.run(run())
