"""Arrivals per lane and minute: the samples the scheduler's forecast reads."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from store.clock import aware
from store.database import Database
from store.models import TrafficSample
from store.records import TrafficRecord


class Traffic:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record_arrivals(self, lane: str, minute: datetime, count: int = 1) -> TrafficRecord:
        """Add `count` arrivals to the lane's sample for the minute `minute` falls in;
        returns the minute's new total. One statement, so concurrent producers add up."""
        if count < 0:
            raise ValueError(f"arrivals count {count} < 0")
        minute = aware(minute).replace(second=0, microsecond=0)
        insert = postgresql.insert if self.db.dialect == "postgresql" else sqlite.insert
        stmt = insert(TrafficSample).values(lane=lane, minute=minute, arrivals=count)
        stmt = stmt.on_conflict_do_update(
            index_elements=[TrafficSample.lane, TrafficSample.minute],
            set_={"arrivals": TrafficSample.arrivals + stmt.excluded.arrivals},
        )
        with self.db.write() as session:
            total = session.scalar(stmt.returning(TrafficSample.arrivals))
        return TrafficRecord(lane=lane, minute=minute, arrivals=int(total or 0))

    def arrivals(self, lane: str, since: datetime, until: datetime) -> list[tuple[datetime, int]]:
        """The lane's (minute, arrivals) samples with since <= minute < until, oldest first.
        A minute without arrivals has no sample."""
        stmt = (select(TrafficSample.minute, TrafficSample.arrivals)
                .where(TrafficSample.lane == lane, TrafficSample.minute >= aware(since),
                       TrafficSample.minute < aware(until))
                .order_by(TrafficSample.minute))
        with self.db.read() as session:
            return [(minute, int(count)) for minute, count in session.execute(stmt)]
