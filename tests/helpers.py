"""The running stack for end-to-end tests, and the helpers tests share (factories for
tenants and jobs, queue lengths, reading a job's events)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
import redis

from store import Store
from tidegate import keys
from tidegate.events import Event
from tidegate_tools.pg import pg_admin
from tidegate_tools.procs import Proc


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


def engine_stats(worker: str) -> dict:
    from tasks.app import celery_app

    replies = celery_app().control.broadcast("tidegate_stats", reply=True, destination=[worker],
                                    timeout=10)
    assert replies, f"worker {worker} did not answer the tidegate_stats control command"
    return replies[0][worker]


def postgres_or_skip() -> None:
    """Skips the test when PostgreSQL does not answer at 127.0.0.1:5432 (CI has it)."""
    from sqlalchemy.exc import OperationalError

    try:
        pg_admin("SELECT 1")
    except OperationalError as exc:
        pytest.skip(f"PostgreSQL unreachable at 127.0.0.1:5432 ({exc.orig})")
