"""The token streams on a Redis of their own (`TIDEGATE_STREAMS_URL`), apart from the
broker, and what a consumer sees when the path to its tokens breaks mid-stream:

- the streams' Redis dies: the SSE stream ends with an `unavailable` error frame (not a
  hang, not a 500), submits still get their 202 (the broker is elsewhere), the job goes on
  in its worker, which writes its stream back once that Redis is back (empty): the
  consumer's reconnect with Last-Event-ID gets exactly the rest, and a consumer from the
  start gets every event;
- the API goes silent (SIGSTOPped) past the SDK's read timeout: the SDK gives the
  connection up, reconnects once the API answers again, and resumes after its last event.

The module starts its own stack: a private redis-server for the broker, another for the
streams, the API and ONE vLLM worker of the chat lane. Cost: one vLLM worker start, then
about 30 s.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tidegate_client import Client

from store import Store, upgrade
from tests.helpers import next_frame
from tests.stack.test_sentinel import LANE, PROMPT
from tidegate.records import JobStatus
from tidegate_tools.procs import Proc, free_port, start_redis, wait_until
from tidegate_tools.stack import RunningStack, WorkerSpec, api_ready, running_stack

WORKER = "chat-apart@tidegate"
MAX_TOKENS = 256  # the chat lane's most: seconds of generation for the faults to land in
READ_TIMEOUT_S = 2.0  # the SDK's silence limit here (45 s by default)
pytestmark = pytest.mark.timeout(600)


@dataclass
class ApartStack:
    running: RunningStack
    store: Store
    key: str
    streams_port: int
    logs: Path
    streams: list[Proc]  # the streams' redis-server: the one running is the last

    @property
    def procs(self) -> list[Proc]:
        return [*self.running.procs, self.streams[-1]]

    def api(self) -> Proc:
        return next(p for p in self.running.procs if p.name.startswith("api:"))

    def kill_streams(self) -> None:
        os.killpg(self.streams[-1].popen.pid, signal.SIGKILL)
        self.streams[-1].stop()

    def restart_streams(self) -> None:
        """On its port again, empty (no persistence): every stream is gone."""
        self.streams.append(start_redis(self.streams_port, self.logs))


@pytest.fixture(scope="module")
def apart(model_path: Path, tmp_root: Path) -> Iterator[ApartStack]:
    logs = tmp_root / "logs" / "streams-apart"
    logs.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{tmp_root / 'streams-apart.db'}"
    upgrade(db)
    store = Store(db)
    _, key = store.tenants.create_tenant("apart-tenant", [LANE])
    port = free_port()
    streams = [start_redis(port, logs)]
    env = {**os.environ, "TIDEGATE_STREAMS_URL": f"redis://127.0.0.1:{port}/0",
           "TIDEGATE_DATABASE_URL": db, "TIDEGATE_NAMESPACE": "tgapart"}
    try:
        with running_stack(env, [WorkerSpec(LANE, WORKER, cpus="1")], logs,
                           private_redis=True) as running:
            yield ApartStack(running, store, key, port, logs, streams)
    finally:
        for proc in streams:
            proc.stop()


def submit(stack: ApartStack) -> str:
    with Client(stack.running.base_url, stack.key) as client:
        return str(client.submit(LANE, prompt=PROMPT, max_tokens=MAX_TOKENS)["job_id"])


def frames(stack: ApartStack, job_id: str, last_id: int = -1) -> Iterator[dict[str, str]]:
    """The job's raw SSE frames, from after `last_id`."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    if last_id >= 0:
        headers["Last-Event-ID"] = str(last_id)
    url = f"{stack.running.base_url}/v1/jobs/{job_id}/events"
    deadline = time.monotonic() + 120
    with httpx.stream("GET", url, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        while (frame := next_frame(lines, deadline)) is not None:
            yield frame


def test_the_streams_redis_dying_ends_the_stream_unavailable_and_the_resume_gets_the_rest(
        apart: ApartStack) -> None:
    job_id = submit(apart)
    seen: list[dict[str, str]] = []
    for frame in frames(apart, job_id):
        seen.append(frame)
        if frame.get("event") == "token" and len(seen) == 3:
            apart.kill_streams()
        if frame.get("event") == "error":
            break
    *before, end = seen
    assert end["event"] == "error", f"the stream ended {end}"
    assert json.loads(end["data"])["code"] == "unavailable"
    assert [int(f["id"]) for f in before] == list(range(len(before)))
    # The broker is elsewhere: a submit is still accepted while the streams' Redis is down.
    with httpx.Client(base_url=apart.running.base_url, timeout=30) as http:
        resp = http.post("/v1/jobs", json={"lane": LANE, "prompt": PROMPT, "max_tokens": 8},
                         headers={"Authorization": f"Bearer {apart.key}"})
    assert resp.status_code == 202, resp.text
    apart.restart_streams()
    last = int(before[-1]["id"])
    rest = list(frames(apart, job_id, last))
    assert [int(f["id"]) for f in rest] == list(range(last + 1, last + 1 + len(rest))), \
        "events missing or repeated after the resume"
    assert rest[-1]["event"] == "done", f"the job ended {rest[-1]}"
    job = apart.store.jobs.get_job(job_id)
    assert job is not None and job.status == JobStatus.DONE
    text = "".join(json.loads(f["data"])["text"] for f in [*before, *rest]
                   if f.get("event") == "token")
    assert text == job.output_text
    # The worker wrote back the events the restart lost: a consumer from the start gets all.
    again = list(frames(apart, job_id))
    assert [f["id"] for f in again] == [f["id"] for f in [*before, *rest]]
    assert [f["data"] for f in again] == [f["data"] for f in [*before, *rest]]
    during = resp.json()["job_id"]
    wait_until(lambda: getattr(apart.store.jobs.get_job(during), "status", None) == JobStatus.DONE,
               120, "the job submitted during the outage to end", apart.procs)


def test_the_sdk_gives_a_silent_api_up_and_resumes_after_its_last_event(
        apart: ApartStack) -> None:
    """The API process is stopped (SIGSTOP: its sockets stay open, nothing is sent, not
    even keep-alives) for three read timeouts of the SDK, then let go on."""
    job_id = submit(apart)
    events = []
    failure: list[BaseException] = []
    first_tokens = threading.Event()

    def read() -> None:
        try:
            with Client(apart.running.base_url, apart.key,
                        read_timeout_s=READ_TIMEOUT_S) as client:
                for event in client.stream(job_id):
                    events.append(event)
                    if len(events) >= 3:
                        first_tokens.set()
        except BaseException as exc:  # reported by the test, not lost in a thread
            failure.append(exc)
        finally:
            first_tokens.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first_tokens.wait(120) and not failure, failure
    api = apart.api()
    os.kill(api.popen.pid, signal.SIGSTOP)
    try:
        time.sleep(3 * READ_TIMEOUT_S)  # the fault's length, not a wait for an outcome
        assert reader.is_alive(), f"the SDK gave up for good: {failure}"
    finally:
        os.kill(api.popen.pid, signal.SIGCONT)
    reader.join(180)
    assert not reader.is_alive() and not failure, failure
    assert all(proc.alive() for proc in apart.procs), "a process died of the silence"
    # It gave the silent connection up and opened another: the API saw the stream asked
    # for again (a client that waited on would have read the same connection on).
    asked = f"GET /v1/jobs/{job_id}/events"
    wait_until(lambda: api.log_path.read_text().count(asked) >= 2, 30,
               "the API's access line of the SDK's reconnect", apart.procs)
    assert [e.seq for e in events] == list(range(len(events))), "events missing or repeated"
    assert events[-1].kind == "done"
    job = apart.store.jobs.get_job(job_id)
    assert job is not None and job.status == JobStatus.DONE
    assert "".join(e.text for e in events if e.kind == "token") == job.output_text


def test_the_broker_redis_down_refuses_submits_503_while_the_running_job_goes_on(
        apart: ApartStack) -> None:
    """The broker's redis-server SIGKILLed at a job's first token: a submit gets a 503
    with Retry-After (nothing half-accepted), the running job's tokens keep coming (its
    worker needs the broker for no token) and it ends done, every event once, all with the
    broker down; with the broker back (empty: no persistence) the worker takes new jobs."""
    broker = next(p for p in apart.running.procs if p.name.startswith("redis-server:"))
    port = int(broker.name.split(":")[1])
    job_id = submit(apart)
    seen: list[dict[str, str]] = []
    refused: httpx.Response | None = None
    during = 0  # token frames that arrived with the broker down
    for frame in frames(apart, job_id):
        seen.append(frame)
        if frame.get("event") != "token":
            continue
        if refused is None:  # the first token: the job runs, the broker goes
            os.killpg(broker.popen.pid, signal.SIGKILL)
            broker.stop()
            apart.running.procs.remove(broker)
            refused = post_job(apart)
        else:
            during += 1
    apart.running.procs.insert(0, start_redis(port, apart.logs))  # back, empty; stops last
    assert refused is not None and refused.status_code == 503, refused and refused.text
    assert int(refused.headers["Retry-After"]) > 0
    assert refused.json()["error"]["type"] == "unavailable", refused.text
    assert "queue is unavailable" in refused.json()["error"]["message"]
    assert during >= 1, "the job's tokens stopped with the broker"
    assert [int(f["id"]) for f in seen] == list(range(len(seen))), "events missing or repeated"
    assert seen[-1]["event"] == "done", f"the job ended {seen[-1]}"
    job = apart.store.jobs.get_job(job_id)
    assert job is not None and job.status == JobStatus.DONE
    text = "".join(json.loads(f["data"])["text"] for f in seen if f.get("event") == "token")
    assert text == job.output_text
    assert all(proc.alive() for proc in apart.procs), "a process died with the broker"
    # The broker back: once the worker's heartbeat is there again, a job goes through.
    wait_until(lambda: api_ready(apart.running.base_url, [WORKER]), 120,
               "the API to be ready with the worker's heartbeat back", apart.procs)
    after = post_job(apart)
    assert after.status_code == 202, after.text
    wait_until(lambda: getattr(apart.store.jobs.get_job(after.json()["job_id"]), "status", None)
               == JobStatus.DONE, 120, "a job submitted after the outage to end", apart.procs)


def post_job(stack: ApartStack) -> httpx.Response:
    with httpx.Client(base_url=stack.running.base_url, timeout=30) as http:
        return http.post("/v1/jobs", json={"lane": LANE, "prompt": PROMPT, "max_tokens": 8},
                         headers={"Authorization": f"Bearer {stack.key}"})
