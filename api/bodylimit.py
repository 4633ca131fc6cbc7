"""Every request body bounded on the bytes read, for every route (ASGI middleware).

A declared Content-Length over the route's limit is refused before the app runs. A body
without one (chunked) is counted as the app reads it: at the first byte over the limit
the 413 goes out at once, naming the body, and the app's read fails (BodyTooLarge), so
nothing past the limit is buffered, whatever the route does with its body.

A response that starts before the request's body was read to its end (a 401 before the
body, a 413 in the middle of it) says `Connection: close` when that rest may be large (a
chunked body, or a declared one over DRAIN_BYTES): the server then closes the connection
instead of reading, and discarding, a body it will never use. A small declared body is
drained, and its connection kept (a flood of small refused requests reconnecting each
time would cost more than their bodies).

Starlette has no such middleware (its multipart parser bounds parts, not bodies); this one
is written here, in the plain ASGI of its docs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLOSE = (b"connection", b"close")
DRAIN_BYTES = 64 * 1024  # the most of an unread body the server may read to keep a connection


class BodyTooLarge(Exception):
    """Raised into the app by its read past the limit; the 413 has already been sent."""


# (the request's scope, the limit) -> the 413 to send (a Starlette Response).
Refusal = Callable[[Scope, int], Any]


class BodyLimit:
    """`limit_of(scope)`: the byte limit of the request's body; `refusal`: its 413."""

    def __init__(self, app: ASGIApp, limit_of: Callable[[Scope], int],
                 refusal: Refusal) -> None:
        self.app, self.limit_of, self.refusal = app, limit_of, refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _Body(scope, self.limit_of(scope), receive, send, self.refusal)
        if body.declared is not None and body.declared > body.limit:
            await body.refuse()
            return
        with contextlib.suppress(BodyTooLarge):  # the 413 went out when the limit passed
            await self.app(scope, body.receive, body.send)


class _Body:
    """One request's body as the app reads it, and its response as the app sends it."""

    def __init__(self, scope: Scope, limit: int, receive: Receive, send: Send,
                 refusal: Refusal) -> None:
        self.scope, self.limit, self.refusal = scope, limit, refusal
        self._receive, self._send = receive, send
        headers = dict(scope["headers"])
        self.declared = _int(headers.get(b"content-length"))
        # Without Content-Length or Transfer-Encoding a request has no body to read; a
        # small declared one is as good as read (the server drains it).
        chunked = self.declared is None and b"transfer-encoding" in headers
        self.read_all = not chunked and (self.declared or 0) <= DRAIN_BYTES
        self.count = 0
        self.started = False  # the response
        self.refused = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.count += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.read_all = True
            if self.count > self.limit:
                await self.refuse()
                raise BodyTooLarge(f"body: over {self.limit} bytes")
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return  # the 413 was the answer: the app's own goes nowhere
        if message["type"] == "http.response.start":
            self.started = True
            if not self.read_all:
                message = {**message, "headers": [*message.get("headers", []), CLOSE]}
        await self._send(message)

    async def refuse(self) -> None:
        if self.started or self.refused:
            return  # too late for a 413 (the app answered first): only the read fails
        self.refused = True
        response = self.refusal(self.scope, self.limit)
        response.headers["connection"] = "close"
        await response(self.scope, _disconnected, self._send)


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}


def _int(raw: bytes | None) -> int | None:
    if raw is None or not raw.isdigit():
        return None
    return int(raw)
