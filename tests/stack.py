"""The running stack for end-to-end tests, and the helpers tests share (factories for
tenants and jobs, queue lengths, reading a job's events)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from store import Store
from tidegate import keys
from tidegate.events import Event
from tidegate.procs import Proc, free_port, start_api, start_worker, wait_until

WORKER_START_S = 240  # two vLLM engines loading at once on two cores


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

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {self.api_key}"})

    def stream_events(self, job_id: str) -> list[Event]:
        entries = self.redis.xrange(keys.job_events(self.namespace, job_id))
        return [Event.from_json(fields[b"e"]) for _, fields in entries]


def make_tenant(store: Store, name: str, lanes: list[str]) -> tuple[int, str]:
    tenant, key = store.create_tenant(name, lanes)
    return tenant.id, key


def queue_length(client: redis.Redis, queue: str) -> int:
    """Messages waiting in a lane queue, over all ten priority sub-lists."""
    names = [queue] + [f"{queue}|{p}" for p in range(1, 10)]
    return sum(int(client.llen(n)) for n in names)


def engine_stats(worker: str) -> dict:
    from tasks.app import app

    replies = app.control.broadcast("tidegate_stats", reply=True, destination=[worker],
                                    timeout=10)
    assert replies, f"worker {worker} did not answer the tidegate_stats control command"
    return replies[0][worker]


@pytest.fixture(scope="session")
def stack(redis_server: str, migrated_db: str, model_path: Path, tmp_root: Path) -> Iterator[Stack]:
    env = dict(os.environ)
    logs = tmp_root / "logs"
    procs: list[Proc] = []
    workers = {lane: f"{lane}-test@tidegate" for lane in ("finance", "chat")}
    store = Store(migrated_db)
    tenant_id, key = make_tenant(store, "stack-tenant", ["finance", "chat", "support"])
    port = free_port()
    try:
        for core, (lane, name) in enumerate(workers.items()):
            procs.append(start_worker(env, lane, name, logs, cpus=str(core % 2)))
        procs.append(start_api(env, port, logs))
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(base, set(workers.values())), WORKER_START_S,
                   "the API and both workers to be ready", procs, poll_s=0.5)
        yield Stack(base, key, tenant_id, redis.Redis.from_url(redis_server), store,
                    env["TIDEGATE_NAMESPACE"], workers, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _ready(base: str, names: set[str]) -> bool:
    try:
        resp = httpx.get(f"{base}/readyz", timeout=2)
    except httpx.HTTPError:
        return False
    active = set(resp.json().get("checks", {}).get("workers", {}).get("active", []))
    return resp.status_code == 200 and names <= active


PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def pg_admin(sql: str) -> None:
    """One statement on PostgreSQL's `test` database, outside a transaction (CREATE and
    DROP DATABASE for the tests' private databases)."""
    from sqlalchemy import create_engine

    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()
