"""The store against real SQLite (a temporary file) and real PostgreSQL: the migration,
tenants and their keys, sessions, and an in-memory SQLite used from threads. A job's life
in the store (create, claim, first token, end, cancel, expire) is
tests/stack/test_store_jobs.py, on these fixtures and helpers, with databases of its own.

The schema comes from the Alembic migration (store.upgrade), not from create_all, so
these tests also check that the migration and the models agree.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Index, MetaData, text

from store import (
    Base,
    JobRecord,
    Store,
    TenantExistsError,
    alembic_config,
    make_engine,
    upgrade,
)
from tests.helpers import postgres_or_skip
from tidegate_tools.pg import private_database

PG_DATABASE = "tidegate_test_store"
THREADS = 8


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    postgres_or_skip()
    with private_database(PG_DATABASE) as url:
        yield url


@pytest.fixture(
    scope="session",
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
)
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'tidegate.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    # From an unrelated cwd: the migrations must be found relative to the package.
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        upgrade(url)
    return url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    st = Store(db_url)
    with st.engine.begin() as conn:
        for table in ("webhook_attempts", "webhook_deliveries", "webhook_secrets", "api_keys",
                      "batches", "files", "sessions", "jobs", "usage", "tenants"):
            conn.execute(text(f"DELETE FROM {table}"))
    yield st
    st.close()


@pytest.fixture
def tenant_id(store: Store) -> int:
    return store.tenants.create_tenant("acme", ["chat", "finance"])[0].id


def new_job(store: Store, tenant_id: int, **kw: Any) -> JobRecord:
    args: dict[str, Any] = {
        "job_id": str(uuid.uuid4()),
        "tenant_id": tenant_id,
        "lane": "chat",
        "queue": "lane.chat",
        "priority": 5,
        "session_id": None,
        "sampling": {"temperature": 0.7, "max_tokens": 32},
        "prompt_tokens": 12,
    }
    args.update(kw)
    return store.jobs.create_job(**args)[0]


def run_together(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0..n-1) on n threads released at the same instant."""
    barrier = threading.Barrier(n)

    def call(i: int) -> Any:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(call, range(n)))


# -- migration -----------------------------------------------------------------------


def _diff(url: str, metadata: MetaData) -> list[Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def test_migration_matches_models(db_url: str) -> None:
    assert _diff(db_url, Base.metadata) == []
    # The comparison is sensitive: an index the migration lacks shows up.
    changed = MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(changed)
    Index("ix_jobs_lane", changed.tables["jobs"].c.lane)
    assert [d[0] for d in _diff(db_url, changed)] == ["add_index"]


def test_upgrade_is_at_head_and_repeatable(db_url: str) -> None:
    upgrade(db_url)  # a second run is a no-op
    head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == head == "0017"
    engine.dispose()


# -- tenants -------------------------------------------------------------------------


def test_tenant_key_round_trip_and_revoke(store: Store) -> None:
    tenant, key = store.tenants.create_tenant("acme", ["chat", "finance"])
    assert key.startswith("tg_") and len(key) > 40
    assert tenant.lanes == ("chat", "finance") and tenant.active
    assert store.tenants.tenant_by_key(key) == tenant
    assert store.tenants.tenant_by_key(key + "x") is None
    with store.engine.connect() as conn:
        stored = conn.execute(text("SELECT key_hash FROM api_keys")).scalar_one()
    assert stored == hashlib.sha256(key.encode()).hexdigest()  # the key itself is not stored

    with pytest.raises(TenantExistsError, match="acme") as err:
        store.tenants.create_tenant("acme", ["chat"])
    assert isinstance(err.value, ValueError)

    other, other_key = store.tenants.create_tenant("globex", ["chat"])
    assert store.tenants.revoke_tenant("acme") is True
    assert store.tenants.tenant_by_key(key) is None
    assert store.tenants.revoke_tenant("acme") is False
    assert store.tenants.revoke_tenant("nobody") is False
    assert store.tenants.tenant_by_key(other_key) == other
    listed = store.tenants.list_tenants()
    assert [t.name for t in listed] == ["acme", "globex"]
    assert listed[0].revoked_at is not None and not listed[0].active


# -- sessions ------------------------------------------------------------------------


def test_session_turns(store: Store, tenant_id: int) -> None:
    touch = store.sessions.touch_session
    assert [touch("s1", tenant_id, w) for w in ("w1", None, "w2")] == [1, 2, 3]
    chat = store.sessions.get_session("s1", tenant_id)
    assert chat is not None and (chat.turns, chat.last_worker) == (3, "w2")
    assert chat.last_seen.tzinfo is not None
    assert store.sessions.touch_session("s1", tenant_id, None) == 4
    assert store.sessions.get_session("s1", tenant_id).last_worker == "w2"  # type: ignore[union-attr]
    assert store.sessions.get_session("nope", tenant_id) is None

    # Another tenant's session of the same id is another session (keyed by tenant and id).
    other = store.tenants.create_tenant("globex", ["chat"])[0].id
    assert store.sessions.get_session("s1", other) is None
    assert store.sessions.touch_session("s1", other, "w9") == 1
    store.sessions.set_session_worker("s1", other, "w8")
    assert store.sessions.get_session("s1", other).last_worker == "w8"  # type: ignore[union-attr]
    mine = store.sessions.get_session("s1", tenant_id)
    assert mine is not None and (mine.turns, mine.last_worker) == (4, "w2")


def test_a_job_and_its_session_turn_are_written_together(store: Store, tenant_id: int) -> None:
    def create(tenant: int, key: str | None = None) -> tuple[JobRecord, bool, int]:
        return store.jobs.create_job(str(uuid.uuid4()), tenant, "chat", "lane.chat", 5, "s1", {}, 3,
                                     idempotency_key=key)

    job, created, turn = create(tenant_id, "k1")
    assert created and turn == 1 and job.session_id == "s1"
    assert create(tenant_id)[1:] == (True, 2)
    again, created, turn = create(tenant_id, "k1")  # a key used meanwhile: no turn counted
    assert (again.id, created, turn) == (job.id, False, 0)
    assert store.sessions.get_session("s1", tenant_id).turns == 2  # type: ignore[union-attr]
    assert store.jobs.create_job(str(uuid.uuid4()), tenant_id, "chat", "lane.chat", 5, None, {},
                                 3)[1:] == (True, 0)

    # Another tenant's "s1" is a session of its own: its first turn, ours unchanged.
    other = store.tenants.create_tenant("globex", ["chat"])[0].id
    theirs, created, turn = create(other, "theirs")
    assert created and turn == 1 and theirs.tenant_id == other
    assert store.jobs.count_jobs() == 4 and store.sessions.get_session("s1", tenant_id).turns == 2  # type: ignore[union-attr]


def test_concurrent_session_turns(store: Store, tenant_id: int) -> None:
    turns = run_together(THREADS,
                         lambda i: store.sessions.touch_session("busy", tenant_id, f"w{i}"))
    assert sorted(turns) == list(range(1, THREADS + 1))


# -- in-memory SQLite ----------------------------------------------------------------


def test_in_memory_sqlite_from_threads() -> None:
    st = Store("sqlite://")
    st.create_schema()
    tid = st.tenants.create_tenant("acme", ["chat"])[0].id
    job = new_job(st, tid)
    claims = run_together(4, lambda i: st.runs.claim_job(job.id, f"w{i}", "vllm"))
    assert sorted(c.attempts for c in claims) == [1, 2, 3, 4]
    st.close()
