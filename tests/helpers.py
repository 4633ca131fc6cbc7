"""The running stack for end-to-end tests, and the helpers tests share (factories for
tenants and jobs, queue lengths, reading a job's events)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
from celery import Celery

from store import Store
from tests.otlp import OtlpReceiver, ReceivedSpan
from tidegate import keys
from tidegate.events import Event
from tidegate_tools.pg import pg_admin
from tidegate_tools.procs import Proc, free_port, wait_until
from workers import faults


@dataclass
class Stack:
    base_url: str
    api_key: str
    tenant_id: int
    redis: redis.Redis
    store: Store
    namespace: str
    workers: dict[str, str]  # lane -> worker name
    procs: list[Proc]
    broker_url: str | None = None  # where its workers take tasks; None: the environment's

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {self.api_key}"})

    def stream_events(self, job_id: str) -> list[Event]:
        entries = self.redis.xrange(keys.job_events(self.namespace, job_id))
        return [Event.from_json(fields[b"e"]) for _, fields in entries]


def answers(url: str) -> bool:
    """Whether `url` answers 200 now (a poll for wait_until; any HTTP error is a no)."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def reconciling_scheduler(stack: Stack, log_path: Any, **env: str) -> Iterator[Proc]:
    """A scheduler on the stack whose tick never comes (it would steer the session's
    workers) and whose reconciler runs every half second, once its first pass ran."""
    import os

    from tidegate_tools.procs import tidegate_argv

    proc = Proc(log_path.stem, tidegate_argv("scheduler"), log_path,
                {**os.environ, "TIDEGATE_SCHEDULER_TICK_S": "3600",
                 "TIDEGATE_RECONCILE_S": "0.5", **env})
    try:
        pattern = keys.scheduler_lock(stack.namespace, "reconcile", 0)[:-1] + "*"
        wait_until(lambda: any(stack.redis.scan_iter(match=pattern)), 120,
                   "the scheduler's first reconcile pass", [proc])
        yield proc
    finally:
        proc.stop()


def make_tenant(store: Store, name: str, lanes: list[str],
                max_priority: int | None = None) -> tuple[int, str]:
    tenant, key = store.tenants.create_tenant(name, lanes, max_priority=max_priority)
    return tenant.id, key


@functools.lru_cache(maxsize=4)
def celery_on(broker_url: str | None) -> Celery:
    """A Celery app on `broker_url` (None: the environment's), one per URL."""
    from tasks.app import celery_app, make_app
    from tidegate.settings import get_settings

    if broker_url is None:
        return celery_app()
    return make_app(get_settings().model_copy(update={"redis_url": broker_url}))


def engine_stats(worker: str, broker_url: str | None = None) -> dict:
    """The worker's answer to the tidegate_stats control command, sent on `broker_url`
    (default: the environment's)."""
    replies = celery_on(broker_url).control.broadcast("tidegate_stats", reply=True,
                                                      destination=[worker], timeout=10)
    assert replies, f"worker {worker} did not answer the tidegate_stats control command"
    return replies[0][worker]


def hold(names: list[str], after_tokens: int, broker_url: str | None = None,
         freeze_engine: bool = False) -> None:
    """Arms (after_tokens > 0) or releases the workers' hold (workers/faults.py TokenHold):
    the next job to stream that many tokens waits there, its engine request running on
    (or, with `freeze_engine`, its engine stopped from then until the hold is let go)."""
    arguments = {"after_tokens": after_tokens, "freeze_engine": freeze_engine}
    celery_on(broker_url).control.broadcast("tidegate_hold", arguments=arguments,
                                            destination=names, reply=True, timeout=10)


def missing_here(reason: str) -> None:
    """A test whose service or tool is missing: skipped on a developer's machine, failed
    in CI (`CI=true`), where PostgreSQL runs and `make ops-tools` installs promtool and
    docker-compose, so a missing one is a broken CI machine, not a test to pass over."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: a test CI must run fails instead of skipping)",
                    pytrace=False)
    pytest.skip(reason)


def postgres_or_skip() -> None:
    """Skips the test when PostgreSQL does not answer at 127.0.0.1:5432 (fails in CI)."""
    from sqlalchemy.exc import OperationalError

    try:
        pg_admin("SELECT 1")
    except OperationalError as exc:
        missing_here(f"PostgreSQL unreachable at 127.0.0.1:5432 ({exc.orig})")


def compose_tool() -> list[str] | None:
    """docker-compose, or the docker compose plugin; None when neither is installed."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def tool_or_skip(name: str, install: str) -> None:
    """Skips (fails in CI) the test when the command `name` is not installed."""
    if shutil.which(name) is None:
        missing_here(f"{name} is not installed ({install})")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a Prometheus scrape whose labels include `labels`;
    0 when none (a labelled series appears only once something was counted)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def worker_scrape(stack: Stack, lane: str) -> str:
    """The /metrics text of the stack's worker for `lane` (it serves its own, on the port
    tidegate_tools.procs.start_worker gave it)."""
    name = f"worker:{stack.workers[lane]}"
    proc = next(p for p in stack.procs if p.name == name)
    assert proc.metrics_port, f"{name} serves no /metrics"
    return httpx.get(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).text


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` (api.app.create_app's) served by uvicorn on a free port, in a thread of the
    test process: real HTTP, so a client's read timeout bounds every wait on it, for the
    cost of no process start. Yields its base URL; stopped on the way out."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name=f"api-{port}", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 60, "the in-process API")
        assert server.started, "the in-process API did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@dataclass
class ApiOfItsOwn:
    base_url: str
    app: Any
    store: Store
    redis: redis.Redis
    namespace: str


@contextlib.contextmanager
def api_of_its_own(redis_server: str, tmp_root: Any, name: str, db: int,
                   advertised: list[tuple[str, str]], **settings: Any) -> Iterator[ApiOfItsOwn]:
    """An API of a test module's own, in a thread (`served`): its own SQLite database, its
    own Redis database number `db` (emptied on the way out) and namespace `tg<name>`,
    settings of its own (caps, periods), and a heartbeat per (lane, pool) in `advertised`
    so those lanes' jobs are accepted and stay queued."""
    from api.app import create_app
    from store import upgrade
    from tidegate.settings import Settings

    url = f"sqlite:///{tmp_root / f'{name}.db'}"
    upgrade(url)
    config = Settings(redis_url=redis_server.rsplit("/", 1)[0] + f"/{db}", database_url=url,
                      namespace=f"tg{name}", **settings)
    client = redis.Redis.from_url(config.redis_url)
    for lane, pool in advertised:
        advertise(client, config.namespace, f"{lane}-advertised@{name}", lane, pool)
    app = create_app(config)
    try:
        with served(app) as base_url:
            yield ApiOfItsOwn(base_url, app, Store(url), client, config.namespace)
    finally:
        client.flushdb()


class Held:
    """An API of its own's admission threads held busy by calls of the test's own (each on
    a loop of its own in a thread), released one at a time (tests/stack/test_front_door.py:
    what waits behind whom for admission)."""

    def __init__(self, own: ApiOfItsOwn) -> None:
        self.admission = own.app.state.deps.admission
        self.releases: list[threading.Event] = []
        self.threads: list[threading.Thread] = []

    def hold(self, rank: tuple[float, ...], taken: bool = True) -> None:
        """A call of `rank` that holds its thread until released: `taken` by a free thread
        (wait until it runs), else left waiting in the queue (wait until it is there)."""
        release, running = threading.Event(), threading.Event()
        waiting = self.admission.waiting()

        def held() -> None:
            running.set()
            release.wait(60)

        thread = threading.Thread(target=lambda: asyncio.run(self.admission.run(rank, held)),
                                  daemon=True)
        thread.start()
        self.releases.append(release)
        self.threads.append(thread)
        wait_until(lambda: running.is_set() if taken else self.admission.waiting() > waiting,
                   10, "the hold to reach its admission thread or queue", poll_s=0.01)

    def release(self, index: int | None = None) -> None:
        for release in self.releases if index is None else [self.releases[index]]:
            release.set()

    def close(self) -> None:
        self.release()
        for thread in self.threads:
            thread.join(timeout=10)


def advertise(client: redis.Redis, namespace: str, name: str, lane: str, pool: str) -> None:
    """The heartbeat an active worker of `lane`'s `pool` would write, with no worker behind
    it: the router sends that lane's jobs to the pool queue, where they stay queued."""
    import json

    body = {"name": name, "state": "active", "lanes": [lane], "pool": pool, "engine": "vllm",
            "slots": 4, "kv_cache_dtype": "fp8", "dtype": "float16", "stats": {}}
    client.set(keys.worker_heartbeat(namespace, name), json.dumps(body))


@dataclass
class InProcessApi:
    """The API app in this process (FastAPI's TestClient), on a Redis DB and a SQLite
    database of its own, with one tenant."""

    http: Any  # fastapi.testclient.TestClient
    store: Store
    redis: redis.Redis
    settings: Any  # tidegate.settings.Settings
    tenant_id: int
    key: str


# The session's redis-server has 64 databases (tidegate_tools/procs.py start_redis); 0 is
# the session stack's. Every other one belongs to one module (and one part of it) alone.
_OWN_DBS: dict[tuple[str, str], int] = {}
_LAST_DB = 63


def own_db(module: str, part: str = "") -> int:
    """A database number of the session's redis-server for `module`'s `part` alone: the
    same number on every call in a session, never another module's, so no module sees
    another's keys (queues, rate limits, heartbeats) whatever order the modules run in."""
    key = (module, part)
    if key not in _OWN_DBS:
        number = len(_OWN_DBS) + 1
        assert number <= _LAST_DB, f"more than {_LAST_DB} module databases asked for"
        _OWN_DBS[key] = number
    return _OWN_DBS[key]


def own_redis_url(redis_server: str, module: str, part: str = "") -> str:
    """The session redis-server's URL (`redis_server`) on own_db(module, part)."""
    return redis_server.rsplit("/", 1)[0] + f"/{own_db(module, part)}"


@contextlib.contextmanager
def in_process_api(redis_server: str, db_path: Any, redis_db: int, tenant: str,
                   lanes: list[str]) -> Iterator[InProcessApi]:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from store import upgrade
    from tidegate.settings import Settings

    url = f"sqlite:///{db_path}"
    upgrade(url)
    redis_url = redis_server.rsplit("/", 1)[0] + f"/{redis_db}"
    settings = Settings(redis_url=redis_url, database_url=url)
    store = Store(url)
    record, key = store.tenants.create_tenant(tenant, lanes)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        with TestClient(create_app(settings)) as http:
            yield InProcessApi(http, store, client, settings, record.id, key)
    finally:
        client.flushdb()


@contextlib.contextmanager
def running_driver(settings: Any) -> Iterator[threading.Thread]:
    """The batch driver (`tidegate batches`'s api.batch_driver.run_driver) in a thread of
    the test process, for in-process API tests: the API no longer drives batches. Stopped
    (its lock released) on the way out."""
    from api.batch_driver import run_driver

    stop = threading.Event()
    thread = threading.Thread(target=run_driver, args=(settings, stop), name="batch-driver",
                              daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=30)


def next_frame(lines: Iterator[str], deadline: float) -> dict[str, str] | None:
    """The next SSE frame (field -> value), None at the stream's end; fails at `deadline`
    (checked at each line: a keep-alive comes every TIDEGATE_SSE_KEEPALIVE_S)."""
    frame: dict[str, str] = {}
    for line in lines:
        assert time.monotonic() < deadline, "the stream went on past its deadline"
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(": ")
            frame[name] = value
        elif frame:
            return frame
    return frame or None


def end_tokens_banned(model_path: Path) -> dict[str, int]:
    """logit_bias banning the checkpoint's end tokens: an answer free to end at any token
    ended before its cancel in one CI run. With it, and 8 choices, the job runs for
    seconds (the toy model makes one choice's 1,500 tokens in well under one)."""
    ends = json.loads((model_path / "generation_config.json").read_text())["eos_token_id"]
    return {str(token): -100 for token in (ends if isinstance(ends, list) else [ends])}


def job_spans(traces: OtlpReceiver, job_id: str) -> list[ReceivedSpan]:
    """The workers' job spans of `job_id`, once at least one arrived (ended attempts only)."""
    def spans() -> list[ReceivedSpan]:
        return [s for s in traces.received() if s.name == "tidegate.job"
                and s.attributes.get("tidegate.job_id") == job_id]
    wait_until(lambda: bool(spans()), 30, f"the job span of job {job_id} at the OTLP receiver")
    return spans()


def engine_processes(worker: Proc) -> list[psutil.Process]:
    """A worker's vLLM engine core and the processes it spawned (not the worker's own)."""
    procs = faults.engine_processes(worker.popen.pid)
    assert procs, f"no vLLM engine process under {worker.name}"
    return procs
