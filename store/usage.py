"""The usage ledger: tokens and ended jobs per tenant, lane and day (UTC).

A job adds to the ledger in the transaction that ends it (store/runs.py), never elsewhere,
so the ledger is the sum of the ended job rows, exactly:

- when its row first gets `finished_at`, the row's tokens and one job of its status, on
  the day of that `finished_at`;
- when a row already ended is changed again (a worker fills in the usage of a job that was
  cancelled or expired while it ran), the difference its tokens made, on the same day.

A retried end that finds its own end in the row (Runs.end_job) changes nothing, so it
adds nothing. A job's prompt tokens count once a worker took it (`started_at`): a job
cancelled or expired in the queue was never prefilled and costs nothing but its count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Connection,
    RowMapping,
    Select,
    Table,
    bindparam,
    case,
    func,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import ReturningUpdate

from store.database import Database
from store.models import Tenant, UsageDay
from tidegate.records import JobStatus

USAGE = cast(Table, UsageDay.__table__)
TOKEN_KINDS = ("prompt_tokens", "cached_tokens", "completion_tokens")
JOB_COUNTS = {JobStatus.DONE: "jobs_done", JobStatus.ERROR: "jobs_error",
              JobStatus.CANCELLED: "jobs_cancelled", JobStatus.EXPIRED: "jobs_expired"}
COUNTED = (*TOKEN_KINDS, *JOB_COUNTS.values())
_KEY = (USAGE.c.tenant_id, USAGE.c.day, USAGE.c.lane)


@dataclass(frozen=True)
class UsageRecord:
    """One row of the ledger: a tenant's lane on a day."""

    tenant_id: int
    tenant: str  # the tenant's name
    day: date
    lane: str
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, served from the prefix cache
    completion_tokens: int
    jobs_done: int
    jobs_error: int
    jobs_cancelled: int
    jobs_expired: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def upsert(dialect: str, values: Mapping[str, object] | Select[Any]
           ) -> postgresql.Insert | sqlite.Insert:
    """INSERT ... ON CONFLICT DO UPDATE adding `values`'s counts to its day's row (both
    dialects have it). `values`: a dict, or a SELECT of the columns (tenant_id, day, lane,
    COUNTED...) in that order."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    if isinstance(values, Mapping):
        stmt = insert(USAGE).values(**values)
    else:
        stmt = insert(USAGE).from_select(["tenant_id", "day", "lane", *COUNTED], values)
    return stmt.on_conflict_do_update(
        index_elements=list(_KEY),
        set_={name: USAGE.c[name] + stmt.excluded[name] for name in COUNTED})


def _tokens(job: Mapping[Any, Any] | None) -> dict[str, int]:
    """What an ended row counts in the ledger (nothing for a row not ended)."""
    if job is None or job["finished_at"] is None:
        return dict.fromkeys(TOKEN_KINDS, 0)
    return {"prompt_tokens": job["prompt_tokens"] if job["started_at"] is not None else 0,
            "cached_tokens": job["cached_tokens"] or 0,
            "completion_tokens": job["completion_tokens"] or 0}


def meter(conn: Connection, before: Mapping[Any, Any] | None, after: Mapping[Any, Any]) -> None:
    """Adds to the ledger, on `conn` (the end's own transaction), what a write changed of
    a job row: `before` it (None: it had not ended), `after` it (the JOB_FIELDS columns)."""
    if after["finished_at"] is None:
        return
    new, old = _tokens(after), _tokens(before)
    values: dict[str, object] = dict.fromkeys(COUNTED, 0)
    values.update({kind: new[kind] - old[kind] for kind in TOKEN_KINDS})
    if before is None or before["finished_at"] is None:
        values[JOB_COUNTS[after["status"]]] = 1
    if not any(values.values()):
        return  # a repeated end, or one that changed no count
    values.update(tenant_id=after["tenant_id"], lane=after["lane"],
                  day=after["finished_at"].date())
    conn.execute(upsert(conn.dialect.name, values))


def metered_end(ended_update: ReturningUpdate[Any]) -> Select[Any]:
    """PostgreSQL: `ended_update` (an UPDATE ... RETURNING the JOB_FIELDS of a job that had
    not ended, now ended) and its ledger row, in one statement: a data-modifying CTE adds
    the row's tokens and its status to the day `day` (a parameter: its finished_at's UTC
    day). It returns the ended rows as the UPDATE would. One statement keeps the hot path
    one round trip in autocommit (store/hot.py) and the two writes atomic."""
    ended = ended_update.cte("ended")
    counts = [case((ended.c.started_at.is_(None), 0), else_=ended.c.prompt_tokens),
              func.coalesce(ended.c.cached_tokens, 0),
              func.coalesce(ended.c.completion_tokens, 0)]
    counts += [case((ended.c.status == status.value, 1), else_=0) for status in JOB_COUNTS]
    rows = select(ended.c.tenant_id, bindparam("day", type_=USAGE.c.day.type), ended.c.lane,
                  *counts)
    ledger = upsert("postgresql", rows).cte("metered")
    return select(*ended.c).add_cte(ledger)


class Usage:
    """Reads of the ledger: the usage endpoints (api/usage.py) and the monthly budget."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def days(self, start: date, end: date, tenant_id: int | None = None,
             lane: str | None = None) -> list[UsageRecord]:
        """The ledger's rows from `start` to `end` (inclusive), by day, tenant, lane."""
        stmt = (select(USAGE, Tenant.name).join(Tenant, Tenant.id == USAGE.c.tenant_id)
                .where(USAGE.c.day >= start, USAGE.c.day <= end))
        if tenant_id is not None:
            stmt = stmt.where(USAGE.c.tenant_id == tenant_id)
        if lane is not None:
            stmt = stmt.where(USAGE.c.lane == lane)
        stmt = stmt.order_by(USAGE.c.day, Tenant.name, USAGE.c.lane)
        with self.db.read_conn() as conn:
            return [_record(row) for row in conn.execute(stmt).mappings()]

    def tokens_since(self, tenant_id: int, first_day: date) -> int:
        """The tenant's prompt plus completion tokens on `first_day` and after."""
        stmt = (select(func.coalesce(func.sum(USAGE.c.prompt_tokens + USAGE.c.completion_tokens),
                                     0).cast(BigInteger))
                .where(USAGE.c.tenant_id == tenant_id, USAGE.c.day >= first_day))
        with self.db.read_conn() as conn:
            return int(conn.execute(stmt).scalar() or 0)


def _record(row: RowMapping) -> UsageRecord:
    return UsageRecord(tenant_id=row["tenant_id"], tenant=row["name"], day=row["day"],
                       lane=row["lane"], **{name: int(row[name]) for name in COUNTED})
