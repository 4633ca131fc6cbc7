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
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from tidegate.logs import QuietRefusals

log = logging.getLogger("tidegate.api")
ACCESS = logging.getLogger("uvicorn.access")
ACCESS_FORMAT = '%s - "%s %s HTTP/%s" %d'  # uvicorn's own
# The server's own `send`, under every middleware's: an SSE stream's frames go straight to
# it (api/deps.py EventStream), its head and its end through them all.
SERVER_SEND = "tidegate.server_send"


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

        scope[SERVER_SEND] = send
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

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.access_log = False  # uvicorn's own test is whether the logger has handlers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        joined = JoinedWrites(transport, self.loop)  # type: ignore[arg-type]
        super().connection_made(joined)  # type: ignore[arg-type]


# The admission threads (api/admission.py) run a submit's store and Redis calls; each call's
# return waits for the GIL, which a busy event loop hands over only every switch interval
# (5 ms by default). A submit makes several such calls, so under a flood of cheap refusals
# it paid up to 5 ms for each (bench/noisy_neighbour.py). At 1 ms the
# wait is a fifth, for a few more GIL handovers a second.
GIL_SWITCH_S = 0.001


def serve(app: ASGIApp, host: str, port: int, log_level: str, quiet: QuietRefusals,
          sock: socket.socket | None = None) -> None:
    """Serves `app` on host:port, or on `sock` (a socket `listening` made, handed down by
    `run_processes`)."""
    import uvicorn

    sys.setswitchinterval(GIL_SWITCH_S)
    # log_config=None: uvicorn's loggers stay as the caller's setup_logging left them.
    config = uvicorn.Config(AccessLog(app, quiet), host=host, port=port, log_config=None,
                            log_level=log_level, access_log=False, http=OneWriteProtocol)
    # access_log=False also cut uvicorn.access off the root handler; AccessLog writes there.
    ACCESS.propagate = True
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


# -- several API processes on one port (`tidegate api --workers N`) --------------------
#
# One API process is one event loop under one GIL: past its CPU it is the cap, however
# many cores the node has. N processes each listen on a socket of their own bound to the
# same port (SO_REUSEPORT), and the kernel spreads new connections over them evenly (a
# single socket shared by N processes wakes them all per connection, and the one that
# wins is not the least loaded). Everything they must agree on is already shared: rate
# limits in Redis, jobs in flight in the store; each applies the admission order
# (api/admission.py) to what it holds itself, and its SSE caps are its own (per process).

# A child that dies sooner than this after its start is not restarted: a bad setting or
# an unreachable dependency at start is not mended by starting again, and a loop of
# restarts would hide it. The supervisor stops the others and exits with its code.
START_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def listening(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on host:port (port 0: the first one's free port), each
    with SO_REUSEPORT, for one process each."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            address = sock.getsockname()  # the same port for the next (port 0 given)
            sock.listen(2048)  # uvicorn's backlog
            sock.set_inheritable(True)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def run_processes(argv_of: Callable[[int], list[str]], socks: list[socket.socket]) -> int:
    """One child process per socket (`argv_of(its fd)`), until SIGTERM, SIGINT or SIGHUP,
    which each child gets as SIGTERM (uvicorn's graceful stop); returns once all have
    exited. A child that dies on its own after START_GRACE_S is started again on its socket
    (the parent keeps every socket open, so connections to a restarting child wait in its
    queue); one that dies sooner stops them all. Each child also gets SIGTERM from the
    kernel if this process dies without passing it on (PR_SET_PDEATHSIG)."""
    children: dict[int, tuple[subprocess.Popen[bytes], socket.socket, float]] = {}
    stopping: list[int] = []  # the exit code once stopping

    def start(sock: socket.socket) -> None:
        child = subprocess.Popen(argv_of(sock.fileno()), pass_fds=[sock.fileno()],
                                 preexec_fn=_die_with_parent,  # safe: this process has no threads
                                 process_group=0)  # a terminal's Ctrl-C reaches this one only
        children[child.pid] = (child, sock, time.monotonic())

    def stop(signum: int, _frame: FrameType | None) -> None:
        if not stopping:
            stopping.append(0)
        _signal_all(children, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    for sock in socks:
        start(sock)
    while children:
        pid, status = os.wait()  # resumed after a signal's handler (PEP 475)
        if pid not in children:
            continue
        child, sock, started = children.pop(pid)
        code = child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if stopping:
            continue
        if time.monotonic() - started < START_GRACE_S:
            log.error("API process %d exited %d %.1f s after its start: stopping the others",
                      pid, code, time.monotonic() - started)
            stopping.append(code or 1)
            _signal_all(children, signal.SIGTERM)
            continue
        log.warning("API process %d exited %d: starting another in its place", pid, code)
        start(sock)
    return stopping[0] if stopping else 0


def _signal_all(children: Mapping[int, object], sig: int) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux), so that no API
    process outlives a supervisor that was SIGKILLed."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
