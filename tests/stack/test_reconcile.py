"""The store is the truth; the reconciler makes Redis agree (scheduler/reconcile.py).

On the session stack (API, chat and finance workers), with a real scheduler process
(`tidegate scheduler`) started for the module: its beat runs the reconciler every 0.5 s
with a grace of 1 s; its tick (autoscale, health) is set an hour apart so it never steers
the session's workers.

What the tests break, and how:
- Redis restarted empty: the session's redis-server is SIGKILLed and started again on its
  port with no data, while jobs wait queued (both workers SIGSTOPped meanwhile, their
  heartbeats kept alive so the API still routes to them). It waits for both workers to
  serve again before it ends, for the modules after it.
- Redis down while a job runs (the default deployment: broker and streams on that one
  Redis): the session's redis-server SIGKILLed while the chat worker holds a job
  mid-generation, a submit meanwhile, then Redis started again empty.
- A dead worker that took a job (findings 6 and 7b): a third chat worker of the test's own
  (`doomed`), held mid-job (workers/faults.py TokenHold) and SIGKILLed with its process
  group, engine included: its heartbeat and lease lapse, its message stays taken
  (kombu's unacked entry) until a live worker's sweep hands it back.
- A dead worker's direct queue with a message waiting: the state a SIGKILLed worker leaves
  in Redis, made by the test (a worker name with no heartbeat, `a_ghost`). The jobs are
  written as the API's submit writes them (row and payload, then the message).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
import redis
from kombu.exceptions import OperationalError
from tidegate_client import Client

from tasks.app import celery_app, make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.conftest import REDIS_PORT
from tests.helpers import Stack, engine_stats, hold, job_spans, reconciling_scheduler
from tests.otlp import OtlpReceiver
from tidegate import keys
from tidegate.events import Event
from tidegate.fleet import read_heartbeat
from tidegate.lanes import redis_priority
from tidegate.records import WorkerState
from tidegate.settings import get_settings
from tidegate_tools.procs import Proc, start_redis, start_worker, wait_until
from tidegate_tools.stack import api_ready

pytestmark = pytest.mark.timeout(300)
PROMPT = "Where is my parcel?"
MAX_TOKENS = 8
PRIORITY = 4  # public scale
GRACE_S = 1.0


class Reader(threading.Thread):
    """A job's SSE consumer, through the SDK (which resumes after a dropped connection)."""

    def __init__(self, stack: Stack, job_id: str) -> None:
        super().__init__(daemon=True)
        self.stack, self.job_id = stack, job_id
        self.events: list[Event] = []
        self.start()

    def run(self) -> None:
        with Client(self.stack.base_url, self.stack.api_key) as client:
            for event in client.stream(self.job_id):
                self.events.append(event)

    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].terminal


def check_stream(reader: Reader, end: str) -> None:
    """Contiguous sequence numbers from 0 and one terminal event, the last."""
    events = reader.events
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].kind == end and not any(e.terminal for e in events[:-1])


def accept(stack: Stack, lane: str, queue: str, *, session_id: str | None = None,
           deadline_at: float | None = None, send: bool = True) -> GeneratePayload:
    """A job as api/submit.py accepts it: the row with its payload, then (send) its
    message to `queue`."""
    job_id = str(uuid.uuid4())
    payload = GeneratePayload(
        job_id=job_id, lane=lane, prompt=PROMPT, prompt_tokens=6,
        sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0.0), session_id=session_id,
        deadline_at=time.time() + 60 if deadline_at is None else deadline_at)
    stack.store.jobs.create_job(job_id, stack.tenant_id, lane, queue, PRIORITY, session_id,
                                asdict(payload.sampling), payload.prompt_tokens,
                                route_reason="test", payload=payload.to_dict())
    if send:
        send_generate(celery_app(), payload, queue, redis_priority(PRIORITY))
    return payload


def direct(stack: Stack, worker: str) -> str:
    return keys.direct_queue(stack.namespace, worker)


def waiting(stack: Stack, queue: str) -> int:
    return sum(int(stack.redis.llen(sub)) for sub in keys.queue_sublists(queue))


def status(stack: Stack, job_id: str) -> str | None:
    job = stack.store.jobs.get_job(job_id)
    return job.status if job else None


def a_ghost(stack: Stack) -> str:
    """A worker name with no heartbeat: what a SIGKILLed worker's name is soon after."""
    name = f"ghost-{uuid.uuid4().hex[:8]}@tidegate"
    assert read_heartbeat(stack.redis, stack.namespace, name) is None
    return name


@pytest.fixture(scope="module")
def scheduler(stack: Stack, tmp_root: Path) -> Iterator[Proc]:
    with reconciling_scheduler(stack, tmp_root / "logs" / "scheduler.log",
                               TIDEGATE_RECONCILE_GRACE_S=str(GRACE_S)) as proc:
        yield proc


@contextlib.contextmanager
def doomed_worker(stack: Stack, tmp_root: Path) -> Iterator[tuple[str, Proc]]:
    """A chat worker of the test's own, for it to kill: (its name, its process), once it
    is active. Stopped on the way out, killed or not."""
    name = f"doomed-{uuid.uuid4().hex[:6]}@tidegate"
    proc = start_worker(dict(os.environ), "chat", name, tmp_root / "logs", cpus="0")
    try:
        wait_until(lambda: _active(stack, name), 300, f"worker {name} to be active", [proc],
                   poll_s=0.5)
        yield name, proc
    finally:
        proc.stop()


def _active(stack: Stack, name: str) -> bool:
    hb = read_heartbeat(stack.redis, stack.namespace, name)
    return hb is not None and hb.state == WorkerState.ACTIVE


def held_mid_job(stack: Stack, doomed: str, proc: Proc,
                 session_id: str | None = None) -> tuple[GeneratePayload, Reader]:
    """A job sent to the doomed worker's direct queue (as a session's is), held there after
    its first tokens, its engine request running on: (its payload, its consumer)."""
    hold([doomed], 1)
    payload = accept(stack, "chat", direct(stack, doomed), session_id=session_id)
    reader = Reader(stack, payload.job_id)
    wait_until(lambda: engine_stats(doomed)["held"] == payload.job_id, 120,
               f"{doomed} to hold job {payload.job_id}", [proc], poll_s=0.1)
    assert status(stack, payload.job_id) == "running"
    return payload, reader


@pytest.mark.timeout(900)  # a vLLM worker of its own starts first
def test_a_dead_workers_taken_session_job_goes_back_to_the_pool(stack: Stack,
                                                                tmp_root: Path) -> None:
    """Finding 6, the worker side (tasks/recovery.py): a message a dead worker took from
    its direct queue is handed back to a live worker's queue, not to the dead one's. No
    scheduler runs yet: the workers' own recovery sweep does it, and the job resumes after
    the tokens the dead worker streamed."""
    session = f"s-{uuid.uuid4().hex[:8]}"
    with doomed_worker(stack, tmp_root) as (doomed, proc):
        payload, reader = held_mid_job(stack, doomed, proc, session_id=session)
        record = stack.store.sessions.get_session(session, stack.tenant_id)
        assert record is not None and record.last_worker == doomed  # it held the prefix
        os.killpg(proc.popen.pid, signal.SIGKILL)  # worker and engine, mid-job
        wait_until(reader.ended, 120, "the dead worker's session job to end",
                   worker_procs(stack))
    check_stream(reader, "done")
    row = stack.store.jobs.get_job(payload.job_id)
    assert row is not None and row.status == "done" and row.attempts == 2
    assert row.worker == stack.workers["chat"]
    assert [e.data["worker"] for e in reader.events if e.kind == "started"] == [doomed]
    assert waiting(stack, direct(stack, doomed)) == 0
    assert stack.store.jobs.job_payload(payload.job_id) is None  # the prompt is not kept
    record = stack.store.sessions.get_session(session, stack.tenant_id)
    assert record is not None and record.last_worker == stack.workers["chat"]


def test_a_session_job_stranded_on_a_dead_workers_queue_ends_done_on_another(
        stack: Stack, scheduler: Proc) -> None:
    """Finding 6, the reconciler: a message waiting in a dead worker's direct queue moves
    to the lane's pool. Meanwhile a job whose message was dropped is sent again, and two
    that must not be (a message queued for a pool with no worker now; a job leased by a
    live attempt) are left alone."""
    ghost, session = a_ghost(stack), f"s-{uuid.uuid4().hex[:8]}"
    stack.store.sessions.touch_session(session, stack.tenant_id, ghost)
    waits = accept(stack, "chat", "chat.trtllm")  # no trtllm worker: it waits, and stays one
    leased = accept(stack, "chat", "chat.vllm", send=False)
    stack.redis.set(keys.job_lease(stack.namespace, leased.job_id), "alive/attempt", ex=60)
    dropped = accept(stack, "chat", "chat.vllm", send=False)  # its message was dropped
    stranded = accept(stack, "chat", direct(stack, ghost), session_id=session)
    readers = [Reader(stack, p.job_id) for p in (stranded, dropped)]
    try:
        wait_until(lambda: all(r.ended() for r in readers), 60, "both jobs to end")
        for reader in readers:
            check_stream(reader, "done")
            row = stack.store.jobs.get_job(reader.job_id)
            assert row is not None and row.status == "done"
            assert row.worker == stack.workers["chat"] and row.attempts == 1
        assert waiting(stack, direct(stack, ghost)) == 0
        row = stack.store.jobs.get_job(dropped.job_id)
        assert row is not None and row.route_reason is not None
        assert row.route_reason.startswith("sent again by the reconciler")
        # Judged in the same passes as `dropped`, which was sent again: left alone.
        assert waiting(stack, "chat.trtllm") == 1 and status(stack, waits.job_id) == "queued"
        assert status(stack, leased.job_id) == "queued"
        assert stack.store.jobs.job_payload(leased.job_id) is not None
    finally:
        for sub in keys.queue_sublists("chat.trtllm"):
            stack.redis.delete(sub)
        stack.redis.delete(keys.job_lease(stack.namespace, leased.job_id))
        for job in (waits, leased):
            stack.store.runs.cancel_job(job.job_id)


@pytest.mark.timeout(900)  # a vLLM worker of its own starts first
def test_a_cancelled_job_whose_worker_died_ends_its_stream(stack: Stack, scheduler: Proc,
                                                           tmp_root: Path) -> None:
    """Finding 7b: the DELETE makes the row of a running job `cancelled`, but its worker
    died (stopped, then SIGKILLed: it never heard) before it wrote the end: no worker is
    left to finish the row. The reconciler does, with the tokens the stream holds; the
    stream ends `cancelled` (written by the reconciler, or by the live worker that gets
    the dead one's message back and finds the job ended, whichever comes first)."""
    with doomed_worker(stack, tmp_root) as (doomed, proc):
        payload, reader = held_mid_job(stack, doomed, proc)
        wait_until(lambda: any(e.kind == "token" for e in reader.events), 30,
                   "the consumer to read the doomed worker's first tokens")
        os.killpg(proc.popen.pid, signal.SIGSTOP)  # from now on it hears nothing
        try:
            with Client(stack.base_url, stack.api_key) as client:
                assert client.cancel(payload.job_id)["status"] == "cancelled"
        finally:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        wait_until(reader.ended, 60, "the cancelled job's stream to end",
                   [scheduler, *worker_procs(stack)])
        wait_until(lambda: finished(stack, payload.job_id), 30,
                   "the reconciler to finish the cancelled job's row", [scheduler])
    check_stream(reader, "done")
    tokens = [e for e in reader.events if e.kind == "token"]
    assert tokens and reader.events[0].data["worker"] == doomed
    streamed = sum(len(e.token_ids) for e in tokens)
    end = reader.events[-1].data
    assert end["finish_reason"] == "cancelled"
    assert end.get("usage", {}).get("completion_tokens", streamed) == streamed
    row = stack.store.jobs.get_job(payload.job_id)
    assert row is not None and row.status == "cancelled"
    assert row.output_text == "".join(e.text for e in tokens)
    assert row.completion_tokens == streamed
    assert stack.redis.ttl(keys.job_events(stack.namespace, payload.job_id)) > 0
    assert stack.store.jobs.job_payload(payload.job_id) is None


def finished(stack: Stack, job_id: str) -> bool:
    row = stack.store.jobs.get_job(job_id)
    return row is not None and row.finished_at is not None


def test_an_orphan_past_its_deadline_ends_expired(stack: Stack, scheduler: Proc) -> None:
    """The deadline rule: the time a job lay orphaned counts. One found past its deadline
    is not sent again; it ends `expired`, and its consumer hears it."""
    payload = accept(stack, "finance", "finance.vllm", deadline_at=time.time() + GRACE_S,
                     send=False)
    reader = Reader(stack, payload.job_id)
    wait_until(reader.ended, 30, "the orphan past its deadline to end")
    check_stream(reader, "error")
    assert reader.events[-1].data["code"] == "deadline_exceeded"
    assert status(stack, payload.job_id) == "expired"
    assert stack.store.jobs.job_payload(payload.job_id) is None


# -- Redis restarted empty -----------------------------------------------------------


def worker_procs(stack: Stack) -> list[Proc]:
    names = {f"worker:{name}" for name in stack.workers.values()}
    return [proc for proc in stack.procs if proc.name in names]


@contextlib.contextmanager
def paused(stack: Stack) -> Iterator[None]:
    """The session's workers stopped (SIGSTOP to each group: worker and engine), their
    heartbeats kept alive meanwhile: messages wait in their queues while the API, which
    sees the workers active, accepts jobs."""
    procs = worker_procs(stack)
    for proc in procs:
        os.killpg(proc.popen.pid, signal.SIGSTOP)
    try:
        for name in stack.workers.values():
            assert stack.redis.expire(keys.worker_heartbeat(stack.namespace, name), 60)
        yield
    finally:
        for proc in procs:
            os.killpg(proc.popen.pid, signal.SIGCONT)


def restart_redis_empty(redis_procs: list[Proc], logs: Path) -> None:
    """SIGKILL, then a new redis-server on the same port, with no data."""
    old = redis_procs[-1]
    os.kill(old.popen.pid, signal.SIGKILL)
    old.popen.wait()
    redis_procs.append(start_redis(REDIS_PORT, logs))


def stack_serves(stack: Stack) -> bool:
    """Both workers heartbeat `active` and answer control commands, and the API is ready:
    the stack the later modules use."""
    for name in stack.workers.values():
        hb = read_heartbeat(stack.redis, stack.namespace, name)
        if hb is None or hb.state != WorkerState.ACTIVE:
            return False
    # An app of its own: the session app's pooled broker connections date from before
    # the restart, and a broadcast over one of them fails once.
    app = make_app(get_settings())
    try:
        replies = app.control.broadcast("tidegate_stats", reply=True, timeout=2,
                                        destination=list(stack.workers.values()))
    except (redis.RedisError, OSError, OperationalError):
        return False
    finally:
        app.close()
    answered = {name for reply in replies or [] for name in reply}
    return answered == set(stack.workers.values()) and api_ready(stack.base_url,
                                                                  stack.workers.values())


HELD_AFTER = 8  # tokens the running job streams before its worker holds it
LONG_TOKENS = 64


@pytest.mark.timeout(900)
def test_the_one_redis_down_refuses_submits_503_while_the_running_job_goes_on(
        stack: Stack, scheduler: Proc, redis_procs: list[Proc], tmp_root: Path) -> None:
    """Broker and streams on one Redis (the default deployment). While it is down a
    submit answers 503 with Retry-After, and the job already running goes on: its worker
    holds it mid-generation across the outage (workers/faults.py TokenHold), and once
    Redis is back, empty, its consumer gets every event once, in order, to `done`."""
    chat = stack.workers["chat"]
    hold([chat], HELD_AFTER)
    try:
        with Client(stack.base_url, stack.api_key) as client:
            job_id = str(client.submit("chat", prompt=PROMPT, max_tokens=LONG_TOKENS,
                                       temperature=0.0, deadline_s=60)["job_id"])
        reader = Reader(stack, job_id)
        wait_until(lambda: engine_stats(chat)["held"] == job_id, 60,
                   f"the chat worker to hold job {job_id}", worker_procs(stack), poll_s=0.05)
        wait_until(lambda: len(reader.events) >= HELD_AFTER, 30,
                   "the consumer to read the tokens streamed before the hold")
        old = redis_procs[-1]
        os.kill(old.popen.pid, signal.SIGKILL)
        old.popen.wait()
        resp = httpx.post(f"{stack.base_url}/v1/jobs", timeout=30,
                          json={"lane": "chat", "prompt": PROMPT, "max_tokens": MAX_TOKENS},
                          headers={"Authorization": f"Bearer {stack.api_key}"})
        assert resp.status_code == 503, resp.text
        assert float(resp.headers["retry-after"]) > 0
        redis_procs.append(start_redis(REDIS_PORT, tmp_root / "logs" / "redis-down"))
        wait_until(lambda: stack_serves(stack), 120, "the stack to serve again",
                   [redis_procs[-1], *worker_procs(stack)])
        hold([chat], 0)
        wait_until(reader.ended, 120, f"job {job_id} to end", worker_procs(stack))
        check_stream(reader, "done")
        row = stack.store.jobs.get_job(job_id)
        assert row is not None and row.status == "done"
        assert row.output_text == "".join(e.text for e in reader.events if e.kind == "token")
    finally:
        with contextlib.suppress(Exception):
            hold([chat], 0)
        wait_until(lambda: stack_serves(stack), 120, "the session's stack to serve again",
                   [redis_procs[-1], *worker_procs(stack)])


def test_jobs_queued_when_redis_restarts_empty_all_end_done(
        stack: Stack, scheduler: Proc, redis_procs: list[Proc], tmp_root: Path,
        traces: OtlpReceiver) -> None:
    """Finding 2: Redis restarted without its data forgets every queued message; the
    store still has the jobs, and the reconciler sends them again, each in its trace."""
    jobs = [("chat", 3), ("finance", 3)]
    try:
        with paused(stack):
            with Client(stack.base_url, stack.api_key) as client, ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(
                    lambda lane: client.submit(lane, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                               temperature=0.0),
                    [lane for lane, n in jobs for _ in range(n)]))
            ids = [str(a["job_id"]) for a in answers]
            assert all(status(stack, job_id) == "queued" for job_id in ids)
            readers = [Reader(stack, job_id) for job_id in ids]
            restart_redis_empty(redis_procs, tmp_root / "logs" / "redis-restarted")
        wait_until(lambda: all(r.ended() for r in readers), 120,
                   "every job accepted before the Redis restart to end",
                   [redis_procs[-1], scheduler, *worker_procs(stack)])
        for reader in readers:
            check_stream(reader, "done")
            row = stack.store.jobs.get_job(reader.job_id)
            assert row is not None and row.status == "done"
            tokens = [e for e in reader.events if e.kind == "token"]
            assert row.output_text == "".join(e.text for e in tokens)
            assert row.completion_tokens == sum(len(e.token_ids) for e in tokens)
        # A worker may still read one message Redis had sent it before it died; the rest
        # are in no queue any more, only in the store.
        resent = [job_id for job_id in ids if (row := stack.store.jobs.get_job(job_id)) and
                  (row.route_reason or "").startswith("sent again by the reconciler")]
        assert len(resent) >= len(ids) - len(stack.workers)
        # A resent job's worker span is in the trace its submit began (the stored payload
        # keeps the trace context), not in a new one.
        for job_id in resent:
            row = stack.store.jobs.get_job(job_id)
            assert row is not None and row.trace_id is not None
            assert [s.trace_id for s in job_spans(traces, job_id)] == [row.trace_id]
    finally:
        wait_until(lambda: stack_serves(stack), 120, "the session's stack to serve again",
                   [redis_procs[-1], *worker_procs(stack)])
