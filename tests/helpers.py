"""The running stack for end-to-end tests, and the helpers tests share (factories for
tenants and jobs, queue lengths, reading a job's events)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import httpx
import pytest
import redis
from celery import Celery

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
    broker_url: str | None = None  # where its workers take tasks; None: the environment's

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {self.api_key}"})

    def stream_events(self, job_id: str) -> list[Event]:
        entries = self.redis.xrange(keys.job_events(self.namespace, job_id))
        return [Event.from_json(fields[b"e"]) for _, fields in entries]


def make_tenant(store: Store, name: str, lanes: list[str]) -> tuple[int, str]:
    tenant, key = store.create_tenant(name, lanes)
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


def postgres_or_skip() -> None:
    """Skips the test when PostgreSQL does not answer at 127.0.0.1:5432 (CI has it)."""
    from sqlalchemy.exc import OperationalError

    try:
        pg_admin("SELECT 1")
    except OperationalError as exc:
        pytest.skip(f"PostgreSQL unreachable at 127.0.0.1:5432 ({exc.orig})")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a Prometheus scrape whose labels include `labels`;
    0 when none (a labelled series appears only once something was counted)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())
