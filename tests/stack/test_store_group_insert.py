"""Job rows of concurrent submits, inserted in one transaction (store/group_insert.py
`GroupInsert`, tests/unit/test_group_insert.py), against real SQLite and PostgreSQL: each
thread gets its own row back, committed, and a group whose rows set different columns
goes in as well."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import text

from store import Store, upgrade
from store.jobs import _queued_row
from tests.helpers import postgres_or_skip
from tidegate_tools.pg import private_database

THREADS = 8
SAMPLING: dict[str, Any] = {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": None,
                            "stop": []}


@pytest.fixture(scope="module", params=["sqlite",
                                        pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('group') / 'tidegate.db'}"
        upgrade(url)
        st = Store(url)
        yield st
        st.close()
        return
    postgres_or_skip()
    with private_database("tidegate_test_group_insert") as url:
        upgrade(url)
        st = Store(url)
        yield st
        st.close()


@pytest.fixture
def tenant_id(store: Store) -> int:
    with store.engine.begin() as conn:
        for table in ("webhook_deliveries", "api_keys", "sessions", "jobs", "usage", "tenants"):
            conn.execute(text(f"DELETE FROM {table}"))
    return store.tenants.create_tenant("acme", ["chat"])[0].id


def create(store: Store, tenant_id: int, n: int) -> Any:
    job_id = str(uuid.uuid4())
    payload = {"job_id": job_id, "prompt": f"prompt {n}", "turn": 0}
    return job_id, n, store.jobs.create_job(job_id, tenant_id, "chat", "chat.vllm", n % 10, None,
                                            SAMPLING, n, route_reason=f"reason {n}",
                                            payload=payload)


def test_concurrent_creates_each_get_their_own_committed_row(store: Store,
                                                             tenant_id: int) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        made = list(pool.map(lambda n: create(store, tenant_id, n), range(200)))
    for job_id, n, (job, created, turn) in made:
        assert created and turn == 0
        assert (job.id, job.prompt_tokens, job.priority, job.route_reason) == (
            job_id, n, n % 10, f"reason {n}")
        assert store.jobs.job_payload(job_id) == {"job_id": job_id, "prompt": f"prompt {n}",
                                                  "turn": 0}
    assert store.jobs.count_in_flight(tenant_id) == 200


def test_a_group_of_rows_with_different_columns_goes_in_whole(store: Store,
                                                              tenant_id: int) -> None:
    def row(lora: str | None, payload: bool) -> dict[str, Any]:
        job_id = str(uuid.uuid4())
        return _queued_row(job_id, tenant_id, "chat", "chat.vllm", 4, None, SAMPLING, 3, None,
                           lora, None, {"job_id": job_id} if payload else None)

    rows = [row(None, True), row("ad", True), row(None, True), row(None, False)]
    records = store.jobs._insert_jobs(rows)
    assert [r.id for r in records] == [r["id"] for r in rows]
    assert [r.lora for r in records] == [None, "ad", None, None]
    assert all(store.jobs.get_job(r["id"]) is not None for r in rows)
