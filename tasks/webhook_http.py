"""One webhook POST, bounded every way a receiver could stretch it:

    where      the connection goes to the addresses vetted before it (tasks/webhook_urls.py
               `vet`), whatever the host's name resolves to by then: a network backend of
               httpcore's (the library under httpx) that connects to those and no others.
               Host header, TLS SNI and the certificate check stay on the URL's name.
               Through TIDEGATE_WEBHOOK_PROXY_URL it connects to the proxy instead, and
               the proxy decides where the request may go.
    how long   one deadline for the whole attempt: every socket operation waits at most
               what is left of it, and a watchdog shuts the socket at the deadline (a TLS
               handshake or headers dripped a byte at a time included).
    how much   the answer's body is read up to MAX_RESPONSE_BYTES, then the connection
               is closed; headers are bounded by h11's own limit.
    what       an `Outcome` class, never an address or an exception's text: those go
               to the tenant (GET /v1/jobs/{id}/deliveries).

No redirect is followed (httpcore follows none).
"""

from __future__ import annotations

import contextlib
import functools
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from store.webhooks import Outcome
from tasks.webhook_urls import CallbackUrl

MAX_RESPONSE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Answer:
    outcome: Outcome
    status_code: int | None = None  # the receiver's HTTP status, when one came back


def post(url: CallbackUrl, addresses: list[str] | None, body: bytes,
         headers: dict[str, str], deadline: float, proxy: str = "") -> Answer:
    """POST `body` to `url` on one of `addresses` (None: through `proxy`), done by
    `deadline` (a time.monotonic())."""
    backend = PinnedBackend(addresses, deadline)
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), backend.abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        with _pool(backend, proxy) as pool:
            return _exchange(pool, url, body, headers, deadline)
    except httpcore.TimeoutException:
        return Answer(Outcome.TIMEOUT)
    except (httpcore.ConnectError, httpcore.ProxyError):
        return Answer(_late(deadline) or Outcome.CONNECT_FAILED)
    except (httpcore.NetworkError, httpcore.ProtocolError):
        return Answer(_late(deadline) or Outcome.BAD_RESPONSE)
    finally:
        watchdog.cancel()
        backend.close()


def _late(deadline: float) -> Outcome | None:
    """A socket the watchdog shut reads as a broken connection: it was the deadline."""
    return Outcome.TIMEOUT if time.monotonic() >= deadline else None


def _exchange(pool: httpcore.ConnectionPool, url: CallbackUrl, body: bytes,
              headers: dict[str, str], deadline: float) -> Answer:
    target = httpcore.URL(scheme=url.scheme, host=url.host, port=url.port, target=url.target)
    left = max(0.001, deadline - time.monotonic())
    sent = [("host", url.host_header), *headers.items()]
    with pool.stream("POST", target, headers=sent, content=body, extensions={
            "timeout": {"connect": left, "read": left, "write": left, "pool": left}}) as resp:
        received = 0
        for chunk in resp.iter_stream():
            received += len(chunk)
            if received > MAX_RESPONSE_BYTES:  # leaving the block closes the connection
                return Answer(Outcome.RESPONSE_TOO_LARGE, resp.status)
        return Answer(status_class(resp.status), resp.status)


def status_class(code: int) -> Outcome:
    return {2: Outcome.SUCCESS, 3: Outcome.REDIRECT, 4: Outcome.CLIENT_ERROR,
            5: Outcome.SERVER_ERROR}.get(code // 100, Outcome.BAD_RESPONSE)


def _pool(backend: PinnedBackend, proxy: str) -> httpcore.ConnectionPool:
    if not proxy:
        return httpcore.ConnectionPool(ssl_context=_ssl_context(), network_backend=backend,
                                       max_connections=1, retries=0)
    via = httpx.Proxy(proxy)  # httpx's reading of a proxy URL (and its credentials)
    return httpcore.HTTPProxy(
        proxy_url=httpcore.URL(scheme=via.url.raw_scheme, host=via.url.raw_host,
                               port=via.url.port, target=b"/"),
        proxy_auth=via.raw_auth, ssl_context=_ssl_context(), network_backend=backend,
        max_connections=1, retries=0)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default context (certifi's CAs), built once: loading them costs ~10 ms."""
    return httpx.create_ssl_context()


def _left(timeout: float | None, deadline: float, late: type[Exception]) -> float:
    """What a socket operation may wait: its own timeout, at most what is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the attempt's deadline passed")
    return left if timeout is None else min(timeout, left)


class PinnedBackend(httpcore.NetworkBackend):
    """httpcore's own sync backend, connecting only to `addresses` (None: to the host it is
    asked for, i.e. the proxy), every operation within `deadline`. `abort` shuts every
    socket it opened: the watchdog's way to end an operation already waiting."""

    def __init__(self, addresses: list[str] | None, deadline: float) -> None:
        self.inner = httpcore.SyncBackend()
        self.addresses, self.deadline = addresses, deadline
        self._guards: list[socket.socket] = []
        self._lock = threading.Lock()
        self._aborted = False

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        failed: Exception = httpcore.ConnectError("no address to connect to")
        for target in self.addresses if self.addresses is not None else [host]:
            try:
                stream = self.inner.connect_tcp(
                    target, port, _left(timeout, self.deadline, httpcore.ConnectTimeout),
                    local_address, socket_options)
            except httpcore.ConnectError as exc:  # the next vetted address, if any
                failed = exc
                continue
            self._guard(stream)
            return DeadlineStream(stream, self.deadline)
        raise failed

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("webhooks connect over TCP only")

    def _guard(self, stream: httpcore.NetworkStream) -> None:
        # A second descriptor of the same socket: shutting it down ends a read or a
        # handshake waiting on the first, even once TLS has wrapped that one.
        guard = stream.get_extra_info("socket").dup()
        with self._lock:
            self._guards.append(guard)
            aborted = self._aborted
        if aborted:
            self.abort()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            guards = list(self._guards)
        for guard in guards:
            with contextlib.suppress(OSError):  # closed by its peer already
                guard.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            guards, self._guards = self._guards, []
        for guard in guards:
            guard.close()


class DeadlineStream(httpcore.NetworkStream):
    """A stream whose every read, write and TLS handshake waits at most until the
    deadline: a receiver dripping a byte a second cannot stretch an attempt."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self.inner, self.deadline = inner, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, _left(timeout, self.deadline, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, _left(timeout, self.deadline, httpcore.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        left = _left(timeout, self.deadline, httpcore.ConnectTimeout)
        return DeadlineStream(self.inner.start_tls(ssl_context, server_hostname, left),
                              self.deadline)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)
