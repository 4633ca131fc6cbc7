"""Concurrent job inserts go in one transaction (store/group_insert.py `GroupInsert`): a
row that comes while a write is under way waits for it and goes with the next group,
written by the first row of that group; a row's failure is its own. The writer here is a function
that records its groups; tests/stack/test_store_group_insert.py runs the real store."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from store.group_insert import GroupInsert

THREADS = 6


class Writer:
    """Returns each row's id as its "record"; the first write blocks until `release`."""

    def __init__(self, fail_on: str | None = None, error: Exception | None = None) -> None:
        self.groups: list[list[str]] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.fail_on, self.error = fail_on, error

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        ids = [row["id"] for row in rows]
        self.groups.append(ids)
        if len(self.groups) == 1:
            self.entered.set()
            assert self.release.wait(10)
        if self.fail_on in ids:
            assert self.error is not None
            raise self.error
        return [f"record-{i}" for i in ids]


def start_group(writer: Writer, group: GroupInsert, pool: ThreadPoolExecutor,
                followers: list[str]) -> tuple[Any, list[Any]]:
    """A first insert that blocks in its write, then `followers` inserting meanwhile."""
    first = pool.submit(group.insert, {"id": "first"})
    assert writer.entered.wait(10)
    rest = [pool.submit(group.insert, {"id": i}) for i in followers]
    while len(group._waiting) < len(followers):  # each has queued behind the write
        threading.Event().wait(0.01)
    return first, rest


def test_rows_that_come_during_a_write_go_together_in_the_next() -> None:
    writer = Writer()
    group = GroupInsert(writer)
    with ThreadPoolExecutor(THREADS) as pool:
        first, rest = start_group(writer, group, pool, ["a", "b", "c"])
        writer.release.set()
        assert first.result(10) == "record-first"
        assert [f.result(10) for f in rest] == ["record-a", "record-b", "record-c"]
    assert writer.groups[0] == ["first"]
    assert sorted(writer.groups[1]) == ["a", "b", "c"] and len(writer.groups) == 2
    # Nothing under way: the next row is written at once, alone.
    assert group.insert({"id": "later"}) == "record-later"
    assert writer.groups[-1] == ["later"]


def test_a_row_that_fails_its_group_fails_alone() -> None:
    bad = IntegrityError("INSERT", {}, Exception("duplicate key"))
    writer = Writer(fail_on="b", error=bad)
    group = GroupInsert(writer)
    with ThreadPoolExecutor(THREADS) as pool:
        first, rest = start_group(writer, group, pool, ["a", "b", "c"])
        writer.release.set()
        assert first.result(10) == "record-first"
        assert rest[0].result(10) == "record-a" and rest[2].result(10) == "record-c"
        with pytest.raises(IntegrityError):
            rest[1].result(10)
    # The group, then each of its rows alone.
    assert sorted(writer.groups[1]) == ["a", "b", "c"]
    assert sorted(map(tuple, writer.groups[2:])) == [("a",), ("b",), ("c",)]


def test_a_database_that_fails_fails_every_row_of_the_group_once() -> None:
    down = OperationalError("INSERT", {}, Exception("connection refused"))
    writer = Writer(fail_on="a", error=down)
    group = GroupInsert(writer)
    with ThreadPoolExecutor(THREADS) as pool:
        first, rest = start_group(writer, group, pool, ["a", "b"])
        writer.release.set()
        assert first.result(10) == "record-first"
        for future in rest:
            with pytest.raises(OperationalError):
                future.result(10)
    assert len(writer.groups) == 2  # no row tried again alone


def test_many_threads_each_get_their_own_record() -> None:
    writer = Writer()
    writer.release.set()
    group = GroupInsert(writer)
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(lambda i: group.insert({"id": str(i)}), range(300)))
    assert results == [f"record-{i}" for i in range(300)]
    assert sorted(i for g in writer.groups for i in g) == sorted(map(str, range(300)))
