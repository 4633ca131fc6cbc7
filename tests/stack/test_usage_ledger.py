"""The usage ledger in the store (store/usage.py), on SQLite and PostgreSQL: every way a
job ends (a worker's end in one statement, with and without a webhook, the locked read's
way, a cancel in the queue, a cancel while running, an expiry while running whose worker
fills in the usage after) adds to its tenant's day exactly what its row holds; a retried
end adds nothing; the month's tokens read back for the budget."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from store import Store
from store.usage import Usage
from tests.stack.test_store import db_url, pg_url  # noqa: F401 - the fixtures, shared
from tidegate.records import JobStatus

KINDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "jobs_done", "jobs_error",
         "jobs_cancelled", "jobs_expired")


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:  # noqa: F811 - the fixture imported above
    st = Store(db_url)
    with st.engine.begin() as conn:
        for table in ("webhook_attempts", "webhook_deliveries", "webhook_secrets", "api_keys",
                      "batches", "files", "sessions", "jobs", "usage", "tenants"):
            conn.execute(text(f"DELETE FROM {table}"))
    yield st
    st.close()


def new_job(store: Store, tenant_id: int, prompt_tokens: int = 10,
            callback_url: str | None = None) -> str:
    job_id = str(uuid.uuid4())
    store.jobs.create_job(job_id, tenant_id, "chat", "chat.vllm", 4, None, {"max_tokens": 64},
                          prompt_tokens, callback_url=callback_url)
    return job_id


def ledger(store: Store, tenant_id: int) -> dict[str, int]:
    today = datetime.now(UTC).date()
    rows = Usage(store).days(today - timedelta(days=1), today + timedelta(days=1), tenant_id)
    return {k: sum(getattr(r, k) for r in rows) for k in KINDS}


def from_rows(store: Store, tenant_id: int) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for job in store.jobs.list_jobs(tenant_id):
        if job.finished_at is None:
            continue
        out["prompt_tokens"] += job.prompt_tokens if job.started_at is not None else 0
        out["cached_tokens"] += job.cached_tokens or 0
        out["completion_tokens"] += job.completion_tokens or 0
        out[f"jobs_{job.status.value}"] += 1
    return out


def test_every_way_a_job_ends_adds_exactly_its_row(store: Store) -> None:
    tenant, _ = store.tenants.create_tenant("ledger", ["chat"])
    t = tenant.id
    # A worker's usual end: one statement (PostgreSQL: with its ledger row, one CTE).
    done = new_job(store, t, prompt_tokens=10)
    started = store.runs.claim_job(done, "w1", "vllm")
    assert started is not None and store.runs.mark_first_token(done, datetime.now(UTC), 4,
                                                               started.started_at)
    end = datetime.now(UTC)
    first = store.jobs.get_job(done)
    assert first is not None
    assert store.runs.end_job(done, JobStatus.DONE, completion_tokens=7, finished_at=end,
                              first_token_at=first.first_token_at)[0]
    assert ledger(store, t) == {**dict.fromkeys(KINDS, 0), "prompt_tokens": 10,
                                "cached_tokens": 4, "completion_tokens": 7, "jobs_done": 1}
    # Retried with the same finished_at (its reply lost): nothing more.
    assert store.runs.end_job(done, JobStatus.DONE, completion_tokens=7, finished_at=end,
                              first_token_at=first.first_token_at)[0]
    assert ledger(store, t)["completion_tokens"] == 7 and ledger(store, t)["jobs_done"] == 1

    hooked = new_job(store, t, prompt_tokens=5, callback_url="https://crm.example.com/h")
    store.runs.claim_job(hooked, "w1", "vllm")
    store.runs.end_job(hooked, JobStatus.ERROR, completion_tokens=2, error="boom",
                       first_token_at=datetime.now(UTC))  # the webhook's way: the SQL path
    locked = new_job(store, t, prompt_tokens=6)
    store.runs.claim_job(locked, "w1", "vllm")
    # no first token: the locked read
    store.runs.end_job(locked, JobStatus.DONE, completion_tokens=3)
    queued = new_job(store, t, prompt_tokens=50)
    store.runs.cancel_job(queued)  # never taken: a job, no tokens
    running = new_job(store, t, prompt_tokens=8)
    store.runs.claim_job(running, "w1", "vllm")
    store.runs.cancel_job(running)  # not ended yet: its worker ends it
    assert ledger(store, t)["jobs_cancelled"] == 1
    store.runs.end_job(running, JobStatus.DONE, completion_tokens=9,
                       first_token_at=datetime.now(UTC))
    expiring = new_job(store, t, prompt_tokens=12)
    store.runs.claim_job(expiring, "w1", "vllm")
    assert store.runs.expire_job(expiring)  # ended here, with its prompt tokens
    assert ledger(store, t)["jobs_expired"] == 1
    store.runs.end_job(expiring, JobStatus.EXPIRED, completion_tokens=5,
                       first_token_at=datetime.now(UTC))  # its worker fills in what it made
    assert ledger(store, t) == from_rows(store, t)
    assert ledger(store, t) == {"prompt_tokens": 10 + 5 + 6 + 8 + 12, "cached_tokens": 4,
                                "completion_tokens": 7 + 2 + 3 + 9 + 5, "jobs_done": 2,
                                "jobs_error": 1, "jobs_cancelled": 2, "jobs_expired": 1}
    month = datetime.now(UTC).date().replace(day=1)
    assert Usage(store).tokens_since(t, month) == 41 + 26
    other, _ = store.tenants.create_tenant("ledger-other", ["chat"])
    assert Usage(store).tokens_since(other.id, month) == 0
