"""The SDK against the real stack: submit, stream, and resume after the connection drops
in the middle of a stream, without losing or repeating a token."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC
from typing import Any

import httpx
import pytest
from tidegate_client import AsyncClient, Client, Event, TidegateError

from tests.helpers import Stack

PROMPT = "The invoice total is"


class DroppingProxy:
    """A TCP proxy that cuts each of the first `drops` connections after passing
    `cut_bytes` of the server's answer: a consumer's connection dropping mid-stream."""

    def __init__(self, upstream_port: int, cut_bytes: int, drops: int) -> None:
        self.upstream_port, self.cut_bytes, self.drops = upstream_port, cut_bytes, drops
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.cut_at: list[float] = []  # time.time() of each cut
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            cut = self.cut_bytes if self.connections <= self.drops else None
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, cut), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, cut: int | None) -> None:
        passed = 0
        try:
            while chunk := src.recv(4096):
                if cut is not None and passed + len(chunk) >= cut:
                    dst.sendall(chunk[: cut - passed])
                    self.cut_at.append(time.time())
                    break
                dst.sendall(chunk)
                passed += len(chunk)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def finished_job(stack: Stack) -> Iterator[tuple[str, list[Event]]]:
    with Client(stack.base_url, stack.api_key) as client:
        job_id = client.submit("chat", prompt=PROMPT, max_tokens=40)["job_id"]
        yield job_id, list(client.stream(job_id))


def _port(stack: Stack) -> int:
    return int(stack.base_url.rsplit(":", 1)[1])


def read_through_dropping_proxy(stack: Stack, job_id: str) -> tuple[DroppingProxy, list]:
    """The job's events as the sync SDK reads them through a proxy that cuts the
    connection three times, 900 bytes in."""
    proxy = DroppingProxy(_port(stack), cut_bytes=900, drops=3)
    try:
        with Client(f"http://127.0.0.1:{proxy.port}", stack.api_key) as client:
            return proxy, list(client.stream(job_id))
    finally:
        proxy.close()


def test_sync_stream_resumes_after_dropped_connections(stack: Stack, finished_job) -> None:  # type: ignore[no-untyped-def]
    job_id, expected = finished_job
    proxy, got = read_through_dropping_proxy(stack, job_id)
    assert proxy.connections >= 4  # three cut connections, then one that finished
    assert got == expected


def test_async_stream_resumes_after_dropped_connections(stack: Stack, finished_job) -> None:  # type: ignore[no-untyped-def]
    job_id, expected = finished_job
    proxy = DroppingProxy(_port(stack), cut_bytes=700, drops=2)

    async def consume() -> list[Event]:
        client = AsyncClient(f"http://127.0.0.1:{proxy.port}", stack.api_key)
        try:
            return [event async for event in client.stream(job_id)]
        finally:
            await client.aclose()

    try:
        got = asyncio.run(consume())
    finally:
        proxy.close()
    assert proxy.connections >= 3
    assert got == expected


def test_async_submit_and_stream_live(stack: Stack) -> None:
    async def run() -> tuple[dict, list[Event]]:
        client = AsyncClient(stack.base_url, stack.api_key)
        try:
            job = await client.submit("finance", prompt=PROMPT, max_tokens=16, seed=3)
            return job, [event async for event in client.stream(job["job_id"])]
        finally:
            await client.aclose()

    job, events = asyncio.run(run())
    assert job["lane"] == "finance" and job["events_url"].endswith("/events")
    assert [e.kind for e in events][0] == "started" and events[-1].kind == "done"
    assert sum(len(e.token_ids) for e in events) == 16


def test_sdk_raises_with_the_field_at_fault(stack: Stack) -> None:
    with Client(stack.base_url, stack.api_key) as client, pytest.raises(TidegateError) as err:
        client.submit("chat", prompt=PROMPT, max_tokens=0)
    assert err.value.status == 422 and err.value.field == "max_tokens"


# -- resuming while the job still generates -----------------------------------------------

# The chat lane's longest output: about a second of generation, and the lane yields the
# CPU (cpu_nice), so this process reads the stream while the job generates. (A finance
# job at full speed on two cores left the reader nothing until its last tokens.)
LIVE_TOKENS = 256


def submit_live(stack: Stack) -> str:
    with Client(stack.base_url, stack.api_key) as client:
        return str(client.submit("chat", prompt=PROMPT, max_tokens=LIVE_TOKENS)["job_id"])


def final_stream(stack: Stack, job_id: str) -> list[Event]:
    """The whole stream in one connection, read once the job ended."""
    with Client(stack.base_url, stack.api_key) as client:
        events = list(client.stream(job_id))
    assert events[-1].kind == "done"
    assert sum(len(e.token_ids) for e in events) == LIVE_TOKENS
    return events


def finished_at(stack: Stack, job_id: str) -> float:
    job = stack.store.jobs.get_job(job_id)
    assert job is not None and job.finished_at is not None
    at = job.finished_at
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def test_sync_stream_resumes_while_the_job_is_generating(stack: Stack) -> None:
    job_id = submit_live(stack)
    proxy, got = read_through_dropping_proxy(stack, job_id)
    assert len(proxy.cut_at) == 3
    # The first cut came mid-generation (the later ones may find the job done: the client
    # waits a little before it reconnects).
    assert min(proxy.cut_at) < finished_at(stack, job_id)
    assert got == final_stream(stack, job_id)


def sse(http: httpx.Client, job_id: str, stop_after: int | None = None,
        **request: Any) -> list[Event]:
    """The job's events over one connection: to the terminal one, or the first
    `stop_after`, then the connection is closed mid-stream."""
    events: list[Event] = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events", **request) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(Event.model_validate_json(line[5:].strip()))
                if len(events) == stop_after:
                    break
    return events


@pytest.mark.parametrize("by", ["header", "query"])
def test_a_stream_dropped_mid_generation_resumes_after_last_event_id(stack: Stack,
                                                                     by: str) -> None:
    job_id = submit_live(stack)
    with stack.http() as http:
        first = sse(http, job_id, stop_after=5)
        status = http.get(f"/v1/jobs/{job_id}").json()["status"]
        last = str(first[-1].seq)
        resume = {"headers": {"Last-Event-ID": last}} if by == "header" else {
            "params": {"last_event_id": last}}
        rest = sse(http, job_id, **resume)
    assert status == "running"  # the connection dropped while the job generated
    assert first + rest == final_stream(stack, job_id)
