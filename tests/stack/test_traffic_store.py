"""The store's traffic samples (the forecaster's history) against real SQLite and
PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from scheduler.forecast import minute_of
from store import Store, upgrade
from tests.helpers import postgres_or_skip
from tidegate_tools.pg import private_database

NOW = datetime(2026, 11, 11, 19, 0, 30, tzinfo=UTC)  # mid-minute: the 19:00 minute is open
T0 = minute_of(NOW)
MIN = timedelta(minutes=1)

PG_DATABASE = "tidegate_test_traffic"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / 'traffic.db'}"
        else:
            postgres_or_skip()
            url = stack.enter_context(private_database(PG_DATABASE))
        upgrade(url)  # the migration, not create_all: 0003 is what production gets
        st = Store(url)
        yield st
        st.close()


def test_arrivals_add_up_per_lane_and_minute(store: Store) -> None:
    at = datetime(2026, 11, 11, 19, 0, 12, 345, tzinfo=UTC)
    assert store.traffic.record_arrivals("chat", at, 3).arrivals == 3
    record = store.traffic.record_arrivals("chat", at + timedelta(seconds=40), 2)
    assert (record.minute, record.arrivals) == (minute_of(at), 5)
    store.traffic.record_arrivals("chat", at + MIN)
    store.traffic.record_arrivals("finance", at, 7)
    eastern = at.astimezone(timezone(timedelta(hours=-5)))  # the same instant, elsewhere
    assert store.traffic.record_arrivals("chat", eastern, 1).arrivals == 6
    assert store.traffic.arrivals("chat", minute_of(at), minute_of(at) + 10 * MIN) == [
        (minute_of(at), 6), (minute_of(at) + MIN, 1)]
    # The range is [since, until).
    assert store.traffic.arrivals("chat", minute_of(at), minute_of(at) + MIN) == [
        (minute_of(at), 6)]
    assert store.traffic.arrivals("finance", minute_of(at) + MIN, minute_of(at) + 5 * MIN) == []


def test_concurrent_producers_lose_no_arrival(store: Store) -> None:
    threads = [threading.Thread(target=lambda: [store.traffic.record_arrivals("chat", NOW)
                                                for _ in range(10)]) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.traffic.arrivals("chat", T0, T0 + MIN) == [(T0, 80)]


def test_bad_samples_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="naive"):
        store.traffic.record_arrivals("chat", datetime(2026, 11, 11, 19, 0))
    with pytest.raises(ValueError, match="< 0"):
        store.traffic.record_arrivals("chat", NOW, -1)
