"""The end-to-end floor on PostgreSQL (production's database): a second stack, the API and
one chat worker, on a private PostgreSQL database and a Redis DB of its own, runs a subset
of tests/stack/test_e2e.py against rows PostgreSQL stored: the streamed tokens and the
row's output and timings, a resume by Last-Event-ID (of an ended job, and of a live one,
by the header and through the SDK over a proxy that drops the connection), a cancel
mid-generation, metrics against the row's figures, and an idempotent replay. (Chat: its
lane yields the CPU, so the test reads streams while jobs generate.)"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store import Store, upgrade
from tests.helpers import Stack, make_tenant, own_redis_url, postgres_or_skip
from tests.stack import test_e2e as e2e
from tests.stack import test_sdk as sdk
from tidegate_tools.pg import private_database
from tidegate_tools.stack import WorkerSpec, running_stack

pytestmark = pytest.mark.postgres
WORKER = "chat-pg@tidegate"
NAMESPACE = "tgpg"


@pytest.fixture(scope="module")
def pg_stack(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Stack]:
    postgres_or_skip()
    # Pool queue names are not namespaced: another Redis DB keeps the session stack's
    # workers off these jobs (and its control commands off these workers).
    redis_url = own_redis_url(redis_server, __name__, "2")
    with private_database("tidegate_e2e") as url:
        upgrade(url)
        store = Store(url)
        tenant_id, key = make_tenant(store, "pg-tenant", ["chat"])
        env = {**os.environ, "TIDEGATE_DATABASE_URL": url, "TIDEGATE_REDIS_URL": redis_url,
               "TIDEGATE_NAMESPACE": NAMESPACE}
        client = redis.Redis.from_url(redis_url)
        try:
            with running_stack(env, [WorkerSpec("chat", WORKER, cpus="1")],
                               tmp_root / "logs") as running:
                yield Stack(running.base_url, key, tenant_id, client, store, NAMESPACE,
                            {"chat": WORKER}, running.procs, broker_url=redis_url)
        finally:
            client.flushdb()
            store.engine.dispose()  # before the database is dropped


def test_streamed_tokens_match_the_row_postgres_stored(pg_stack: Stack) -> None:
    assert pg_stack.store.engine.dialect.name == "postgresql"
    events = e2e.consume(pg_stack, e2e.submit(pg_stack, "chat", max_tokens=24))
    assert [e.seq for e in events] == list(range(len(events)))
    tokens = [e for e in events if e.kind == "token"]
    job = pg_stack.store.jobs.get_job(events[0].job_id)
    assert job is not None and job.status == "done" and job.worker == WORKER
    assert job.output_text == "".join(e.text for e in tokens) != ""
    assert job.completion_tokens == sum(len(e.token_ids) for e in tokens) == 24


def test_row_and_done_event_carry_the_timings_on_postgres(pg_stack: Stack) -> None:
    e2e.test_job_row_and_done_event_carry_queue_wait_ttft_tpot(pg_stack)


def test_last_event_id_resumes_on_postgres(pg_stack: Stack) -> None:
    e2e.test_last_event_id_resumes_with_exactly_the_remainder(pg_stack)


def test_a_stream_dropped_mid_generation_resumes_on_postgres(pg_stack: Stack) -> None:
    sdk.test_a_stream_dropped_mid_generation_resumes_after_last_event_id(pg_stack, "header")


def test_the_sdk_resumes_a_live_stream_on_postgres(pg_stack: Stack) -> None:
    sdk.test_sync_stream_resumes_while_the_job_is_generating(pg_stack)


def test_delete_during_generation_on_postgres(pg_stack: Stack) -> None:
    e2e.check_delete_during_generation(pg_stack, "chat", 256)


def test_metrics_count_one_job_on_postgres(pg_stack: Stack) -> None:
    e2e.check_metrics_count_one_job(pg_stack, "chat")


def test_an_idempotent_replay_on_postgres_answers_the_same_job(pg_stack: Stack) -> None:
    jobs = pg_stack.store.jobs.count_jobs()
    with pg_stack.http() as http:
        body = {"lane": "chat", "messages": e2e.MESSAGES, "max_tokens": 4}
        first = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "pg-order-1"})
        again = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "pg-order-1"})
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json()["job_id"] == first.json()["job_id"]
    assert e2e.consume(pg_stack, first.json()["job_id"])[-1].kind == "done"
    assert pg_stack.store.jobs.count_jobs() == jobs + 1
    job = pg_stack.store.jobs.get_job(first.json()["job_id"])
    assert job is not None and job.status == "done" and job.attempts == 1
