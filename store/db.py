"""The Store: every read and write of tenants, jobs and chat sessions.

Methods open a short transaction each and return frozen records (store.records), so one
Store is shared by all threads of a process. On PostgreSQL the statements every job runs
(claim, first token, end, insert, reads by id and key) are single statements, run in
autocommit on the driver itself (store/hot.py; a group of inserts is one transaction).
Job state changes that can race (claim, first token, finish, cancel) are single UPDATEs
guarded by the current status, or run under a row lock (PostgreSQL) / the database write
lock (SQLite).
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    Connection,
    Table,
    bindparam,
    delete,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, defer, sessionmaker

if TYPE_CHECKING:
    from alembic.config import Config

from store.engine import (
    CONNECT_TIMEOUT_S,
    STATEMENT_TIMEOUT_S,
    WRITE_OPTION,
    is_sqlite_memory,
    make_engine,
    normalize_url,
)
from store.hot import HotStatements
from store.models import (
    ACTIVE_STATUSES,
    CANCELLED,
    EXPIRED,
    QUEUED,
    RUNNING,
    TERMINAL_STATUSES,
    ApiKey,
    Base,
    ChatSession,
    Job,
    Tenant,
    TrafficSample,
    UTCDateTime,
    WebhookDelivery,
)
from store.records import (
    JOB_FIELDS,
    JobRecord,
    SessionRecord,
    TenantExistsError,
    TenantRecord,
    TrafficRecord,
    job_record,
    row_job_record,
    session_record,
    tenant_record,
)
from store.usage import meter, metered_end

# Resolved from this file, so it works from any cwd and from an installed package.
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
API_KEY_PREFIX = "tg_"
KEY_USE_RESOLUTION = timedelta(minutes=1)  # a key's last_used_at is this precise
# Jobs stopped from outside while a worker may still be generating: the worker's finish
# fills in usage and output but does not change the status.
_STOPPED = frozenset({CANCELLED, EXPIRED})


def utcnow() -> datetime:
    return datetime.now(UTC)


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def alembic_config(url: str) -> Config:
    # Alembic is imported here, not at the top: every process imports the store, only
    # `tidegate db upgrade` migrates, and its import is a seventh of a restarted API's
    # start (which is how long its streams wait).
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    rendered = normalize_url(url).render_as_string(hide_password=False)
    # The config is a ConfigParser: a literal % (in an encoded password) must be doubled.
    config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Run the Alembic migrations on the database at url."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def _aware(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError("naive datetime: pass a timezone-aware datetime")
    return at.astimezone(UTC)


def _ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds() * 1000.0


@dataclass(frozen=True)
class FirstToken:
    """A job's first token, not yet in its row: written with the job's end (end_job)."""

    at: datetime
    started_at: datetime | None  # the row's, from the claim: the TTFT's start
    cached_tokens: int | None = None

    def values(self) -> dict[str, Any]:
        at = _aware(self.at)
        return {"first_at": at, "ttft": _ms(self.started_at, at), "cached": self.cached_tokens}


_NO_FIRST_TOKEN: dict[str, Any] = {"first_at": None, "ttft": None, "cached": None}


def _same_end(job: Mapping[str, Any], status: str, end: datetime) -> bool:
    """Whether the row already holds this end: its status, written at `end`."""
    return job["status"] == status and job["finished_at"] == end


def _end_locked(conn: Connection, job: dict[str, Any], status: str, end: datetime,
                values: dict[str, Any], first: dict[str, Any]) -> tuple[bool, JobRecord]:
    """Store.end_job on the row read locked (`job`, its columns): (whether this call moved
    it to `status`, the row as it then is)."""
    if _same_end(job, status, end):
        return True, row_job_record(job)
    if job["status"] in TERMINAL_STATUSES and job["status"] not in _STOPPED:
        return False, row_job_record(job)
    was_open = job["finished_at"] is None
    active = job["status"] in ACTIVE_STATUSES
    before = dict(job)
    changes: dict[str, Any] = {name: value for name, value in values.items()
                               if value is not None and (active or job[name] is None)}
    if job["first_token_at"] is None and first["first_at"] is not None:
        changes.update(first_token_at=first["first_at"], ttft_ms=first["ttft"],
                       cached_tokens=first["cached"])
    job.update(changes)
    if job["tpot_ms"] is None:
        changes["tpot_ms"] = _tpot_ms(job["first_token_at"], end, job["completion_tokens"])
    changes["payload"] = None
    if active:
        changes["status"] = status
    job.update(changes)
    conn.execute(update(_JOBS).where(_JOBS.c.id == job["id"]).values(**changes))
    meter(conn, before, job)  # the usage ledger, in the end's transaction (store/usage.py)
    if was_open and job["callback_url"]:
        conn.execute(insert(_WEBHOOK_DELIVERIES).values(
            **_webhook_outbox_row(job["id"], job["tenant_id"], job["callback_url"])))
    return active, row_job_record(job)


def _tpot_ms(
    first_token_at: datetime | None, finished_at: datetime, tokens: int | None
) -> float | None:
    """Time per output token after the first one."""
    span = _ms(first_token_at, finished_at)
    if span is None or tokens is None or tokens <= 1:
        return None
    return span / (tokens - 1)


def _queued_row(job_id: str, tenant_id: int, lane: str, queue: str, priority: int,
                session_id: str | None, sampling: dict[str, Any], prompt_tokens: int,
                idempotency_key: str | None, lora: str | None,
                route_reason: str | None, payload: dict[str, Any] | None,
                callback_url: str | None = None, trace_id: str | None = None) -> dict[str, Any]:
    """A queued job's INSERT parameters (a column left out takes its default). A dict, not
    a Job: building the ORM object, then reading it back, cost 2% of a submit's CPU."""
    row = {
        "id": job_id, "tenant_id": tenant_id, "lane": lane, "queue": queue,
        "priority": priority, "session_id": session_id, "status": QUEUED,
        "idempotency_key": idempotency_key, "sampling": dict(sampling),
        "prompt_tokens": prompt_tokens, "enqueued_at": utcnow(), "attempts": 0, "lora": lora,
        "route_reason": route_reason, "payload": dict(payload) if payload is not None else None,
        "callback_url": callback_url, "trace_id": trace_id,
    }
    return {name: value for name, value in row.items() if value is not None}


class _GroupInsert:
    """Job rows that concurrent threads insert at once (the API's submits, on its admission
    threads), written in one transaction: a thread that finds no write under way writes
    its row at once; rows that come while one is under way wait for it and go together in
    the next, written by the first of them. A row is committed before `insert` returns.
    On PostgreSQL a transaction of one row cost 0.57 ms of the API's CPU, one of 2 rows
    0.37 ms a row, of 4 rows 0.23 ms a row (each a transaction and its round trips: begin,
    the statement, commit), measured through SQLAlchemy; on the driver (store/hot.py) a
    group of one is a single statement in autocommit. When a group fails on a row of its
    own (a constraint, bad data), each of its rows is written alone, so the failure is that
    row's only."""

    def __init__(self, write: Callable[[list[dict[str, Any]]], list[JobRecord]]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._waiting: list[_Row] = []
        self._writing = False  # a thread is writing a group

    def insert(self, values: dict[str, Any]) -> JobRecord:
        mine = _Row(values)
        with self._lock:
            self._waiting.append(mine)
            leads, self._writing = not self._writing, True
        if not leads:
            mine.woken.wait()  # written by another thread, or this one's turn to write
        if not mine.settled:
            self._write_group()
        return mine.outcome()

    def _write_group(self) -> None:
        with self._lock:
            group, self._waiting = self._waiting, []
        results: list[JobRecord | Exception] = [_INTERRUPTED] * len(group)
        try:
            results = self._results(group)
        finally:
            _settle(group, results)
            with self._lock:
                following = self._waiting[0] if self._waiting else None
                self._writing = following is not None
            for row in group:
                row.woken.set()
            if following is not None:
                following.woken.set()  # the first row that came meanwhile writes the next

    def _results(self, group: list[_Row]) -> list[JobRecord | Exception]:
        try:
            return list(self._write([row.values for row in group]))
        except OperationalError as exc:  # the database, not a row: every row's error
            return [exc] * len(group)
        except Exception as exc:
            if len(group) == 1:
                return [exc]
            return [self._write_alone(row.values) for row in group]

    def _write_alone(self, values: dict[str, Any]) -> JobRecord | Exception:
        try:
            return self._write([values])[0]
        except Exception as exc:  # noqa: BLE001 - handed to the row's own thread
            return exc


_INTERRUPTED = RuntimeError("the thread writing this job's group was interrupted")


class _Row:
    """One thread's row in a _GroupInsert."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.woken = threading.Event()
        self.settled = False
        self.result: JobRecord | Exception | None = None

    def outcome(self) -> JobRecord:
        if isinstance(self.result, Exception):
            raise self.result
        assert self.result is not None
        return self.result


def _settle(group: list[_Row], results: list[JobRecord | Exception]) -> None:
    for row, result in zip(group, results, strict=True):
        row.result, row.settled = result, True


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def _ended(session: Session, job: Job) -> None:
    """The job's end is written (its finished_at, for the first time): its webhook, if it
    has one, goes into the outbox in the same transaction, so an ended job's webhook is
    never lost and never sent for a job that did not end (tasks/webhooks.py sends it)."""
    if job.callback_url:
        session.add(WebhookDelivery(**_webhook_outbox_row(job.id, job.tenant_id,
                                                          job.callback_url)))


def _webhook_outbox_row(job_id: str, tenant_id: int, url: str) -> dict[str, Any]:
    now = utcnow()
    return {"id": f"msg_{secrets.token_hex(12)}", "job_id": job_id, "tenant_id": tenant_id,
            "url": url, "status": "pending", "attempts": 0, "next_attempt_at": now,
            "created_at": now}


_JOBS = cast(Table, Job.__table__)
_WEBHOOK_DELIVERIES = cast(Table, WebhookDelivery.__table__)
_JOB_COLUMNS = tuple(_JOBS.c[name] for name in JOB_FIELDS)
# Built once: building a statement cost as much CPU as running it.
_BY_ID = _JOBS.c.id == bindparam("job_id")
_SELECT_JOB = select(*_JOB_COLUMNS).where(_BY_ID)
_SELECT_BY_KEY = select(*_JOB_COLUMNS).where(_JOBS.c.tenant_id == bindparam("tenant_id"),
                                             _JOBS.c.idempotency_key == bindparam("key"))
_SELECT_ENQUEUED_AT = select(_JOBS.c.enqueued_at).where(_BY_ID)
_SELECT_STARTED_AT = select(_JOBS.c.started_at).where(_BY_ID)
# The statuses a worker may move a job on from, written out (no expanding IN list: the
# statements run as compiled once, store/hot.py).
_ACTIVE = _JOBS.c.status.in_([literal_column(f"'{status}'") for status in
                              sorted(ACTIVE_STATUSES)])
_NOW = bindparam("now", type_=UTCDateTime())


def _claim(wait_ms: Any) -> Any:
    return (
        update(_JOBS)
        .where(_BY_ID, _ACTIVE)
        .values(
            status=RUNNING,
            started_at=func.coalesce(_JOBS.c.started_at, _NOW),
            queue_wait_ms=func.coalesce(_JOBS.c.queue_wait_ms, wait_ms),
            worker=bindparam("by_worker"),
            engine=bindparam("by_engine"),
            attempts=_JOBS.c.attempts + 1,
        )
        .returning(*_JOB_COLUMNS)
    )


_CLAIM = _claim(bindparam("wait_ms"))
# PostgreSQL: the wait from the row's enqueued_at, in the same UPDATE (no SELECT first).
_CLAIM_AT_ONCE = _claim(func.extract("epoch", _NOW - _JOBS.c.enqueued_at) * 1000)
_FIRST_TOKEN = (
    update(_JOBS)
    .where(_BY_ID, _JOBS.c.first_token_at.is_(None))
    .values(first_token_at=bindparam("at", type_=UTCDateTime()), ttft_ms=bindparam("ttft"),
            cached_tokens=bindparam("cached"))
)
_INSERT_JOB = insert(_JOBS).returning(*_JOB_COLUMNS)


@functools.lru_cache(maxsize=64)
def _insert_of(columns: tuple[str, ...]) -> Any:
    """The job INSERT of these columns (a queued row leaves out those it has no value
    for), built once per set."""
    return insert(_JOBS).values({name: bindparam(name, type_=_JOBS.c[name].type)
                                 for name in columns}).returning(*_JOB_COLUMNS)


def _given(name: str, column: Any) -> Any:
    """The parameter `name` where given, else the column's value."""
    return func.coalesce(bindparam(name, type_=column.type), column)


_END_RUNNING = (
    update(_JOBS)
    .where(_BY_ID, _ACTIVE)
    .values(
        status=bindparam("to_status"),
        finished_at=bindparam("finished_at", type_=UTCDateTime()),
        finish_reason=_given("finish_reason", _JOBS.c.finish_reason),
        output_text=_given("output_text", _JOBS.c.output_text),
        completion_tokens=_given("completion_tokens", _JOBS.c.completion_tokens),
        error=_given("error", _JOBS.c.error),
        tpot_ms=_given("tpot", _JOBS.c.tpot_ms),
        payload=null(),
        # A first token the worker did not write before (it came with the end): the row's
        # own, where it has one, is kept (mark_first_token: only the first counts).
        first_token_at=func.coalesce(_JOBS.c.first_token_at,
                                     bindparam("first_at", type_=UTCDateTime())),
        ttft_ms=func.coalesce(_JOBS.c.ttft_ms, bindparam("ttft", type_=_JOBS.c.ttft_ms.type)),
        cached_tokens=func.coalesce(_JOBS.c.cached_tokens,
                                    bindparam("cached", type_=_JOBS.c.cached_tokens.type)),
    )
    .returning(*_JOB_COLUMNS)
)
# The usual end, of a job with no webhook to put in the outbox with it: one statement,
# with its usage ledger row (PostgreSQL: a data-modifying CTE, store/usage.py).
_END_RUNNING_ALONE = metered_end(_END_RUNNING.where(_JOBS.c.callback_url.is_(None)))
_COUNT_IN_FLIGHT = (select(func.count()).select_from(_JOBS)
                    .where(_JOBS.c.tenant_id == bindparam("tenant_id"),
                           _JOBS.c.status.in_(ACTIVE_STATUSES)))


class Store:
    def __init__(self, url: str, *, connect_timeout_s: int = CONNECT_TIMEOUT_S,
                 statement_timeout_s: float = STATEMENT_TIMEOUT_S, **engine_options: Any) -> None:
        """The store at `url`. On PostgreSQL a connection that cannot be made within
        `connect_timeout_s`, or a statement running longer than `statement_timeout_s` (0:
        no bound), fails with OperationalError (store/engine.py)."""
        self.url = normalize_url(url)
        self.engine = make_engine(self.url, connect_timeout_s=connect_timeout_s,
                                  statement_timeout_s=statement_timeout_s, **engine_options)
        self.sessionmaker = sessionmaker(self.engine, expire_on_commit=False)
        self._write_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._write_sessions = sessionmaker(self._write_engine, expire_on_commit=False)
        # In-memory SQLite is one shared connection: it can hold one transaction at a time.
        self._serial: AbstractContextManager[Any] = (
            threading.Lock() if is_sqlite_memory(self.url) else nullcontext()
        )
        # SQLite has one writer at a time. Threads of this process queue on a lock, in
        # order, instead of in SQLite's busy handler, which sleeps in growing steps and
        # turned a 64-job burst's writes into waits of seconds.
        sqlite_file = self.url.get_backend_name() == "sqlite" and not is_sqlite_memory(self.url)
        self._writer: AbstractContextManager[Any] = (
            threading.Lock() if sqlite_file else nullcontext()
        )
        self._group_insert = _GroupInsert(self._insert_jobs)  # create_job's common case
        # PostgreSQL: the statements every job runs, on the driver itself (store/hot.py).
        self._hot = HotStatements(self.engine) if HotStatements.serves(self.engine) else None

    def close(self) -> None:
        self.engine.dispose()

    def create_schema(self) -> None:
        """Create the tables without migrations (tests)."""
        Base.metadata.create_all(self.engine)

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._serial, self.sessionmaker() as session:
            yield session

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._writer, self._serial, self._write_sessions.begin() as session:
            yield session

    # The paths every job takes (a worker's claim, first token and end; a submit's count
    # and read) run on Core connections: the ORM session cost 2-3x the CPU of the same
    # statements (bench/README.md, "Where the time goes").
    @contextmanager
    def _read_conn(self) -> Iterator[Connection]:
        with self._serial, self.engine.connect() as conn:
            yield conn

    @contextmanager
    def _write_conn(self) -> Iterator[Connection]:
        with self._writer, self._serial, self._write_engine.begin() as conn:
            yield conn

    # -- tenants ---------------------------------------------------------------------

    def create_tenant(self, name: str, lanes: list[str], requests_per_minute: int | None = None,
                      tokens_per_minute: int | None = None,
                      max_priority: int | None = None) -> tuple[TenantRecord, str]:
        """Create a tenant; returns its record and its API key (only the hash is stored).
        max_priority: the most its jobs may ask (None: each lane's default priority)."""
        if not name:
            raise ValueError("tenant name is empty")
        api_key = new_api_key()
        tenant = Tenant(
            name=name, lanes=list(lanes), created_at=utcnow(),
            requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
            max_priority=max_priority,
        )
        try:
            with self._write() as session:
                session.add(tenant)
                session.flush()
                session.add(ApiKey(tenant_id=tenant.id, name="default",
                                   key_hash=hash_key(api_key), created_at=tenant.created_at))
                record = tenant_record(tenant)
        except IntegrityError as exc:
            raise TenantExistsError(name) from exc
        return record, api_key

    def tenant_by_key(self, api_key: str) -> TenantRecord | None:
        """The active tenant holding api_key; None when the key is unknown, revoked or
        expired, or its tenant revoked. Notes the key's use (at most once a minute)."""
        now = utcnow()
        stmt = (select(Tenant, ApiKey).join(ApiKey, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.key_hash == hash_key(api_key), ApiKey.revoked_at.is_(None),
                       or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
                       Tenant.revoked_at.is_(None)))
        with self._read() as session:
            row = session.execute(stmt).one_or_none()
            if row is None:
                return None
            tenant, key = row
            record, key_id, used = tenant_record(tenant), key.id, key.last_used_at
        if used is None or now - used > KEY_USE_RESOLUTION:
            with self._write() as session:
                session.execute(update(ApiKey).where(ApiKey.id == key_id)
                                .values(last_used_at=now))
        return record

    def list_tenants(self) -> list[TenantRecord]:
        with self._read() as session:
            return [tenant_record(t) for t in session.scalars(select(Tenant).order_by(Tenant.id))]

    def revoke_tenant(self, name: str) -> bool:
        """Revoke a tenant's key; False when unknown or already revoked."""
        stmt = (
            update(Tenant)
            .where(Tenant.name == name, Tenant.revoked_at.is_(None))
            .values(revoked_at=utcnow())
            .returning(Tenant.id)
        )
        with self._write() as session:
            return session.scalar(stmt) is not None

    # -- jobs ------------------------------------------------------------------------

    def create_job(
        self,
        job_id: str,
        tenant_id: int,
        lane: str,
        queue: str,
        priority: int,
        session_id: str | None,
        sampling: dict[str, Any],
        prompt_tokens: int,
        idempotency_key: str | None = None,
        lora: str | None = None,
        route_reason: str | None = None,
        payload: dict[str, Any] | None = None,
        callback_url: str | None = None,
        trace_id: str | None = None,
    ) -> tuple[JobRecord, bool, int]:
        """Write a queued job and count its session's turn (0 without a session) in one
        transaction; returns (job, created, turn).

        payload: the task's JSON form (tasks.payloads), kept with the row until the job
        ends so that a message Redis lost can be sent again; its "turn" is set to the
        turn counted here, in the same transaction.

        With an idempotency key this tenant already used, that job comes back with
        created=False and turn 0, and no turn is counted. The session is the tenant's
        (session_id names it within the tenant: store/models.py ChatSession).

        trace_id: the submit's OpenTelemetry trace (tidegate/tracing.py), None if untraced.
        """
        row = _queued_row(job_id, tenant_id, lane, queue, priority, session_id, sampling,
                          prompt_tokens, idempotency_key, lora, route_reason, payload,
                          callback_url, trace_id)
        if session_id is not None:  # its turn is counted in the same transaction
            return self._insert_job(row, turn_of=session_id)
        # No read first: a key used before fails the insert on its unique index, and the
        # job it made comes back (the API's submit looked it up just before: api/submit.py).
        try:
            return self._group_insert.insert(row), True, 0
        except IntegrityError:
            existing = (self.job_by_idempotency_key(tenant_id, idempotency_key)
                        if idempotency_key is not None else None)
            if existing is None:
                raise
            return existing, False, 0

    def _insert_job(self, values: dict[str, Any],
                    turn_of: str | None) -> tuple[JobRecord, bool, int]:
        """Insert the row and, with turn_of, count that session's turn in the same
        transaction."""
        try:
            with self._write_conn() as conn:
                turn = self._count_turn(conn, turn_of, values["tenant_id"], None) if turn_of else 0
                if turn and "payload" in values:
                    values["payload"] = {**values["payload"], "turn": turn}
                inserted = conn.execute(_INSERT_JOB, values).mappings().one()
                return row_job_record(inserted), True, turn
        except IntegrityError:
            # A concurrent request with the same key won the insert: answer with its job.
            key = values.get("idempotency_key")
            existing = self.job_by_idempotency_key(values["tenant_id"], key) if key else None
            if existing is None:
                raise
            return existing, False, 0

    def _insert_jobs(self, rows: list[dict[str, Any]]) -> list[JobRecord]:
        """Insert the rows in one transaction; their records, in order. Rows that set the
        same columns go in one multi-row INSERT (SQLAlchemy's insertmanyvalues). On
        PostgreSQL, an INSERT each on the driver (store/hot.py), in one transaction; a group
        of one in autocommit."""
        if self._hot is not None:
            inserts = [(_insert_of(tuple(values)), values) for values in rows]
            return [row_job_record(got[0]) for got in self._hot.rows_together(inserts)]
        by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for values in rows:
            by_columns.setdefault(tuple(values), []).append(values)
        inserted: dict[str, JobRecord] = {}
        with self._write_conn() as conn:
            for same in by_columns.values():
                params: Any = same if len(same) > 1 else same[0]
                for got in conn.execute(_INSERT_JOB, params).mappings():
                    inserted[got["id"]] = row_job_record(got)
        return [inserted[values["id"]] for values in rows]

    def job_by_idempotency_key(self, tenant_id: int, idempotency_key: str) -> JobRecord | None:
        """The tenant's job submitted with this idempotency key, if any."""
        if self._hot is not None:
            rows = self._hot.rows(_SELECT_BY_KEY, {"tenant_id": tenant_id,
                                                   "key": idempotency_key})
            return row_job_record(rows[0]) if rows else None
        with self._read_conn() as conn:
            row = conn.execute(_SELECT_BY_KEY, {"tenant_id": tenant_id, "key": idempotency_key}
                               ).mappings().one_or_none()
        return row_job_record(row) if row is not None else None

    def get_job(self, job_id: str, tenant_id: int | None = None) -> JobRecord | None:
        """The job; with tenant_id, None unless the job belongs to that tenant."""
        row: Mapping[Any, Any] | None
        if self._hot is not None:
            rows = self._hot.rows(_SELECT_JOB, {"job_id": job_id})
            row = rows[0] if rows else None
        else:
            with self._read_conn() as conn:
                row = conn.execute(_SELECT_JOB, {"job_id": job_id}).mappings().one_or_none()
        if row is None or (tenant_id is not None and row["tenant_id"] != tenant_id):
            return None
        return row_job_record(row)

    def jobs_of_tenant(self, tenant_id: int, limit: int = 1000) -> list[JobRecord]:
        """A tenant's most recent jobs, oldest first."""
        stmt = (select(Job).where(Job.tenant_id == tenant_id)
                .order_by(Job.enqueued_at.desc()).limit(limit))
        with self._read() as session:
            return [job_record(job) for job in reversed(session.scalars(stmt).all())]

    def list_jobs(self, tenant_id: int, *, statuses: tuple[str, ...] = (),
                  lane: str | None = None, session_id: str | None = None,
                  created_after: datetime | None = None,
                  after: tuple[datetime, str] | None = None,
                  limit: int = 100) -> list[JobRecord]:
        """A tenant's jobs in the order they were accepted (then by id), filtered; `after`
        is the (enqueued_at, id) of the last job of the page before (keyset pagination:
        a page costs the same however deep it is, and jobs accepted meanwhile are not
        skipped or repeated). The payload column is not read."""
        stmt = select(Job).options(defer(Job.payload)).where(Job.tenant_id == tenant_id)
        if statuses:
            stmt = stmt.where(Job.status.in_(statuses))
        if lane is not None:
            stmt = stmt.where(Job.lane == lane)
        if session_id is not None:
            stmt = stmt.where(Job.session_id == session_id)
        if created_after is not None:
            stmt = stmt.where(Job.enqueued_at > _aware(created_after))
        if after is not None:
            at, job_id = _aware(after[0]), after[1]
            stmt = stmt.where((Job.enqueued_at > at)
                              | ((Job.enqueued_at == at) & (Job.id > job_id)))
        stmt = stmt.order_by(Job.enqueued_at, Job.id).limit(limit)
        with self._read() as session:
            return [job_record(job) for job in session.scalars(stmt)]

    def delete_job(self, job_id: str) -> bool:
        """Remove a job row (its enqueue failed after the row was written)."""
        with self._write() as session:
            return session.scalar(delete(Job).where(Job.id == job_id).returning(Job.id)) is not None

    def count_jobs(self, status: str | None = None) -> int:
        stmt = select(func.count()).select_from(Job)
        if status is not None:
            stmt = stmt.where(Job.status == status)
        with self._read() as session:
            return session.scalar(stmt) or 0

    def claim_job(self, job_id: str, worker: str, engine: str) -> JobRecord | None:
        """Move a queued job (or a running one, redelivered after a worker death) to running.

        One guarded UPDATE, so concurrent deliveries serialize on the row and each sees
        the attempts count of the one before. started_at and queue_wait_ms are set by the
        first claim only. None, and nothing changed, when the job is terminal or unknown.
        """
        now = utcnow()
        params = {"job_id": job_id, "now": now, "by_worker": worker, "by_engine": engine}
        if self._hot is not None:
            rows = self._hot.rows(_CLAIM_AT_ONCE, params)
            return row_job_record(rows[0]) if rows else None
        with self._write_conn() as conn:
            enqueued_at = conn.execute(_SELECT_ENQUEUED_AT, {"job_id": job_id}).scalar()
            if enqueued_at is None:
                return None
            row = conn.execute(_CLAIM, {**params, "wait_ms": _ms(enqueued_at, now)}
                               ).mappings().one_or_none()
        return row_job_record(row) if row else None

    def mark_first_token(self, job_id: str, at: datetime, cached_tokens: int | None = None,
                         started_at: datetime | None = None) -> bool:
        """Record the first token's time, TTFT (from started_at) and the prompt tokens the
        engine found in its prefix cache; only the first call counts. `started_at`: the
        row's, as the claim returned it (a worker has it), which saves reading it here."""
        at = _aware(at)
        if started_at is not None and self._hot is not None:
            return self._hot.rowcount(_FIRST_TOKEN, {"job_id": job_id, "at": at,
                                                     "ttft": _ms(started_at, at),
                                                     "cached": cached_tokens}) > 0
        with self._write_conn() as conn:
            if started_at is None:
                started_at = conn.execute(_SELECT_STARTED_AT, {"job_id": job_id}).scalar()
            return conn.execute(_FIRST_TOKEN, {"job_id": job_id, "at": at,
                                               "ttft": _ms(started_at, at),
                                               "cached": cached_tokens}).rowcount > 0

    def finish_job(
        self,
        job_id: str,
        status: str,
        *,
        finish_reason: str | None = None,
        output_text: str | None = None,
        completion_tokens: int | None = None,
        error: str | None = None,
        finished_at: datetime | None = None,
    ) -> bool:
        """Move a queued or running job to a terminal status; True when this call did.

        A job cancelled or expired meanwhile keeps its status but gets the usage, output
        and times it lacks; any other terminal job is left as it is. The job's payload
        (its prompt) is dropped: the job has ended.
        """
        return self.end_job(job_id, status, finish_reason=finish_reason,
                            output_text=output_text, completion_tokens=completion_tokens,
                            error=error, finished_at=finished_at)[0]

    def end_job(
        self,
        job_id: str,
        status: str,
        *,
        finish_reason: str | None = None,
        output_text: str | None = None,
        completion_tokens: int | None = None,
        error: str | None = None,
        finished_at: datetime | None = None,
        first_token_at: datetime | None = None,
        first_token: FirstToken | None = None,
    ) -> tuple[bool, JobRecord | None]:
        """finish_job, and the row as it then is (None: unknown job): a worker's `done`
        event carries the row's timings, and reading them here saves a read after.

        `first_token_at`: the row's, when the caller wrote it (the worker's attempt that
        marked the first token); `first_token`: one it did not write, which this end writes
        as mark_first_token would (a job whose first token came with its end). The usual
        end, of a job still running, is then one UPDATE; any other goes through a read of
        the locked row.

        Safe to retry: a call whose first try committed but whose reply was lost (the
        connection dropped after COMMIT) finds its own end in the row, the same status at
        the same `finished_at`, and answers (True, row) as the first try would have. Without
        that the retry read "already ended" and a worker told its consumer `cancelled` for a
        job that was done. So a caller that retries passes the same `finished_at` each try
        (workers/runner.py does: its arguments are built once, then retried)."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"not a terminal status: {status!r}")
        end = _aware(finished_at) if finished_at else utcnow()
        first = first_token.values() if first_token else _NO_FIRST_TOKEN
        if first_token_at is not None or first_token is not None:
            ended = self._end_running(job_id, status, end, first_token_at or first["first_at"],
                                      finish_reason, output_text, completion_tokens, error,
                                      first)
            if ended is not None:
                return True, ended
        values = {
            "finish_reason": finish_reason,
            "output_text": output_text,
            "completion_tokens": completion_tokens,
            "error": error,
            "finished_at": end,
        }
        with self._write_conn() as conn:
            found = conn.execute(_SELECT_JOB.with_for_update(),
                                 {"job_id": job_id}).mappings().one_or_none()
            if found is None:
                return False, None
            return _end_locked(conn, dict(found), status, end, values, first)

    def _end_running(self, job_id: str, status: str, end: datetime, first_token_at: datetime,
                     finish_reason: str | None, output_text: str | None,
                     completion_tokens: int | None, error: str | None,
                     first: dict[str, Any]) -> JobRecord | None:
        """end_job of a job still queued or running, in one UPDATE; None when it was not."""
        params = {"job_id": job_id, "to_status": status, "finished_at": end,
                  "finish_reason": finish_reason, "output_text": output_text,
                  "completion_tokens": completion_tokens, "error": error,
                  "tpot": _tpot_ms(_aware(first_token_at), end, completion_tokens), **first}
        if self._hot is not None:
            rows = self._hot.rows(_END_RUNNING_ALONE, {**params, "day": end.date()})
            if rows:
                return row_job_record(rows[0])
        with self._write_conn() as conn:
            row = conn.execute(_END_RUNNING, params).mappings().one_or_none()
            if row is None:
                return None
            meter(conn, None, row)  # a running job had not ended: all its usage is new
            if row["callback_url"]:  # a running job has not ended before: its one webhook
                conn.execute(insert(_WEBHOOK_DELIVERIES).values(
                    **_webhook_outbox_row(job_id, row["tenant_id"], row["callback_url"])))
        return row_job_record(row)

    def cancel_job(self, job_id: str, tenant_id: int | None = None) -> JobRecord | None:
        """Cancel a queued or running job; terminal jobs come back unchanged.

        A running job gets finished_at from its worker's finish_job, which still fills in
        what was generated until the worker noticed (or from the reconciler, when that
        worker died). A queued job ends here, and its payload is dropped.
        """
        with self._write() as session:
            job = self._locked_job(session, job_id)
            if job is None or (tenant_id is not None and job.tenant_id != tenant_id):
                return None
            ends_here = job.status == QUEUED  # a running job's worker (or reconciler) ends it
            if ends_here:
                job.finished_at = utcnow()
                job.payload = None
            if job.status in ACTIVE_STATUSES:
                job.status = CANCELLED
            if ends_here:
                _ended(session, job)
            session.flush()
            record = job_record(job)
            if ends_here:
                meter(session.connection(), None, asdict(record))
            return record

    def count_in_flight(self, tenant_id: int) -> int:
        """The tenant's queued and running jobs: two ranges of ix_jobs_tenant_id_status,
        read on every submit (the API's in-flight cap), so no longer than the cap."""
        with self._read_conn() as conn:
            return conn.execute(_COUNT_IN_FLIGHT, {"tenant_id": tenant_id}).scalar() or 0

    def in_flight_by_lane(self) -> dict[tuple[str, str], int]:
        """Queued and running jobs by (lane, status), in one GROUP BY over the partial
        index ix_jobs_unended (the live backlog, not the history): the scheduler's gauge."""
        stmt = (select(Job.lane, Job.status, func.count())
                .where(Job.finished_at.is_(None), Job.status.in_(ACTIVE_STATUSES))
                .group_by(Job.lane, Job.status))
        with self._read_conn() as conn:
            return {(lane, status): count for lane, status, count in conn.execute(stmt)}

    def expire_job(self, job_id: str) -> bool:
        """A queued or running job whose deadline passed becomes expired; True when it did."""
        with self._write() as session:
            job = self._locked_job(session, job_id)
            if job is None or job.status not in ACTIVE_STATUSES:
                return False
            job.status, job.finished_at, job.payload = EXPIRED, utcnow(), None
            _ended(session, job)
            session.flush()
            meter(session.connection(), None, asdict(job_record(job)))
            return True

    def unended_jobs(self, enqueued_before: datetime, limit: int) -> list[JobRecord]:
        """Jobs accepted before `enqueued_before` and not ended yet (no finished_at: queued,
        running, or cancelled while running and not yet finished), oldest first: the
        reconciler's candidates. Reads the partial index ix_jobs_unended, whose size is the
        live backlog; the payloads stay in the database (job_payload)."""
        stmt = (select(Job).options(defer(Job.payload))
                .where(Job.finished_at.is_(None), Job.enqueued_at < _aware(enqueued_before))
                .order_by(Job.enqueued_at).limit(limit))
        with self._read() as session:
            return [job_record(job) for job in session.scalars(stmt)]

    def unended_queues(self, prefix: str) -> list[str]:
        """The queues named `prefix`... that jobs not ended yet were sent to (the
        reconciler's dead direct queues); a read of ix_jobs_unended's rows."""
        stmt = (select(Job.queue).distinct()
                .where(Job.finished_at.is_(None), Job.queue.startswith(prefix, autoescape=True)))
        with self._read() as session:
            return list(session.scalars(stmt))

    def job_payload(self, job_id: str) -> dict[str, Any] | None:
        """The task payload kept with a job that has not ended (None once it has)."""
        with self._read() as session:
            payload = session.scalar(select(Job.payload).where(Job.id == job_id))
            return dict(payload) if payload else None

    def note_requeue(self, job_id: str, queue: str, route_reason: str) -> bool:
        """A queued or running job whose message was sent again: its queue and why.
        False when the job ended meanwhile."""
        stmt = (
            update(Job)
            .where(Job.id == job_id, Job.status.in_(ACTIVE_STATUSES))
            .values(queue=queue, route_reason=route_reason)
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        )
        with self._write() as session:
            return session.scalar(stmt) is not None

    @staticmethod
    def _locked_job(session: Session, job_id: str) -> Job | None:
        # FOR UPDATE serializes with other writers on PostgreSQL; SQLite already holds
        # the database write lock (BEGIN IMMEDIATE) and renders no FOR UPDATE.
        return session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()

    # -- chat sessions ---------------------------------------------------------------

    # A session is the tenant's: every lookup and write names the tenant with the id, so
    # another tenant's use of the same id is another session (nothing to refuse or leak).

    def touch_session(self, session_id: str, tenant_id: int, worker: str | None) -> int:
        """Count one more turn of the tenant's chat session (created on first use); returns
        the turn. worker, when given, becomes the session's last worker (for affinity)."""
        with self._write() as session:
            return self._count_turn(session, session_id, tenant_id, worker)

    def _count_turn(self, session: Session | Connection, session_id: str, tenant_id: int,
                    worker: str | None) -> int:
        """touch_session inside the caller's transaction."""
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(ChatSession).values(
            id=session_id, tenant_id=tenant_id, turns=1, last_worker=worker, last_seen=utcnow()
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[ChatSession.tenant_id, ChatSession.id],
            set_={
                "turns": ChatSession.turns + 1,
                "last_worker": func.coalesce(stmt.excluded.last_worker, ChatSession.last_worker),
                "last_seen": stmt.excluded.last_seen,
            },
        )
        return int(session.scalar(stmt.returning(ChatSession.turns)) or 0)

    def set_session_worker(self, session_id: str, tenant_id: int, worker: str) -> None:
        """The worker that now holds the tenant's session's prefix (session affinity)."""
        stmt = (update(ChatSession)
                .where(ChatSession.tenant_id == tenant_id, ChatSession.id == session_id)
                .values(last_worker=worker))
        with self._write() as session:
            session.execute(stmt)

    def get_session(self, session_id: str, tenant_id: int) -> SessionRecord | None:
        """The tenant's session of this id; None when the tenant has none (another tenant's
        session of the same id is not this one)."""
        with self._read() as session:
            chat = session.get(ChatSession, (tenant_id, session_id))
            return session_record(chat) if chat is not None else None

    # -- traffic ---------------------------------------------------------------------

    def record_arrivals(self, lane: str, minute: datetime, count: int = 1) -> TrafficRecord:
        """Add `count` arrivals to the lane's sample for the minute `minute` falls in;
        returns the minute's new total. One statement, so concurrent producers add up."""
        if count < 0:
            raise ValueError(f"arrivals count {count} < 0")
        minute = _aware(minute).replace(second=0, microsecond=0)
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(TrafficSample).values(lane=lane, minute=minute, arrivals=count)
        stmt = stmt.on_conflict_do_update(
            index_elements=[TrafficSample.lane, TrafficSample.minute],
            set_={"arrivals": TrafficSample.arrivals + stmt.excluded.arrivals},
        )
        with self._write() as session:
            total = session.scalar(stmt.returning(TrafficSample.arrivals))
        return TrafficRecord(lane=lane, minute=minute, arrivals=int(total or 0))

    def arrivals(self, lane: str, since: datetime, until: datetime) -> list[tuple[datetime, int]]:
        """The lane's (minute, arrivals) samples with since <= minute < until, oldest first.
        A minute without arrivals has no sample."""
        stmt = (select(TrafficSample.minute, TrafficSample.arrivals)
                .where(TrafficSample.lane == lane, TrafficSample.minute >= _aware(since),
                       TrafficSample.minute < _aware(until))
                .order_by(TrafficSample.minute))
        with self._read() as session:
            return [(minute, int(count)) for minute, count in session.execute(stmt)]
