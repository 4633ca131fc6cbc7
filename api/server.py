"""How `tidegate api` serves the app: uvicorn, with its access lines and its response
writes done here.

Both are on a measured hot path: a flood of strangers, each refused at the front door
(api/frontgate.py), costs the API what uvicorn spends per response, on the one event
loop every tenant shares. py-spy on a flood of 1,000 refused requests a second
(bench/README.md, issue 28): uvicorn built an access record for each before any filter
could drop it (a sixth of each refusal's cost), and wrote each response in two
syscalls, head then body (the write syscalls, where loopback delivery is charged too,
were a seventh).

- AccessLog writes uvicorn's access lines itself (uvicorn runs with access_log=False),
  with uvicorn's logger name, format and arguments, so AccessPaths and every reader of
  the lines are unchanged; it asks QuietRefusals before it builds a record.
- OneWriteProtocol holds a response's head until the body written right after it, so a
  whole small response goes out in one write; a head whose body is not written in the
  same turn of the loop (an SSE stream's first event may be seconds away) goes out at
  the loop's next turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tidegate.logs import QuietRefusals

ACCESS = logging.getLogger("uvicorn.access")
ACCESS_FORMAT = '%s - "%s %s HTTP/%s" %d'  # uvicorn's own


class AccessLog:
    """One access line per response, when its head is sent (as uvicorn writes them)."""

    def __init__(self, app: ASGIApp, quiet: QuietRefusals,
                 clock: Callable[[], float] = time.time) -> None:
        self.app, self.quiet, self.clock = app, quiet, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.log(scope, message["status"])
            await send(message)

        await self.app(scope, receive, logged)

    def log(self, scope: Scope, status: int) -> None:
        left_out = self.quiet.admit(status, self.clock())
        if left_out is None or not ACCESS.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        args: tuple[Any, ...] = (f"{client[0]}:{client[1]}" if client else "", scope["method"],
                                 _path(scope), scope["http_version"], status)
        if left_out:
            ACCESS.info(ACCESS_FORMAT + QuietRefusals.LEFT_OUT, *args, left_out)
        else:
            ACCESS.info(ACCESS_FORMAT, *args)


def _path(scope: Scope) -> str:
    # uvicorn's get_path_with_query_string; AccessPaths drops the query before it is written.
    path = str(scope["raw_path"].decode("latin-1"))
    if scope["query_string"]:
        path = f"{path}?{scope['query_string'].decode('ascii')}"
    return path.replace('"', "%22")


class JoinedWrites:
    """A transport whose writes of a response head wait for the next write (joined to
    it) or the loop's next turn, whichever comes first. Every other call goes through."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif isinstance(data, bytes) and data.startswith(b"HTTP/"):
            self._head = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over JoinedWrites, its access lines left to AccessLog."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = False  # uvicorn's own test is whether the logger has handlers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        joined = JoinedWrites(transport, self.loop)  # type: ignore[arg-type]
        super().connection_made(joined)  # type: ignore[arg-type]


def serve(app: ASGIApp, host: str, port: int, log_level: str, quiet: QuietRefusals) -> None:
    import uvicorn

    # log_config=None: uvicorn's loggers stay as the caller's setup_logging left them.
    config = uvicorn.Config(AccessLog(app, quiet), host=host, port=port, log_config=None,
                            log_level=log_level, access_log=False, http=OneWriteProtocol)
    # access_log=False also cut uvicorn.access off the root handler; AccessLog writes there.
    ACCESS.propagate = True
    uvicorn.Server(config).run()
