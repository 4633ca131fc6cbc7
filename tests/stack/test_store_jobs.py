"""A job's life in the store, against real SQLite (a temporary file) and real PostgreSQL:
created (once per idempotency key, whatever the concurrency), claimed (again on a
redelivery, never once it ended or was stopped, each claim counted under concurrency),
its first token and end with their timings (a worker's end in one UPDATE; on PostgreSQL
the driver path, whatever the session's time zone, through a dropped connection or a
server that refuses them), cancelled queued or running, expired, and out of another
tenant's sight.

The fixtures and helpers are tests/stack/test_store.py's (the schema from the Alembic
migration), on databases of this module's own: a SQLite file and a PostgreSQL database.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import FrozenInstanceError
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import text

from store import FirstToken, JobRecord, Store, make_engine, upgrade
from store.webhooks import Webhooks
from tests.helpers import postgres_or_skip
from tests.stack import test_store
from tests.stack.test_store import THREADS, new_job, run_together
from tidegate.records import JobStatus
from tidegate_tools.pg import private_database

PG_DATABASE = "tidegate_test_store_jobs"  # not test_store.py's: a database of its own


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    postgres_or_skip()
    with private_database(PG_DATABASE) as url:
        yield url


# test_store.py's fixtures, under their names here: pytest makes a fixture of each module
# that holds one, so this module has instances of its own (a SQLite file of its own; on
# PostgreSQL, db_url migrates the pg_url above, the one its test sees).
db_url, store, tenant_id = test_store.db_url, test_store.store, test_store.tenant_id


def test_create_and_read_job(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id, session_id="s1")
    assert job.status == "queued" and job.attempts == 0 and not job.terminal
    assert job.enqueued_at.tzinfo is not None and job.enqueued_at.utcoffset() == timedelta(0)
    assert store.jobs.get_job(job.id) == job
    assert store.jobs.get_job("no-such-job") is None
    with pytest.raises(FrozenInstanceError):
        job.status = "done"  # type: ignore[misc]
    job.sampling["temperature"] = 2.0  # a record is a copy, not a view of the row
    assert store.jobs.get_job(job.id).sampling["temperature"] == 0.7  # type: ignore[union-attr]
    assert store.jobs.count_jobs() == 1 and store.jobs.count_jobs("queued") == 1
    assert store.jobs.delete_job(job.id) is True
    assert store.jobs.delete_job(job.id) is False
    assert store.jobs.count_jobs() == 0


def keyed_job(store: Store, tenant_id: int, key: str) -> tuple[JobRecord, bool]:
    job, created, _ = store.jobs.create_job(
        str(uuid.uuid4()), tenant_id, "chat", "lane.chat", 5, None, {}, 3, idempotency_key=key
    )
    return job, created


def test_idempotency_key(store: Store, tenant_id: int) -> None:
    first, created = keyed_job(store, tenant_id, "order-1")
    assert created
    again, created = keyed_job(store, tenant_id, "order-1")
    assert not created and again == first
    other_tenant = store.tenants.create_tenant("globex", ["chat"])[0].id
    theirs, created = keyed_job(store, other_tenant, "order-1")
    assert created and theirs.id != first.id
    assert new_job(store, tenant_id).id != new_job(store, tenant_id).id  # no key: always new


def test_concurrent_creates_with_one_key_make_one_job(store: Store, tenant_id: int) -> None:
    results = run_together(THREADS, lambda i: keyed_job(store, tenant_id, "burst"))
    assert sum(created for _, created in results) == 1
    assert len({job.id for job, _ in results}) == 1
    assert store.jobs.count_jobs() == 1


def test_claim_semantics(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id)
    claimed = store.runs.claim_job(job.id, "w1", "vllm")
    assert claimed is not None
    assert (claimed.status, claimed.attempts, claimed.worker, claimed.engine) == (
        "running",
        1,
        "w1",
        "vllm",
    )
    assert claimed.started_at is not None and claimed.started_at >= job.enqueued_at
    wait_ms = (claimed.started_at - job.enqueued_at).total_seconds() * 1000
    assert claimed.queue_wait_ms == pytest.approx(wait_ms, abs=0.01)

    # A redelivery after a worker death claims again but keeps the first start.
    again = store.runs.claim_job(job.id, "w2", "trtllm")
    assert again is not None
    assert (again.attempts, again.worker, again.engine) == (2, "w2", "trtllm")
    assert again.started_at == claimed.started_at
    assert again.queue_wait_ms == claimed.queue_wait_ms

    assert store.runs.end_job(job.id, JobStatus.DONE, completion_tokens=1, output_text="ok")[0]
    finished = store.jobs.get_job(job.id)
    assert store.runs.claim_job(job.id, "w3", "vllm") is None
    assert store.jobs.get_job(job.id) == finished  # nothing changed
    assert store.runs.claim_job("no-such-job", "w1", "vllm") is None

    for stop in (store.runs.cancel_job, store.runs.expire_job):
        stopped = new_job(store, tenant_id)
        stop(stopped.id)
        assert store.runs.claim_job(stopped.id, "w1", "vllm") is None
        assert store.jobs.get_job(stopped.id).attempts == 0  # type: ignore[union-attr]


def test_concurrent_claims_of_one_queued_job(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id)
    claims = run_together(THREADS, lambda i: store.runs.claim_job(job.id, f"w{i}", "vllm"))
    # No lost update: each delivery saw the previous one's count, and exactly one of
    # them moved the job out of queued (attempts == 1).
    assert sorted(c.attempts for c in claims) == list(range(1, THREADS + 1))
    assert len({c.started_at for c in claims}) == 1
    final = store.jobs.get_job(job.id)
    assert final is not None and final.attempts == THREADS and final.status == "running"


def test_claims_racing_a_cancel(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id)

    def act(i: int) -> Any:
        if i == 0:
            return store.runs.cancel_job(job.id)
        return store.runs.claim_job(job.id, f"w{i}", "vllm")

    results = run_together(THREADS + 1, act)
    claims = [c for c in results[1:] if c is not None]
    final = store.jobs.get_job(job.id)
    assert final is not None and final.status == "cancelled"
    # Claims after the cancel changed nothing; the ones before it each counted once.
    assert final.attempts == len(claims)
    assert sorted(c.attempts for c in claims) == list(range(1, len(claims) + 1))


def test_first_token_and_finish_timings(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id)
    started = store.runs.claim_job(job.id, "w1", "vllm")
    assert started is not None and started.started_at is not None
    first = started.started_at + timedelta(milliseconds=250)
    # A non-UTC aware time is the same instant once stored.
    assert store.runs.mark_first_token(job.id, first.astimezone(timezone(timedelta(hours=8))))
    assert not store.runs.mark_first_token(job.id, first + timedelta(seconds=5))  # first one wins
    end = first + timedelta(seconds=1)
    assert store.runs.end_job(
        job.id,
        JobStatus.DONE,
        finish_reason="stop",
        output_text="hello",
        completion_tokens=11,
        finished_at=end,
    )[0]
    done = store.jobs.get_job(job.id)
    assert done is not None
    assert done.first_token_at == first and done.first_token_at.tzinfo is not None
    assert done.ttft_ms == pytest.approx(250.0)
    assert done.tpot_ms == pytest.approx(100.0)  # 1000 ms over the 10 tokens after the first
    assert (
        done.status,
        done.finish_reason,
        done.output_text,
        done.completion_tokens,
        done.finished_at,
    ) == ("done", "stop", "hello", 11, end)
    assert not store.runs.end_job(job.id, JobStatus.ERROR, error="late")[0]  # terminal: unchanged
    assert store.jobs.get_job(job.id) == done

    single = new_job(store, tenant_id)
    store.runs.claim_job(single.id, "w1", "vllm")
    store.runs.mark_first_token(single.id, datetime.now(UTC))
    store.runs.end_job(single.id, JobStatus.DONE, completion_tokens=1)
    assert store.jobs.get_job(single.id).tpot_ms is None  # type: ignore[union-attr]

    with pytest.raises(ValueError, match="naive"):
        store.runs.mark_first_token(single.id, datetime.now())
    with pytest.raises(ValueError, match="terminal"):
        store.runs.end_job(single.id, JobStatus.RUNNING)


@pytest.mark.parametrize("callback_url", ["https://crm.example.com/hook", None])
def test_a_workers_end_in_one_update_writes_what_the_locked_read_does(
        store: Store, tenant_id: int, callback_url: str | None) -> None:
    """end_job given the first token's time (a worker that wrote it) ends a running job
    in one UPDATE: the same row as without it, its webhook (if it has one) in the outbox;
    a job cancelled meanwhile takes the locked read's way and stays cancelled."""
    rows = []
    for hint in (True, False):
        job = new_job(store, tenant_id, callback_url=callback_url)
        started = store.runs.claim_job(job.id, "w1", "vllm")
        assert started is not None and started.started_at is not None
        first = started.started_at + timedelta(milliseconds=250)
        assert store.runs.mark_first_token(job.id, first)
        end = first + timedelta(seconds=1)
        ended, row = store.runs.end_job(job.id, JobStatus.DONE, finish_reason="stop",
                                        output_text="hi", completion_tokens=11, finished_at=end,
                                        first_token_at=first if hint else None)
        assert ended and row == store.jobs.get_job(job.id)
        assert row is not None and row.tpot_ms == pytest.approx(100.0)
        assert len(Webhooks(store).of_job(job.id, tenant_id)) == (1 if callback_url else 0)
        rows.append(row)
    ignored = {"id", "enqueued_at", "started_at", "first_token_at", "finished_at",
               "queue_wait_ms", "ttft_ms"}
    same = [{k: v for k, v in vars(r).items() if k not in ignored} for r in rows]
    assert same[0] == same[1]

    running = new_job(store, tenant_id)
    store.runs.claim_job(running.id, "w1", "vllm")
    store.runs.cancel_job(running.id)
    ended, row = store.runs.end_job(running.id, JobStatus.DONE, completion_tokens=2,
                                    first_token_at=datetime.now(UTC))
    assert not ended and row is not None and row.status == "cancelled"
    assert row.completion_tokens == 2 and row.finished_at is not None


@pytest.mark.postgres
def test_the_driver_path_reads_rows_as_the_orm_does_whatever_the_time_zone(
        pg_url: str) -> None:
    """On PostgreSQL a job's claim, first token, end and read run on the driver itself
    (store/hot.py): the records they return are the ORM's, timestamps in UTC, even on a
    connection whose session time zone is not UTC."""
    upgrade(pg_url)
    st = Store(pg_url, connect_args={"options": "-c TimeZone=Asia/Tokyo"})
    try:
        tenant = st.tenants.create_tenant(f"tz-{uuid.uuid4().hex[:8]}", ["chat"])[0]
        job = new_job(st, tenant.id)
        claimed = st.runs.claim_job(job.id, "w1", "vllm")
        assert claimed is not None and claimed.started_at is not None
        assert claimed.started_at.utcoffset() == timedelta(0)
        assert claimed.queue_wait_ms == pytest.approx(
            (claimed.started_at - job.enqueued_at).total_seconds() * 1000, abs=0.01)
        assert st.runs.mark_first_token(job.id, claimed.started_at + timedelta(milliseconds=40),
                                        cached_tokens=3, started_at=claimed.started_at)
        ended, row = st.runs.end_job(job.id, JobStatus.DONE, completion_tokens=5,
                                     output_text="hello",
                                     first_token_at=claimed.started_at + timedelta(milliseconds=40))
        assert ended and row is not None and row.ttft_ms == pytest.approx(40.0)
        assert row == st.jobs.get_job(job.id) == st.jobs.jobs_of_tenant(tenant.id)[0]
    finally:
        st.close()


@pytest.mark.postgres
def test_a_connection_the_database_dropped_fails_one_call_then_the_pool_connects_anew(
        pg_url: str) -> None:
    """A pooled connection whose backend PostgreSQL ended (a restart, a failover) fails
    the call that finds it with OperationalError, which workers retry, and the next call
    runs on a new connection."""
    from sqlalchemy.exc import OperationalError

    upgrade(pg_url)
    st = Store(pg_url)
    try:
        tenant = st.tenants.create_tenant(f"drop-{uuid.uuid4().hex[:8]}", ["chat"])[0]
        job = new_job(st, tenant.id)
        assert st.jobs.get_job(job.id) is not None  # a pooled connection, used a moment ago
        with make_engine(pg_url).connect() as admin:
            ended = admin.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar()
        assert ended
        with pytest.raises(OperationalError):
            st.runs.claim_job(job.id, "w1", "vllm")
        claimed = st.runs.claim_job(job.id, "w1", "vllm")
        assert claimed is not None and claimed.attempts == 1
    finally:
        st.close()


@pytest.mark.postgres
def test_a_database_that_refuses_connections_fails_the_driver_path_as_sqlalchemy_does(
        pg_url: str) -> None:
    """A PostgreSQL that is down (restarting) fails a claim, an end and a read with
    SQLAlchemy's OperationalError, which workers retry (workers/retry.py), not the
    driver's, which they would take for a bug and end the job `internal`."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    from tidegate_tools.procs import free_port

    st = Store(make_url(pg_url).set(port=free_port()).render_as_string(hide_password=False))
    try:
        with pytest.raises(OperationalError):
            st.runs.claim_job(str(uuid.uuid4()), "w1", "vllm")
        with pytest.raises(OperationalError):
            st.runs.end_job(str(uuid.uuid4()), JobStatus.DONE, first_token_at=datetime.now(UTC))
        with pytest.raises(OperationalError):
            st.jobs.get_job(str(uuid.uuid4()))
    finally:
        st.close()


def test_a_first_token_that_came_with_the_end_is_written_by_the_end(
        store: Store, tenant_id: int) -> None:
    """A job whose first token came with its end (a 1-token job) gets its first token's
    time, TTFT and cached tokens from end_job, as mark_first_token would write them; a row
    that has a first token keeps it; a cancelled job's locked read writes it too."""
    job = new_job(store, tenant_id)
    started = store.runs.claim_job(job.id, "w1", "vllm")
    assert started is not None and started.started_at is not None
    first = started.started_at + timedelta(milliseconds=40)
    ended, row = store.runs.end_job(job.id, JobStatus.DONE, finish_reason="length", output_text="a",
                                    completion_tokens=1, finished_at=first,
                                    first_token=FirstToken(first, started.started_at, 7))
    assert ended and row is not None and row == store.jobs.get_job(job.id)
    assert row.first_token_at == first and row.ttft_ms == pytest.approx(40.0)
    assert row.cached_tokens == 7 and row.status == "done"

    marked = new_job(store, tenant_id)
    started = store.runs.claim_job(marked.id, "w1", "vllm")
    assert started is not None and started.started_at is not None
    earlier = started.started_at + timedelta(milliseconds=10)
    assert store.runs.mark_first_token(marked.id, earlier, 3, started.started_at)
    _, row = store.runs.end_job(marked.id, JobStatus.DONE, completion_tokens=2,
                                first_token=FirstToken(earlier + timedelta(seconds=1),
                                                       started.started_at, 9))
    assert row is not None and row.first_token_at == earlier and row.cached_tokens == 3

    cancelled = new_job(store, tenant_id)
    started = store.runs.claim_job(cancelled.id, "w1", "vllm")
    assert started is not None and started.started_at is not None
    store.runs.cancel_job(cancelled.id)
    at = started.started_at + timedelta(milliseconds=5)
    ended, row = store.runs.end_job(cancelled.id, JobStatus.DONE, completion_tokens=1,
                                    first_token=FirstToken(at, started.started_at))
    assert not ended and row is not None and row.status == "cancelled"
    assert row.first_token_at == at and row.ttft_ms == pytest.approx(5.0)


def test_cancel_queued_and_running(store: Store, tenant_id: int) -> None:
    queued = new_job(store, tenant_id)
    cancelled = store.runs.cancel_job(queued.id)
    assert cancelled is not None
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None

    running = new_job(store, tenant_id)
    store.runs.claim_job(running.id, "w1", "vllm")
    stopped = store.runs.cancel_job(running.id)
    assert stopped is not None and stopped.status == "cancelled" and stopped.finished_at is None
    # The worker notices late: its finish fills usage and output, the status stays.
    assert not store.runs.end_job(
        running.id, JobStatus.DONE, finish_reason="abort", output_text="par", completion_tokens=2
    )[0]
    after = store.jobs.get_job(running.id)
    assert after is not None
    assert (after.status, after.output_text, after.completion_tokens, after.finish_reason) == (
        "cancelled",
        "par",
        2,
        "abort",
    )
    assert after.finished_at is not None
    assert store.runs.cancel_job(running.id) == after  # terminal: returned unchanged
    assert store.runs.cancel_job("no-such-job") is None


def test_expire(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id)
    assert store.runs.expire_job(job.id)
    assert not store.runs.expire_job(job.id)
    expired = store.jobs.get_job(job.id)
    assert expired is not None and expired.status == "expired" and expired.finished_at


def test_other_tenant_cannot_see_or_cancel(store: Store, tenant_id: int) -> None:
    job = new_job(store, tenant_id)
    other = store.tenants.create_tenant("globex", ["chat"])[0].id
    assert store.jobs.get_job(job.id, tenant_id=other) is None
    assert store.runs.cancel_job(job.id, tenant_id=other) is None
    assert store.jobs.get_job(job.id, tenant_id=tenant_id) == job  # unchanged
