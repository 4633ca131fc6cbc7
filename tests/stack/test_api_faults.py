"""The API as real processes (`tidegate api`), faulted: a key revoked through one process
is refused by another, which ends the stream it had open with that key; a process
SIGKILLed and started again on its port, with the SDK's stream resuming across the gap
(no event lost, none repeated) and a submit retried with its idempotency key finding its
job; the OpenAI routes' answer to a job that failed (502) or ran out of time (504), with
`x-should-retry: false`, so that the openai client's own retries make no second job.

No worker runs: a chat worker is only advertised (tests/helpers.py), so jobs stay queued,
and the test writes what a worker (or the reconciler) would: the job's events in its
stream, its row's end. Redis databases 30 and 31, namespaces and SQLite databases of
their own; every process is stopped by the test that started it."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from tidegate_client import Client
from tidegate_client import Event as SdkEvent

from store import Store, upgrade
from store.tenants import Tenants
from tests.helpers import advertise, next_frame, own_db
from tidegate import keys
from tidegate.events import Event, Kind
from tidegate.records import JobStatus
from tidegate_tools.procs import Proc, free_port, start_api, wait_until

START_S = 240.0  # a process start on a loaded machine
ANSWER_S = 60.0  # a revocation, a stream's end, a reconnect: moments, given load's slack
JOB = {"lane": "chat", "prompt": "Where is my parcel?", "max_tokens": 8}


@dataclass
class Stack:
    """Redis and a store for API processes, one tenant and an admin key."""

    env: dict[str, str]
    redis: redis.Redis
    store: Store
    namespace: str
    admin_key: str
    tenant_key: str
    tenant_id: int
    logs: Path

    def append(self, job_id: str, seq: int, kind: Kind,
               data: dict[str, Any] | None = None) -> None:
        """An event of the job's stream, as a worker's publisher appends it."""
        event = Event(job_id=job_id, seq=seq, kind=kind,
                      text=f"t{seq}" if kind == "token" else "",
                      token_ids=[seq] if kind == "token" else [], data=data or {})
        self.redis.xadd(keys.job_events(self.namespace, job_id),
                        event.stream_fields(),  # type: ignore[arg-type]
                        id=keys.stream_id(seq))


@contextlib.contextmanager
def stack(redis_server: str, tmp_path: Path, db: int, namespace: str) -> Iterator[Stack]:
    url = f"sqlite:///{tmp_path / f'{namespace}.db'}"
    upgrade(url)
    store = Store(url)
    tenant, tenant_key = store.tenants.create_tenant("faulted", ["chat"])
    admin_key = Tenants(store).create_admin_key("ops")
    redis_url = redis_server.rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise(client, namespace, f"chat-advertised@{namespace}", "chat", "vllm")
    env = {**os.environ, "TIDEGATE_REDIS_URL": redis_url, "TIDEGATE_DATABASE_URL": url,
           "TIDEGATE_NAMESPACE": namespace}
    try:
        yield Stack(env, client, store, namespace, admin_key, tenant_key, tenant.id,
                    tmp_path / "logs")
    finally:
        client.flushdb()
        store.engine.dispose()


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def api_processes(s: Stack, ports: list[int]) -> Iterator[list[Proc]]:
    """A `tidegate api` process on each port, answering; all stopped at the end (also
    those a test started again in their place: the list is the test's to update)."""
    procs: list[Proc] = []
    try:
        for port in ports:
            procs.append(start_api(s.env, port, s.logs))
        for port, proc in zip(ports, procs, strict=True):
            wait_until(lambda port=port: answers(port), START_S,  # type: ignore[misc]
                       f"the API on port {port}", [proc])
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def status_of(port: int, path: str, key: str) -> int:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30,
                     headers={"Authorization": f"Bearer {key}"}).status_code


def submit(port: int, key: str, **extra: Any) -> str:
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/jobs", json={**JOB, **extra}, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 202, resp.text
    return str(resp.json()["job_id"])


def frames_until_end(lines: Iterator[str], deadline: float) -> list[dict[str, str]]:
    frames = []
    while (frame := next_frame(lines, deadline)) is not None:
        frames.append(frame)
    return frames


def test_a_key_revoked_through_one_api_process_is_refused_by_both_and_its_stream_ends(
        redis_server: str, tmp_path: Path) -> None:
    """docs/security.md: "A revoked key is refused by every API process at once, and the
    streams it opened end." The key is revoked through process A's admin route while
    process B holds it as valid (it answered it a moment before) and streams a job with
    it: B ends that stream with the `unauthorized` error event, and both answer 401."""
    with stack(redis_server, tmp_path, own_db(__name__, "30"), "tgfaultsrevoke") as s, \
            api_processes(s, [free_port(), free_port()]) as procs:
        a, b = (int(p.name.split(":")[1]) for p in procs)
        admin = {"Authorization": f"Bearer {s.admin_key}"}
        made = httpx.post(f"http://127.0.0.1:{a}/admin/v1/tenants", headers=admin, timeout=30,
                          json={"name": "revoked-soon", "lanes": ["chat"]})
        assert made.status_code == 201, made.text
        key, key_id = made.json()["key"]["secret"], made.json()["key"]["id"]
        job_id = submit(a, key)
        s.append(job_id, 0, "started")
        path = f"/v1/jobs/{job_id}"
        with httpx.Client(base_url=f"http://127.0.0.1:{b}", timeout=ANSWER_S) as http, \
                http.stream("GET", f"{path}/events",
                            headers={"Authorization": f"Bearer {key}"}) as stream:
            assert stream.status_code == 200, stream.read()
            lines = stream.iter_lines()
            started = next_frame(lines, time.monotonic() + ANSWER_S)
            assert started is not None and started["event"] == "started", started
            assert status_of(a, path, key) == status_of(b, path, key) == 200  # cached valid
            gone = httpx.delete(f"http://127.0.0.1:{a}/admin/v1/tenants/revoked-soon/keys/"
                                f"{key_id}", headers=admin, timeout=30)
            assert gone.status_code == 200, gone.text
            ended = frames_until_end(lines, time.monotonic() + ANSWER_S)
        assert [f["event"] for f in ended] == ["error"], ended
        assert '"code": "unauthorized"' in ended[0]["data"], ended
        assert "id" not in ended[0]  # the client's Last-Event-ID stays its last event
        wait_until(lambda: status_of(a, path, key) == status_of(b, path, key) == 401,
                   ANSWER_S, "the revoked key refused by both API processes", procs)
        assert status_of(b, path, s.tenant_key) == 404  # B still serves: another tenant's job


def read_stream(client: Client, job_id: str, got: list[SdkEvent],
                failed: list[BaseException]) -> None:
    try:
        got.extend(client.stream(job_id))
    except BaseException as exc:  # noqa: BLE001 - handed to the test's thread to raise
        failed.append(exc)


def test_an_api_process_killed_the_sdk_resumes_on_the_next_and_a_retried_submit_finds_its_job(
        redis_server: str, tmp_path: Path) -> None:
    """The API process serving an SDK's stream is SIGKILLed (no handler runs, the
    connection just breaks) and another is started on its port: the stream reconnects
    with its Last-Event-ID and hands out every event once, in order, including those
    written while no API ran. A submit retried with the same idempotency key after the
    kill answers with the job made before it: one job."""
    port = free_port()
    with stack(redis_server, tmp_path, own_db(__name__, "30"), "tgfaultskill") as s, \
            api_processes(s, [port]) as procs, \
            Client(f"http://127.0.0.1:{port}", s.tenant_key, max_reconnects=1000,
                   retries=0) as sdk:
        first = sdk.submit("chat", prompt="Where is my parcel?", max_tokens=8,
                           idempotency_key="parcel-1")
        assert first.created
        job_id = first.job_id
        s.append(job_id, 0, "started")
        for seq in (1, 2, 3):
            s.append(job_id, seq, "token")
        got: list[SdkEvent] = []
        failed: list[BaseException] = []
        reader = threading.Thread(target=read_stream, args=(sdk, job_id, got, failed),
                                  daemon=True)  # a failing test must not wait on it forever
        reader.start()
        wait_until(lambda: len(got) == 4 or bool(failed), ANSWER_S, "the first events")

        os.killpg(procs[0].popen.pid, signal.SIGKILL)
        procs[0].popen.wait(30)
        s.append(job_id, 4, "token")  # written while no API process runs
        s.append(job_id, 5, "token")
        procs.append(start_api(s.env, port, s.logs))
        wait_until(lambda: answers(port), START_S, "the API started again", procs[1:])
        s.append(job_id, 6, "token")
        s.append(job_id, 7, "done", {"finish_reason": "stop"})
        reader.join(ANSWER_S)
        assert not failed, failed
        assert not reader.is_alive(), f"the stream did not end: {[e.seq for e in got]}"
        assert [(e.seq, e.kind, e.text) for e in got] == [
            (0, "started", ""), *[(seq, "token", f"t{seq}") for seq in range(1, 7)],
            (7, "done", "")]

        again = sdk.submit("chat", prompt="Where is my parcel?", max_tokens=8,
                           idempotency_key="parcel-1")
        assert (again.job_id, again.created) == (job_id, False)
        assert [job.id for job in sdk.jobs()] == [job_id]


def fail_as_a_worker(s: Stack, end: Callable[[str], None], asked: Any) -> list[str]:
    """Ends each job made while `asked` (the openai call) runs, with `end`; the jobs."""
    ended: list[str] = []
    while True:
        done = asked.done()  # read first: a job made before it ended is seen below
        for job in s.store.jobs.jobs_of_tenant(s.tenant_id):
            if job.id not in ended:
                end(job.id)
                ended.append(job.id)
        if done:
            return ended
        time.sleep(0.05)  # a poll's pace, as a worker's queue read


def engine_failed(s: Stack) -> Callable[[str], None]:
    def end(job_id: str) -> None:  # as a worker whose engine failed the job
        assert s.store.runs.end_job(job_id, JobStatus.ERROR,
                                    error="the engine failed the request")[0]
        s.append(job_id, 0, "error", {"code": "engine_error",
                                      "message": "the engine failed the request"})
    return end


def deadline_passed(s: Stack) -> Callable[[str], None]:
    def end(job_id: str) -> None:  # as the reconciler ends a job past its deadline
        assert s.store.runs.expire_job(job_id)
        s.append(job_id, 0, "error", {"code": "deadline_exceeded",
                                      "message": "the job's deadline passed"})
    return end


@pytest.mark.parametrize(("ending", "status"), [(engine_failed, 502), (deadline_passed, 504)])
def test_an_openai_completion_whose_job_failed_is_not_retried_by_the_openai_client(
        redis_server: str, tmp_path: Path, ending: Callable[[Stack], Callable[[str], None]],
        status: int) -> None:
    """The openai client retries a 5xx unless the answer says `x-should-retry: false`:
    with max_retries=2, a job that failed (502) or ran past its deadline (504) is one
    job, not three."""
    port = free_port()
    with stack(redis_server, tmp_path, own_db(__name__, "31"), f"tgfaults{status}") as s, \
            api_processes(s, [port]), ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=s.tenant_key,
                               max_retries=2, timeout=ANSWER_S)
        asked = pool.submit(lambda: client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "Where is my parcel?"}],
            max_tokens=8))
        ended = fail_as_a_worker(s, ending(s), asked)
        with pytest.raises(openai.APIStatusError) as caught:
            asked.result()
        assert len(ended) == 1, f"the openai client retried into {len(ended)} jobs"
        assert caught.value.status_code == status
        assert caught.value.response.headers.get("x-should-retry") == "false"
