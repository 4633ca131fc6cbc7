"""The SSE answer (api/deps.py EventStream) as an ASGI server drives it: its frames and
headers, its stream slot given back however it ends, and its end when the client goes
away, even through a cancel that asyncio.wait_for drops (Python 3.11)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from starlette.types import Message

from api.deps import EventStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


class Client:
    """What uvicorn hands an answer: receive (the request, then a disconnect once the
    client leaves) and send (kept here)."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.left = asyncio.Event()
        self.got_frame = asyncio.Event()  # a body frame was sent: the stream is under way

    async def receive(self) -> Message:
        if not hasattr(self, "asked"):
            self.asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.got_frame.set()

    async def under_way(self) -> None:
        """Until the first frame went out: the stream then waits in its producer (this
        task runs only once the stream's task awaits there)."""
        await asyncio.wait_for(self.got_frame.wait(), 5)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def frames(n: int, then_wait: bool = False) -> AsyncIterator[bytes]:
    for i in range(n):
        yield b"id: %d\n\n" % i
    if then_wait:
        await asyncio.sleep(60)


def test_the_frames_go_out_in_order_with_the_sse_headers_then_the_end() -> None:
    client, given_back = Client(), []
    answer = EventStream(frames(3), lambda: given_back.append(1), {"x-request-id": "j1"})
    asyncio.run(answer(SCOPE, client.receive, client.send))
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-request-id"] == b"j1"
    assert b"content-length" not in headers
    assert client.bodies() == [b"id: 0\n\n", b"id: 1\n\n", b"id: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False and given_back == [1]


def test_a_client_that_leaves_ends_its_stream_and_gives_its_slot_back() -> None:
    async def main() -> list[int]:
        client, given_back = Client(), []
        answer = EventStream(frames(1, then_wait=True), lambda: given_back.append(1))
        streaming = asyncio.create_task(answer(SCOPE, client.receive, client.send))
        await client.under_way()
        client.left.set()
        await asyncio.wait_for(streaming, 5)  # ends without raising
        assert client.bodies() == [b"id: 0\n\n"]
        return given_back

    assert asyncio.run(main()) == [1]


def test_a_cancel_that_wait_for_drops_does_not_keep_a_gone_clients_stream() -> None:
    """Python 3.11's asyncio.wait_for returns the result it had when a cancel comes at
    that moment (redis-py sends every command through one): the stream goes on, and is
    cancelled again."""
    async def swallowing() -> AsyncIterator[bytes]:
        yield b"id: 0\n\n"
        with contextlib.suppress(asyncio.CancelledError):  # as wait_for does
            await asyncio.sleep(60)
        await asyncio.sleep(60)
        yield b"never"

    async def main() -> list[int]:
        client, given_back = Client(), []
        answer = EventStream(swallowing(), lambda: given_back.append(1))
        streaming = asyncio.create_task(answer(SCOPE, client.receive, client.send))
        await client.under_way()
        client.left.set()
        await asyncio.wait_for(streaming, 5)
        assert client.bodies() == [b"id: 0\n\n"]
        return given_back

    assert asyncio.run(main()) == [1]


def test_a_cancel_from_elsewhere_goes_on_and_the_slot_is_given_back() -> None:
    """A server that shuts down cancels its requests' tasks: that cancel is not the
    client's leaving, and is raised on."""
    async def main() -> list[int]:
        client, given_back = Client(), []
        answer = EventStream(frames(1, then_wait=True), lambda: given_back.append(1))
        streaming = asyncio.create_task(answer(SCOPE, client.receive, client.send))
        await client.under_way()
        streaming.cancel()
        with pytest.raises(asyncio.CancelledError):
            await streaming
        return given_back

    assert asyncio.run(main()) == [1]
