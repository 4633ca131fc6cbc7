"""The stack floor's fixtures: a private Redis, a migrated database, and a stack of real
processes (API + one Celery worker per lane hosting vLLM on CPU). Every process started
here is stopped at the end, whatever the outcome."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store import Store
from tests.conftest import REDIS_PORT
from tests.helpers import Stack, make_tenant
from tests.otlp import OtlpReceiver, otlp_receiver
from tidegate_tools.procs import Proc, start_redis
from tidegate_tools.stack import WorkerSpec, running_stack


@pytest.fixture(scope="session")
def redis_procs(tmp_root: Path) -> Iterator[list[Proc]]:
    """The session's redis-server. A test that restarts it on its port appends the new
    process (tests/stack/test_reconcile.py); all are stopped after the stack's."""
    procs = [start_redis(REDIS_PORT, tmp_root / "logs")]
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="session")
def redis_server(redis_procs: list[Proc]) -> str:
    return os.environ["TIDEGATE_REDIS_URL"]


@pytest.fixture(scope="session")
def migrated_db() -> str:
    from store import upgrade

    url = os.environ["TIDEGATE_DATABASE_URL"]
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def traces() -> Iterator[OtlpReceiver]:
    """Where the session stack's processes send their spans (tests/stack/test_traces.py);
    stopped after the stack's processes, which flush to it on the way out."""
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def stack(redis_server: str, migrated_db: str, model_path: Path, tmp_root: Path,
          traces: OtlpReceiver) -> Iterator[Stack]:
    workers = {lane: f"{lane}-test@tidegate" for lane in ("finance", "chat")}
    store = Store(migrated_db)
    # Granted every priority: the router's cases ask more than a lane's default.
    tenant_id, key = make_tenant(store, "stack-tenant", ["finance", "chat", "support"],
                                 max_priority=9)
    specs = [WorkerSpec(lane, name, cpus=str(core % 2))
             for core, (lane, name) in enumerate(workers.items())]
    # Traced, spans exported every 200 ms: the stack's tests run with tracing on.
    env = {**os.environ, "TIDEGATE_OTLP_ENDPOINT": traces.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with running_stack(env, specs, tmp_root / "logs") as running:
        yield Stack(running.base_url, key, tenant_id, redis.Redis.from_url(redis_server), store,
                    os.environ["TIDEGATE_NAMESPACE"], workers, running.procs)
