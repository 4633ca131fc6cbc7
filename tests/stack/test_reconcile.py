"""The store is the truth; the reconciler makes Redis agree (scheduler/reconcile.py).

On the session stack (API, chat and finance workers), with a real scheduler process
(`tidegate scheduler`) started for the module: its beat runs the reconciler every 0.5 s
with a grace of 1 s; its tick (autoscale, health) is set an hour apart so it never steers
the session's workers.

What the tests break, and how:
- Redis restarted empty: the session's redis-server is SIGKILLed and started again on its
  port with no data, while jobs wait queued (both workers SIGSTOPped meanwhile, their
  heartbeats kept alive so the API still routes to them). The module's last test; it
  waits for both workers to serve again before it ends, for the modules after it.
- A dead worker (findings 6 and 7b): the state a SIGKILLed worker leaves in Redis, made by
  the test without starting a worker to kill (one more vLLM worker is a minute of the
  suite): its heartbeat gone, a session job's message waiting in its direct queue or
  taken by it (kombu's unacked entry, with its direct queue as routing key), a running
  job's stream with its `started` and tokens, its lease expired. The jobs are written as
  the API's submit writes them (row and payload, then the message).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest
import redis
from kombu.exceptions import OperationalError
from tidegate_client import Client

from tasks.app import celery_app, make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.conftest import REDIS_PORT
from tests.helpers import Stack, reconciling_scheduler
from tidegate import keys
from tidegate.events import Event
from tidegate.fleet import read_heartbeat
from tidegate.lanes import redis_priority
from tidegate.records import WorkerState
from tidegate.settings import get_settings
from tidegate_tools.procs import Proc, start_redis, wait_until
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
    stack.store.create_job(job_id, stack.tenant_id, lane, queue, PRIORITY, session_id,
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
    job = stack.store.get_job(job_id)
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


def test_a_dead_workers_taken_session_job_goes_back_to_the_pool(stack: Stack) -> None:
    """Finding 6, the worker side (tasks/recovery.py): a message a dead worker took from
    its direct queue is handed back to a live worker's queue, not to the dead one's. No
    scheduler runs yet: the workers' own recovery sweep does it."""
    ghost, session = a_ghost(stack), f"s-{uuid.uuid4().hex[:8]}"
    stack.store.touch_session(session, stack.tenant_id, ghost)  # the ghost held its prefix
    payload = accept(stack, "chat", direct(stack, ghost), session_id=session)
    take_unacked(stack, direct(stack, ghost), taken_s_ago=60)
    reader = Reader(stack, payload.job_id)
    wait_until(reader.ended, 60, "the dead worker's session job to end")
    check_stream(reader, "done")
    row = stack.store.get_job(payload.job_id)
    assert row is not None and row.status == "done" and row.worker == stack.workers["chat"]
    assert waiting(stack, direct(stack, ghost)) == 0
    assert stack.store.job_payload(payload.job_id) is None  # the prompt is not kept


def take_unacked(stack: Stack, queue: str, taken_s_ago: float) -> None:
    """What a worker's consumer does when it takes a message (kombu's BRPOP, then its
    unacked entry: [message, exchange, routing key] and the time it was taken)."""
    raw = next(m for sub in keys.queue_sublists(queue) if (m := stack.redis.rpop(sub)))
    message = json.loads(raw)
    info, tag = message["properties"]["delivery_info"], message["properties"]["delivery_tag"]
    with celery_app().pool.acquire(block=True) as conn:
        qos = conn.default_channel.qos
        stack.redis.hset(qos.unacked_key, tag,
                         json.dumps([message, info["exchange"], info["routing_key"]]))
        stack.redis.zadd(qos.unacked_index_key, {tag: time.time() - taken_s_ago})


def test_a_session_job_stranded_on_a_dead_workers_queue_ends_done_on_another(
        stack: Stack, scheduler: Proc) -> None:
    """Finding 6, the reconciler: a message waiting in a dead worker's direct queue moves
    to the lane's pool. Meanwhile a job whose message was dropped is sent again, and two
    that must not be (a message queued for a pool with no worker now; a job leased by a
    live attempt) are left alone."""
    ghost, session = a_ghost(stack), f"s-{uuid.uuid4().hex[:8]}"
    stack.store.touch_session(session, stack.tenant_id, ghost)
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
            row = stack.store.get_job(reader.job_id)
            assert row is not None and row.status == "done"
            assert row.worker == stack.workers["chat"] and row.attempts == 1
        assert waiting(stack, direct(stack, ghost)) == 0
        row = stack.store.get_job(dropped.job_id)
        assert row is not None and row.route_reason is not None
        assert row.route_reason.startswith("sent again by the reconciler")
        # Judged in the same passes as `dropped`, which was sent again: left alone.
        assert waiting(stack, "chat.trtllm") == 1 and status(stack, waits.job_id) == "queued"
        assert status(stack, leased.job_id) == "queued"
        assert stack.store.job_payload(leased.job_id) is not None
    finally:
        for sub in keys.queue_sublists("chat.trtllm"):
            stack.redis.delete(sub)
        stack.redis.delete(keys.job_lease(stack.namespace, leased.job_id))
        for job in (waits, leased):
            stack.store.cancel_job(job.job_id)


def test_a_cancelled_job_whose_worker_died_ends_its_stream(stack: Stack,
                                                           scheduler: Proc) -> None:
    """Finding 7b: the DELETE makes the row of a running job `cancelled`, but its worker
    died (its lease expired) before it heard: no worker is left to write the end. The
    reconciler does."""
    ghost = a_ghost(stack)
    payload = accept(stack, "chat", "chat.vllm", send=False)  # the ghost took its message
    stack.store.claim_job(payload.job_id, ghost, "vllm")
    lease = keys.job_lease(stack.namespace, payload.job_id)
    stack.redis.set(lease, f"{ghost}/attempt", ex=60)  # alive until the cancel
    ghost_events = [Event(payload.job_id, 0, "started", data={"worker": ghost}),
                    Event(payload.job_id, 1, "token", text="Your", token_ids=[11]),
                    Event(payload.job_id, 2, "token", text=" parcel", token_ids=[12, 13])]
    for event in ghost_events:
        stack.redis.xadd(keys.job_events(stack.namespace, payload.job_id),
                         event.stream_fields(), id=keys.stream_id(event.seq))
    reader = Reader(stack, payload.job_id)
    wait_until(lambda: len(reader.events) == 3, 30, "the consumer to read the ghost's events")
    with Client(stack.base_url, stack.api_key) as client:
        assert client.cancel(payload.job_id)["status"] == "cancelled"
    stack.redis.delete(lease)  # the ghost is gone: its lease expired
    wait_until(reader.ended, 30, "the cancelled job's stream to end")
    check_stream(reader, "done")
    assert reader.events[-1].data["finish_reason"] == "cancelled"
    assert reader.events[-1].data["usage"]["completion_tokens"] == 3
    row = stack.store.get_job(payload.job_id)
    assert row is not None and row.status == "cancelled" and row.finished_at is not None
    assert row.output_text == "Your parcel" and row.completion_tokens == 3
    assert stack.redis.ttl(keys.job_events(stack.namespace, payload.job_id)) > 0
    assert stack.store.job_payload(payload.job_id) is None


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
    assert stack.store.job_payload(payload.job_id) is None


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


def test_jobs_queued_when_redis_restarts_empty_all_end_done(
        stack: Stack, scheduler: Proc, redis_procs: list[Proc], tmp_root: Path) -> None:
    """Finding 2: Redis restarted without its data forgets every queued message; the
    store still has the jobs, and the reconciler sends them again."""
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
            row = stack.store.get_job(reader.job_id)
            assert row is not None and row.status == "done"
            tokens = [e for e in reader.events if e.kind == "token"]
            assert row.output_text == "".join(e.text for e in tokens)
            assert row.completion_tokens == sum(len(e.token_ids) for e in tokens)
        # A worker may still read one message Redis had sent it before it died; the rest
        # are in no queue any more, only in the store.
        resent = [job_id for job_id in ids if (row := stack.store.get_job(job_id)) and
                  (row.route_reason or "").startswith("sent again by the reconciler")]
        assert len(resent) >= len(ids) - len(stack.workers)
    finally:
        wait_until(lambda: stack_serves(stack), 120, "the session's stack to serve again",
                   [redis_procs[-1], *worker_procs(stack)])
