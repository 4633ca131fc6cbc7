"""The stack floor's fixtures: a private Redis, a migrated database, and a stack of real
processes (API + one Celery worker per lane hosting vLLM on CPU). Every process started
here is stopped at the end, whatever the outcome."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from store import Store
from tests.conftest import REDIS_PORT
from tests.helpers import Stack, make_tenant
from tidegate_tools.procs import Proc, free_port, start_api, start_worker, wait_until

WORKER_START_S = 240  # two vLLM engines loading at once on two cores


@pytest.fixture(scope="session")
def redis_server(tmp_root: Path) -> Iterator[str]:
    from tidegate_tools.procs import start_redis

    proc = start_redis(REDIS_PORT, tmp_root / "logs")
    try:
        yield os.environ["TIDEGATE_REDIS_URL"]
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def migrated_db() -> str:
    from store import upgrade

    url = os.environ["TIDEGATE_DATABASE_URL"]
    upgrade(url)
    return url


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
