"""Redis high availability: `TIDEGATE_REDIS_URL` names Redis Sentinel, and the jobs in
flight when the master dies finish on the replica the sentinel promotes. And a Celery
worker outlives its broker connection: a failover, or a plain Redis restarted empty.

The module starts its own Redis trio (a master, a replica with `--replicaof`, one sentinel
with `redis-server <conf> --sentinel`, quorum 1, a master down after 1 s) and its own
stack on the Sentinel URL: the API and ONE worker of the chat lane (the session's stack
runs on a plain Redis). Streaming jobs run, the master is SIGKILLed as the first tokens
arrive, and every job must end `done` in the store with its consumer hearing that end,
every event once and in order. Then the worker's own threads (heartbeat, cancel listener)
and Celery consumer, and the API's broker publish, must all work on the new master.

A bare Celery worker of tidegate's app (a task that sleeps, another that marks a key: no
engine, the broker code is the same) shows the broker loss on its own, in seconds.

Cost: one vLLM worker start (the stack), then about 40 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
import redis
from tidegate_client import Client

from store import Store, upgrade
from tasks.app import make_app
from tidegate import keys, redisconn
from tidegate.events import Event
from tidegate.fleet import read_heartbeat
from tidegate.records import JobStatus, WorkerState
from tidegate.settings import get_settings
from tidegate_tools.procs import (
    Proc,
    free_port,
    start_redis,
    start_sentinel,
    tidegate_argv,
    wait_until,
)
from tidegate_tools.stack import RunningStack, WorkerSpec, running_stack

MASTER = "tidegate-ha"  # the name the sentinel monitors the master under
LANE, WORKER = "chat", "chat-ha@tidegate"
PROMPT = "Please tell me where my parcel is and when the refund arrives"
BEFORE, AFTER = 12, 4  # jobs submitted before the kill, and after the failover
MAX_TOKENS = 256  # the chat lane's most: seconds of generation for the kill to land in
pytestmark = pytest.mark.timeout(600)


@dataclass
class Trio:
    """A master, its replica and a sentinel watching them, on 127.0.0.1."""

    master: Proc
    master_port: int
    replica_port: int
    sentinel_port: int
    procs: list[Proc]
    killed_at: float = 0.0

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel_port}/0?master={MASTER}"

    def node(self, port: int) -> Any:
        """A plain client of one server, not steered by the sentinel (Any: redis-py types
        its replies as maybe-awaitable)."""
        return redis.Redis(port=port, socket_timeout=5)

    def master_port_now(self) -> int:
        _, port = self.node(self.sentinel_port).sentinel_get_master_addr_by_name(MASTER)
        return int(port)

    def fail_over(self, procs: list[Proc]) -> float:
        """SIGKILLs the master (if not done yet) and waits for the sentinel to promote the
        replica; the time of the kill."""
        if self.master.alive():
            os.killpg(self.master.popen.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()
        alive = [p for p in procs if p is not self.master]
        wait_until(lambda: self.master_port_now() == self.replica_port, 30,
                   "the sentinel to promote the replica", alive)
        return self.killed_at

    def replica_ready(self) -> bool:
        """The replica is in sync and the sentinel knows it (it can promote it)."""
        info = self.node(self.replica_port).info("replication")
        known = self.node(self.sentinel_port).sentinel_slaves(MASTER)
        return info.get("master_link_status") == "up" and any(
            r["port"] == self.replica_port and not r["is_sdown"] for r in known)


@contextlib.contextmanager
def redis_trio(logs: Path) -> Iterator[Trio]:
    procs: list[Proc] = []
    try:
        master_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
        procs.append(start_redis(master_port, logs))
        procs.append(start_redis(replica_port, logs, replica_of=master_port))
        procs.append(start_sentinel(sentinel_port, master_port, MASTER, logs))
        t = Trio(procs[0], master_port, replica_port, sentinel_port, procs)
        wait_until(t.replica_ready, 30, "the replica in sync and known to the sentinel", procs)
        yield t
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def trio(tmp_root: Path) -> Iterator[Trio]:
    with redis_trio(tmp_root / "logs" / "sentinel") as t:
        yield t


@dataclass
class HaStack:
    running: RunningStack
    store: Store
    key: str  # an API key of a tenant allowed the lane
    namespace: str
    scheduler: Proc  # `tidegate scheduler`: Celery beat and the reconciler


@pytest.fixture(scope="module")
def ha_stack(trio: Trio, model_path: Path, tmp_root: Path) -> Iterator[HaStack]:
    db = f"sqlite:///{tmp_root / 'sentinel.db'}"
    upgrade(db)
    store = Store(db)
    _, key = store.tenants.create_tenant("ha-tenant", [LANE])
    env = {**os.environ, "TIDEGATE_REDIS_URL": trio.url, "TIDEGATE_DATABASE_URL": db}
    # The scheduler's beat, reconciler only (no autoscaling tick): it starts while the
    # engine loads.
    scheduler = Proc("scheduler-ha", tidegate_argv("scheduler"),
                     tmp_root / "logs" / "scheduler-ha.log",
                     {**env, "TIDEGATE_SCHEDULER_TICK_S": "3600", "TIDEGATE_RECONCILE_S": "1"})
    try:
        specs = [WorkerSpec(LANE, WORKER, cpus="1")]
        with running_stack(env, specs, tmp_root / "logs") as running:
            yield HaStack(running, store, key, os.environ["TIDEGATE_NAMESPACE"], scheduler)
    finally:
        scheduler.stop()


class Reader(threading.Thread):
    """Consumes a job's SSE stream as a client would (the SDK resumes a dropped stream
    from its last event), keeping every event."""

    def __init__(self, base_url: str, key: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.key, self.job_id = base_url, key, job_id
        self.events: list[Event] = []
        self.failure: Exception | None = None

    def run(self) -> None:
        try:
            with Client(self.base_url, self.key) as client:
                for event in client.stream(self.job_id):
                    self.events.append(event)
        except Exception as exc:  # reported by the test, not lost in a thread
            self.failure = exc

    def ended(self) -> bool:
        return self.failure is not None or (bool(self.events) and self.events[-1].terminal)


class JobStack(Protocol):
    """A stack the jobs below run on (this module's, tests/stack/test_streams_cluster.py's)."""

    running: RunningStack
    store: Store
    key: str  # an API key of a tenant allowed the lane


def start_jobs(ha: JobStack, count: int) -> list[Reader]:
    with Client(ha.running.base_url, ha.key) as client:
        ids = [str(client.submit(LANE, prompt=PROMPT, max_tokens=MAX_TOKENS)["job_id"])
               for _ in range(count)]
    readers = [Reader(ha.running.base_url, ha.key, job_id) for job_id in ids]
    for reader in readers:
        reader.start()
    return readers


def assert_heard_and_stored_done(ha: JobStack, reader: Reader) -> None:
    assert reader.failure is None, f"job {reader.job_id}: the consumer failed: {reader.failure!r}"
    events = reader.events
    assert [e.seq for e in events] == list(range(len(events))), \
        f"job {reader.job_id}: events missing or repeated"
    assert events[-1].kind == "done", f"job {reader.job_id} ended {events[-1]}"
    job = ha.store.jobs.get_job(reader.job_id)
    assert job is not None and job.status == JobStatus.DONE, f"job {reader.job_id}: {job}"
    assert "".join(e.text for e in events if e.kind == "token") == job.output_text


def test_a_blocked_read_follows_the_failover(tmp_root: Path) -> None:
    """The Sentinel clients' own part, no stack: a read blocked on the master when it dies
    (an SSE reader's XREAD BLOCK, sync and asyncio) is retried on the promoted replica
    and gets what is written there. redis-py alone retries it at the dead address."""
    probe = "ha:probe"
    with redis_trio(tmp_root / "logs" / "sentinel-probe") as t:
        sync = redisconn.sync_client(t.url, socket_timeout=30)
        aclient = redisconn.async_client(t.url, socket_timeout=30)

        async def xread() -> Any:
            return await aclient.xread({probe: "0-0"}, block=25_000)

        def read_async() -> Any:
            return asyncio.run(xread())

        with ThreadPoolExecutor(2) as pool:
            blocked = [pool.submit(sync.xread, {probe: "0-0"}, block=25_000),
                       pool.submit(read_async)]
            master = t.node(t.master_port)
            wait_until(lambda: sum(c["cmd"] == "xread" for c in master.client_list()) == 2, 10,
                       "both reads blocked on the master", t.procs)
            t.fail_over(t.procs)
            t.node(t.replica_port).xadd(probe, {"e": "1"}, id="1-0")
            expected = [[probe.encode(), [(b"1-0", {b"e": b"1"})]]]
            assert [read.result(timeout=20) for read in blocked] == [expected, expected]


# A Celery worker of tidegate's app with two probe tasks, on the environment's settings.
PROBE_WORKER = """
import sys, time
from tasks.app import celery_app
from tidegate import redisconn
from tidegate.settings import get_settings

app = celery_app()
client = redisconn.sync_client(get_settings().redis_url)


@app.task(name="probe.sleep", acks_late=True)
def sleep(seconds):
    time.sleep(seconds)


@app.task(name="probe.mark", acks_late=True)
def mark(key):
    client.set(key, "1")


app.worker_main(["worker", "-P", "threads", "-c", "8", "-Q", "probe", "-n", sys.argv[1],
                 "--without-gossip", "--without-mingle", "--loglevel", "INFO"])
"""


@contextlib.contextmanager
def probe_worker(url: str, logs: Path) -> Iterator[tuple[Proc, Any]]:
    """The probe worker on `url`, and a Celery app that sends it tasks."""
    env = {**os.environ, "TIDEGATE_REDIS_URL": url}
    name = f"probe-{free_port()}@tidegate"
    proc = Proc(name, [sys.executable, "-c", PROBE_WORKER, name], logs / f"{name}.log", env)
    app = make_app(get_settings().model_copy(update={"redis_url": url}))
    try:
        wait_until(lambda: bool(app.control.ping([name], timeout=0.5)), 60,
                   "the probe worker to answer", [proc])
        yield proc, app
    finally:
        proc.stop()
        app.close()


@pytest.mark.parametrize("loss", ["failover", "restart"])
def test_a_worker_outlives_its_broker_connection(loss: str, tmp_root: Path) -> None:
    """Redis goes away while the worker runs tasks (their messages unacked): a Sentinel
    failover, or a plain Redis SIGKILLed and started again empty. The worker reconnects and
    takes the next task. On kombu's own transport it exits instead (tasks/broker.py)."""
    logs = tmp_root / "logs" / f"broker-{loss}"
    with contextlib.ExitStack() as stack:
        if loss == "failover":
            trio = stack.enter_context(redis_trio(logs))
            url, old, new = trio.url, trio.node(trio.master_port), trio.node(trio.replica_port)
        else:
            port = free_port()
            redis_proc = start_redis(port, logs)
            stack.callback(lambda: redis_proc.stop())
            url = f"redis://127.0.0.1:{port}/0"
            old = new = redis.Redis(port=port, socket_timeout=5)
        worker, app = stack.enter_context(probe_worker(url, logs))
        for _ in range(4):
            app.send_task("probe.sleep", args=[4], queue="probe")
        wait_until(lambda: old.hlen("unacked") == 4, 20, "4 tasks running", [worker])
        if loss == "failover":
            trio.fail_over([worker])
        else:
            os.killpg(redis_proc.popen.pid, signal.SIGKILL)
            redis_proc.stop()
            redis_proc = start_redis(port, logs)  # empty: its queues and unacked are gone
        app.send_task("probe.mark", args=["probe:after"], queue="probe")
        wait_until(lambda: new.get("probe:after") == b"1", 30,
                   "the worker to take a task after the loss", [worker])
        assert worker.alive()


def test_jobs_in_flight_finish_after_the_master_fails_over(trio: Trio, ha_stack: HaStack) -> None:
    procs = [*ha_stack.running.procs, ha_stack.scheduler]
    master = trio.node(trio.master_port)
    readers = start_jobs(ha_stack, BEFORE)
    # Mid-load: the kill lands as soon as a job has streamed a token.
    wait_until(lambda: any(master.xlen(keys.job_events(ha_stack.namespace, r.job_id)) > 1
                           for r in readers), 60, "the first tokens", procs, poll_s=0.05)
    unfinished = sum(not _ended_in(master, ha_stack.namespace, r.job_id) for r in readers)
    killed_at = trio.fail_over(procs)
    assert unfinished, "every job ended before the kill: nothing was in flight"
    wait_until(lambda: all(r.ended() for r in readers), 120,
               f"the {unfinished} jobs in flight at the kill to end", procs)
    recovered_s = time.monotonic() - killed_at
    for reader in readers:
        assert_heard_and_stored_done(ha_stack, reader)
    assert all(proc.alive() for proc in procs), "a process died with the master"
    assert recovered_s < 60


def test_worker_and_api_work_on_the_new_master(trio: Trio, ha_stack: HaStack) -> None:
    """After the failover: the worker's heartbeat thread writes to the new
    master, its cancel listener is subscribed there, the scheduler's beat runs its tasks
    there, the worker's Celery consumer takes jobs there, and the API publishes there."""
    procs = [*ha_stack.running.procs, ha_stack.scheduler]
    trio.fail_over(procs)  # done by the test above when it ran
    new = trio.node(trio.replica_port)
    ns = ha_stack.namespace
    new.delete(keys.worker_heartbeat(ns, WORKER))  # only a beat from now brings it back
    wait_until(lambda: _consuming(new, ns), 15, "a heartbeat on the new master", procs)
    wait_until(lambda: new.pubsub_numsub(keys.cancel_channel(ns))[0][1] >= 1, 15,
               "the cancel listener subscribed on the new master", procs)
    passes = keys.scheduler_lock(ns, "reconcile", 0)[:-1] + "*"  # one lock per pass
    new.delete(*new.keys(passes) or ["-"])
    wait_until(lambda: bool(new.keys(passes)), 20, "a reconcile pass on the new master", procs)

    readers = start_jobs(ha_stack, AFTER)
    wait_until(lambda: all(r.ended() for r in readers), 60, "the jobs sent after it", procs)
    for reader in readers:
        assert_heard_and_stored_done(ha_stack, reader)


def _ended_in(client: Any, ns: str, job_id: str) -> bool:
    last = client.xrevrange(keys.job_events(ns, job_id), count=1)
    return bool(last) and Event.from_json(last[0][1][b"e"]).terminal


def _consuming(client: Any, ns: str) -> bool:
    hb = read_heartbeat(client, ns, WORKER)
    return hb is not None and hb.state == WorkerState.ACTIVE and bool(hb.consuming)
