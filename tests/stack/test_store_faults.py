"""Faults of the parts that keep state, and a promise of the webhook outbox (issue 33),
each with real processes:

- PostgreSQL restarts under a running stack (a private server this module starts with
  initdb and pg_ctl, the API and a sim-engine worker on it): while it is down a submit
  answers 503 with Retry-After, neither a hang nor a 500, and an open stream goes on; once
  it is back submits answer 202 and the job that was running ends `done` in the store.
- Of two `tidegate scheduler` processes, the beat's holder is SIGKILLed (no release of
  its lock): the other takes the beat lock once it lapses and the periodic tick goes on
  (its records in Redis, not a log line).
- A tenant with no webhook secret gets no webhook: each attempt is recorded failed
  `no_signing_secret` and retried, and the delivery goes out, signed, once the tenant makes
  a secret (docs/api.md, "Signatures and secrets").

Redis databases 26 and 27 are this module's (26 with test_batch_limits.py, never at once).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import exc as sa_exc
from tidegate_client import Client
from tidegate_client.models import Event

from scheduler.beat import BEAT_LOCK_S
from store import Store, upgrade
from tests.helpers import api_of_its_own, missing_here, own_db
from tests.stack.test_webhooks import Receiver, verified
from tidegate import keys
from tidegate_tools.procs import Proc, free_port, start_scheduler, tidegate_argv, wait_until
from tidegate_tools.stack import WorkerSpec, running_stack

HOOKS_DB = own_db(__name__, "34")


def own_redis(redis_server: str, db: int) -> str:
    return redis_server.rsplit("/", 1)[0] + f"/{db}"


def stack_client(base_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"},
                        timeout=60)


# -- PostgreSQL restarts under the stack ------------------------------------------------

PG_DB = own_db(__name__, "33")
PG_NS = "tgpgfault"
PG_WORKER = "finance-pgfault@tidegate"
PG_TOKENS = 900  # ~45 s on the `paced` sim profile (48 ms a step): the job spans the outage


def pg_tool(name: str) -> str | None:
    """A PostgreSQL server binary: on PATH, else Debian's versioned folder (the newest)."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return shutil.which(name) or (str(found[-1]) if found else None)


class PrivatePostgres:
    """A PostgreSQL server of this test's own (initdb + pg_ctl), trust auth on 127.0.0.1.
    The server refuses to run as root: as root, it runs as `nobody`, its folder theirs."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.data, self.log = folder / "data", folder / "postgres.log"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(folder, "nobody")
        self._run(pg_tool("initdb") or "initdb", "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "-E", "UTF8")

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self.as_user, *argv], capture_output=True, text=True,
                              timeout=180, check=False)
        assert done.returncode == 0, f"{argv[0]} failed: {done.stdout}{done.stderr}"

    def _ctl(self, *args: str) -> None:
        self._run(pg_tool("pg_ctl") or "pg_ctl", "-D", str(self.data), *args)

    def start(self) -> None:
        # -w: returns once the server accepts connections (or fails, within -t).
        self._ctl("-o", f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1",
                  "-l", str(self.log), "-w", "-t", "180", "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "-w", "-t", "120", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


@pytest.fixture()
def postgres() -> Iterator[PrivatePostgres]:
    for tool in ("initdb", "pg_ctl"):
        if pg_tool(tool) is None:
            missing_here(f"{tool} is not installed (PostgreSQL's server binaries)")
    folder = Path(tempfile.mkdtemp(prefix="tidegate-pgfault-"))
    try:
        server = PrivatePostgres(folder)
        server.start()
        try:
            yield server
        finally:
            if server.running():
                server.stop("immediate")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class PgStack:
    base_url: str
    key: str
    store: Store
    procs: list[Proc]


@pytest.fixture()
def pg_stack(postgres: PrivatePostgres, redis_server: str, model_path: Path,
             tmp_root: Path) -> Iterator[PgStack]:
    """The API, the batch driver and one sim-engine finance worker on the private server;
    a Redis database of its own, so the session stack's workers never take these jobs."""
    upgrade(postgres.url)
    store = Store(postgres.url)
    _, key = store.tenants.create_tenant("pgfault-tenant", ["finance"])
    redis_url = own_redis(redis_server, PG_DB)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    env = {**os.environ, "TIDEGATE_DATABASE_URL": postgres.url, "TIDEGATE_REDIS_URL": redis_url,
           "TIDEGATE_NAMESPACE": PG_NS, "TIDEGATE_SIM_PROFILE": "paced"}
    try:
        with running_stack(env, [WorkerSpec("finance", PG_WORKER, pool="vllm", engine="sim")],
                           tmp_root / "logs") as running:
            yield PgStack(running.base_url, key, store, running.procs)
    finally:
        client.flushdb()
        store.engine.dispose()


class Reader:
    """The SDK's stream of a job in a thread: it reconnects with Last-Event-ID by itself."""

    def __init__(self, base_url: str, key: str, job_id: str) -> None:
        self.events: list[Event] = []
        self.failure: BaseException | None = None
        self.client = Client(base_url, key, max_reconnects=100)
        self.thread = threading.Thread(target=self._read, args=(job_id,), daemon=True)
        self.thread.start()

    def _read(self, job_id: str) -> None:
        try:
            for event in self.client.stream(job_id):
                self.events.append(event)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.failure = exc

    def tokens(self) -> int:
        return sum(1 for e in self.events if e.kind == "token")

    def ended(self) -> bool:
        return self.failure is not None or (bool(self.events) and self.events[-1].terminal)

    def close(self) -> None:
        self.client.close()
        self.thread.join(timeout=30)


def submit_once(base_url: str, key: str) -> httpx.Response:
    """One submit, no retry (the SDK would retry a 503); a hang is the client's timeout."""
    return httpx.post(f"{base_url}/v1/jobs", timeout=60, headers={
        "Authorization": f"Bearer {key}"}, json={
        "lane": "finance", "prompt": "Is invoice 4411 paid?", "max_tokens": 4})


def status_in_store(store: Store, job_id: str) -> str | None:
    try:
        job = store.jobs.get_job(job_id)
    except sa_exc.OperationalError:  # a connection from before the restart: next poll
        return None
    return None if job is None else str(job.status)


def test_a_postgres_restart_answers_503_then_202_and_the_running_job_ends_done(
        postgres: PrivatePostgres, pg_stack: PgStack) -> None:
    made = httpx.post(f"{pg_stack.base_url}/v1/jobs", timeout=60, headers={
        "Authorization": f"Bearer {pg_stack.key}"}, json={
        "lane": "finance", "prompt": "Summarise the quarter's refunds.",
        "max_tokens": PG_TOKENS})
    assert made.status_code == 202, made.text
    job_id = made.json()["job_id"]
    reader = Reader(pg_stack.base_url, pg_stack.key, job_id)
    try:
        wait_until(lambda: reader.tokens() >= 5 or reader.ended(), 120,
                   "the job's first tokens on its stream", pg_stack.procs)
        assert reader.failure is None and not reader.ended()
        postgres.stop("immediate")  # a crash: no checkpoint, connections cut
        at_stop = reader.tokens()
        refused = submit_once(pg_stack.base_url, pg_stack.key)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["type"] == "unavailable", refused.text
        # The open stream goes on: its tokens come through Redis, not the store.
        wait_until(lambda: reader.tokens() >= at_stop + 10 or reader.ended(), 60,
                   "tokens on the open stream while PostgreSQL is down", pg_stack.procs)
        assert reader.failure is None and reader.tokens() >= at_stop + 10
        postgres.start()
        wait_until(lambda: submit_once(pg_stack.base_url, pg_stack.key).status_code == 202,
                   120, "a submit to be accepted once PostgreSQL is back", pg_stack.procs,
                   poll_s=0.5)
        wait_until(reader.ended, 240, "the stream's end", pg_stack.procs)
        wait_until(lambda: status_in_store(pg_stack.store, job_id) == "done", 120,
                   "the job to end done in the store", pg_stack.procs)
    finally:
        reader.close()
    assert reader.failure is None, repr(reader.failure)
    assert [e.seq for e in reader.events] == list(range(len(reader.events)))  # no gap, no repeat
    assert reader.events[-1].kind == "done"
    job = pg_stack.store.jobs.get_job(job_id)
    assert job is not None and job.status == "done"
    tokens = [e for e in reader.events if e.kind == "token"]
    assert job.completion_tokens == sum(len(e.token_ids) for e in tokens) == PG_TOKENS
    assert job.output_text == "".join(e.text for e in tokens)


# -- a tenant with no webhook secret -----------------------------------------------------


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    try:
        yield rx
    finally:
        rx.server.shutdown()
        rx.server.server_close()


def test_a_tenant_without_a_secret_gets_its_webhook_signed_once_it_makes_one(
        redis_server: str, model_path: Path, tmp_root: Path, receiver: Receiver) -> None:
    with api_of_its_own(redis_server, tmp_root, "nosecret", HOOKS_DB,
                        [("chat", "vllm")]) as api:
        _, key = api.store.tenants.create_tenant(f"nosecret-{uuid.uuid4().hex[:6]}", ["chat"])
        env = {**os.environ, "TIDEGATE_REDIS_URL": own_redis(redis_server, HOOKS_DB),
               "TIDEGATE_DATABASE_URL": api.store.url.render_as_string(hide_password=False),
               "TIDEGATE_NAMESPACE": api.namespace, "TIDEGATE_WEBHOOK_BACKOFF_S": "0.3",
               "TIDEGATE_WEBHOOK_DISPATCH_S": "0.2", "TIDEGATE_WEBHOOK_TIMEOUT_S": "5"}
        http = stack_client(api.base_url, key)
        sender = Proc("webhooks-nosecret", tidegate_argv("webhooks"),
                      tmp_root / "logs" / "webhooks-nosecret.log", env)
        try:
            made = http.post("/v1/jobs", json={
                "lane": "chat", "prompt": "Where is my parcel?", "max_tokens": 8,
                "callback_url": f"{receiver.url}/ok"})
            assert made.status_code == 202, made.text
            job_id = made.json()["job_id"]
            assert http.delete(f"/v1/jobs/{job_id}").status_code == 200  # it ends: cancelled

            def attempts() -> list[dict[str, Any]]:
                found = http.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]
                return list(found[0]["log"]) if found else []

            wait_until(lambda: len(attempts()) >= 2 or receiver.of_job(job_id) != [], 120,
                       "two attempts of the delivery, refused for want of a secret", [sender])
            assert receiver.of_job(job_id) == []  # nothing unsigned went out
            assert {a["error"] for a in attempts()} == {"no_signing_secret"}
            rotated = http.post("/v1/webhook-secret")
            assert rotated.status_code == 200, rotated.text
            secret = rotated.json()["secret"]
            wait_until(lambda: receiver.of_job(job_id) != [], 120,
                       "the delivery to go out once the tenant has a secret", [sender])
            [request] = receiver.of_job(job_id)
            event = verified(secret, request)
            assert event["type"] == "job.ended"
            assert event["data"]["id"] == job_id and event["data"]["status"] == "cancelled"
            wait_until(lambda: http.get(f"/v1/jobs/{job_id}/deliveries").json()["data"][0][
                "status"] == "delivered", 30, "the delivery recorded delivered", [sender])
        finally:
            http.close()
            sender.stop()
            api.store.engine.dispose()


# -- the beat taken over after its holder dies ------------------------------------------


def ticks(client: redis.Redis, ns: str) -> int:
    """The periodic tick's runs the schedulers recorded (one per period that acted)."""
    entries: Any = client.xrange(keys.scheduler_actions(ns))
    return sum(b'"action": "tick"' in fields[b"a"] for _, fields in entries)


@pytest.fixture()
def beat_env(redis_server: str, tmp_root: Path) -> Iterator[dict[str, str]]:
    data_dir = tmp_root / "beat-kill-data"
    data_dir.mkdir(exist_ok=True)
    url = own_redis(redis_server, HOOKS_DB)
    client = redis.Redis.from_url(url)
    client.flushdb()
    db = f"sqlite:///{tmp_root / 'beat-kill.db'}"
    upgrade(db)
    try:
        yield {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_NAMESPACE": "tgbeatkill",
               "TIDEGATE_DATA_DIR": str(data_dir), "TIDEGATE_DATABASE_URL": db,
               "TIDEGATE_SCHEDULER_TICK_S": "1", "TIDEGATE_RECONCILE_S": "0.5"}
    finally:
        client.flushdb()


def test_a_killed_beats_lock_is_taken_by_the_other_scheduler_within_its_ttl(
        beat_env: dict[str, str], tmp_root: Path) -> None:
    ns = beat_env["TIDEGATE_NAMESPACE"]
    client = redis.Redis.from_url(beat_env["TIDEGATE_REDIS_URL"])
    lock = keys.beat_lock(ns)
    logs = tmp_root / "logs"
    for name in ("scheduler-beat-holder", "scheduler-beat-other"):  # logs are appended to
        (logs / f"{name}.log").unlink(missing_ok=True)
    holder = start_scheduler(beat_env, logs, "scheduler-beat-holder")
    procs = [holder]
    try:
        # 240 s: a scheduler imports the project and starts Celery on a loaded machine.
        wait_until(lambda: ticks(client, ns) >= 1, 240, "the first scheduler's tick", procs)
        other = start_scheduler(beat_env, logs, "scheduler-beat-other")
        procs.append(other)
        # The other's beat waits on the lock; its Celery worker runs ticks too.
        wait_until(lambda: "beat: Starting" in other.log_path.read_text(errors="replace"),
                   240, "the second scheduler's beat to start", procs)
        seen = ticks(client, ns)
        wait_until(lambda: ticks(client, ns) >= seen + 3, 60, "three more ticks", procs)
        held: Any = client.get(lock)
        ttl_ms: Any = client.pttl(lock)
        assert held is not None and 0 < ttl_ms <= BEAT_LOCK_S * 1000
        os.killpg(holder.popen.pid, signal.SIGKILL)  # no release: the lock must lapse
        holder.popen.wait()
        # Taken once its TTL (at most BEAT_LOCK_S) lapses; 60 s of slack for a loaded
        # machine, far less than a broken takeover would need.
        wait_until(lambda: client.get(lock) not in (None, held), BEAT_LOCK_S + 60,
                   "the other beat to take the lock", [other])
        seen = ticks(client, ns)
        wait_until(lambda: ticks(client, ns) >= seen + 2, 60,
                   "ticks sent by the beat that took over", [other])
    finally:
        for proc in reversed(procs):
            proc.stop()
