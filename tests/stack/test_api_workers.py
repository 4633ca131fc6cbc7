"""`tidegate api --workers 2`: two API processes on one port, as a real command. Jobs
submitted over many connections are served by both processes (each holds some of the
connections the jobs came on) into the one store; stopping the parent (SIGTERM) stops
both, and a parent killed outright (SIGKILL, no word to pass on) takes them with it.
A job's SSE stream, from the start and resumed, whichever process serves it, carries its
events as the worker wrote them, each once and in order (the frames go out past the
middlewares: api/deps.py EventStream).

Its own SQLite database, its own Redis database, namespace and port; a chat worker only
advertised (tests/helpers.py), so the jobs stay queued."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from api.server import listening
from store import Store, upgrade
from tests.helpers import advertise, next_frame, own_db
from tidegate import keys
from tidegate.events import Event
from tidegate_tools.procs import Proc, free_port, tidegate_argv, wait_until

DB = own_db(__name__, "22")
NAMESPACE = "tgapiworkers"
CONNECTIONS = 16  # kernel-spread over 2 sockets: all on one of them, 1 in 32768
START_S = 120.0
STOP_S = 30.0
JOB = {"lane": "chat", "prompt": "Where is my parcel?", "max_tokens": 4}


class Api:
    def __init__(self, proc: Proc, port: int, store: Store, key: str) -> None:
        self.proc, self.port, self.store, self.key = proc, port, store, key
        self.seen: dict[int, psutil.Process] = {}  # every child seen, for the cleanup

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def children(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.popen.pid).children()
        except psutil.NoSuchProcess:
            return []
        self.seen.update((p.pid, p) for p in found)
        return found

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@contextlib.contextmanager
def api_workers(redis_server: str, tmp_path: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_path / 'api-workers.db'}"
    upgrade(url)
    store = Store(url)
    _, key = store.tenants.create_tenant("two-processes", ["chat"])
    redis_url = redis_server.rsplit("/", 1)[0] + f"/{DB}"
    client = redis.Redis.from_url(redis_url)
    advertise(client, NAMESPACE, "chat-advertised@api-workers", "chat", "vllm")
    env = {**os.environ, "TIDEGATE_REDIS_URL": redis_url, "TIDEGATE_DATABASE_URL": url,
           "TIDEGATE_NAMESPACE": NAMESPACE}
    port = free_port()
    argv = tidegate_argv("api", "--host", "127.0.0.1", "--port", str(port), "--workers", "2")
    api = Api(Proc("api-workers", argv, tmp_path / "api-workers.log", env), port, store, key)
    try:
        wait_until(lambda: len(api.children()) == 2 and api.answers(), START_S,
                   "two API processes answering", [api.proc])
        yield api
    finally:
        api.proc.stop()
        for child in api.seen.values():  # in a process group of their own: not in stop()'s
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        client.flushdb()
        store.engine.dispose()


def append(api: Api, client: redis.Redis, job_id: str, seq: int, kind: Any) -> Event:
    """An event as a worker's publisher appends it."""
    event = Event(job_id=job_id, seq=seq, kind=kind, text=f"t{seq}" if kind == "token" else "",
                  token_ids=[seq] if kind == "token" else [])
    client.xadd(keys.job_events(NAMESPACE, job_id), event.stream_fields(),  # type: ignore[arg-type]
                id=keys.stream_id(seq))
    return event


def sse(api: Api, job_id: str, last_event_id: int | None = None) -> list[tuple[str, str, str]]:
    """(id, event, data) of each frame of the job's stream, read to its end."""
    headers = {"Authorization": f"Bearer {api.key}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    frames = []
    with httpx.Client(base_url=api.base_url, timeout=STOP_S) as http, http.stream(
            "GET", f"/v1/jobs/{job_id}/events", headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        while (frame := next_frame(lines, math.inf)) is not None:
            frames.append((frame.get("id", ""), frame["event"], frame["data"]))
    return frames


def connections_of(process: psutil.Process, port: int) -> int:
    return sum(1 for c in process.net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_two_api_processes_share_the_port_and_the_store_and_stop_with_their_parent(
        redis_server: str, tmp_path: Path) -> None:
    with api_workers(redis_server, tmp_path) as api:
        children = api.children()
        assert len({c.pid for c in children}) == 2
        clients = [httpx.Client(base_url=api.base_url, timeout=30,
                                headers={"Authorization": f"Bearer {api.key}"})
                   for _ in range(CONNECTIONS)]
        try:
            answers = [c.post("/v1/jobs", json=JOB) for c in clients]  # kept alive: open
            assert [a.status_code for a in answers] == [202] * CONNECTIONS, answers[0].text
            served = {c.pid: connections_of(c, api.port) for c in children}
            assert all(served.values()), f"connections held by each process: {served}"
            assert sum(served.values()) == CONNECTIONS
        finally:
            for c in clients:
                c.close()
        ids = {a.json()["job_id"] for a in answers}
        assert {api.store.jobs.get_job(i).status.value for i in ids} == {"queued"}  # type: ignore[union-attr]

        api.proc.popen.send_signal(signal.SIGTERM)  # the parent alone, not its group
        api.proc.popen.wait(STOP_S)
        gone, alive = psutil.wait_procs(children, timeout=STOP_S)
        assert not alive, f"API processes left running after their parent stopped: {alive}"


def test_api_processes_end_when_their_parent_is_killed(redis_server: str,
                                                       tmp_path: Path) -> None:
    with api_workers(redis_server, tmp_path) as api:
        children = api.children()
        api.proc.popen.send_signal(signal.SIGKILL)  # no handler runs: the kernel tells them
        api.proc.popen.wait(STOP_S)
        gone, alive = psutil.wait_procs(children, timeout=STOP_S)
        assert not alive, f"API processes outlived their killed parent: {alive}"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{api.base_url}/healthz", timeout=5)


def test_a_stream_from_either_process_carries_the_events_once_in_order_and_resumes(
        redis_server: str, tmp_path: Path) -> None:
    with api_workers(redis_server, tmp_path) as api:
        client = redis.Redis.from_url(redis_server.rsplit("/", 1)[0] + f"/{DB}")
        with httpx.Client(base_url=api.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {api.key}"}) as http:
            job_id = http.post("/v1/jobs", json=JOB).json()["job_id"]
        events = [append(api, client, job_id, 0, "started")]
        events += [append(api, client, job_id, seq, "token") for seq in range(1, 6)]
        events.append(append(api, client, job_id, 6, "done"))
        want = [(str(e.seq), e.kind, e.to_json()) for e in events]
        assert sse(api, job_id) == want  # the worker's JSON, byte for byte, in order
        assert sse(api, job_id, last_event_id=3) == want[4:]


def test_listening_sockets_share_one_port_and_each_takes_connections() -> None:
    """`tidegate api --workers N`'s sockets: port 0 picks one free port for all of them,
    and the kernel hands new connections to each (SO_REUSEPORT)."""
    socks = listening("127.0.0.1", 0, 2)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(ports) == 1
        port = ports.pop()
        for s in socks:
            s.settimeout(0)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        accepted = [0, 0]
        for i, s in enumerate(socks):
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted[i] += 1
        for c in clients:
            c.close()
        assert sum(accepted) == 32 and all(accepted), accepted  # all on one: 1 in 2**31
    finally:
        for s in socks:
            s.close()
