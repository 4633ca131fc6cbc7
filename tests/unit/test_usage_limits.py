"""The pieces of usage and budgets that need no process: OpenAI's reset durations, the
headers built from a window, the budget's refusal, and the month's cached read."""

from __future__ import annotations

import threading
from datetime import date
from types import SimpleNamespace

import pytest

from api import limits
from api.errors import ApiError
from tidegate.ratelimit import Window, duration, unused_tokens
from tidegate_tools.procs import wait_until


@pytest.mark.parametrize(("seconds", "text"), [
    (0.02, "20ms"), (0.9994, "999ms"), (1, "1s"), (8.64, "8.64s"), (59.5, "59.5s"),
    (60, "1m0s"), (360, "6m0s"), (119.99, "1m59.99s"), (3723.5, "1h2m3.5s"),
])
def test_durations_are_written_as_openai_writes_its_reset_headers(seconds: float,
                                                                   text: str) -> None:
    assert duration(seconds) == text


def test_the_headers_name_each_limit_the_tenant_has() -> None:
    headers = limits.rate_headers({"tokens": Window(limit=1000, remaining=250, reset_s=61)})
    assert headers == {"x-ratelimit-limit-tokens": "1000",
                       "x-ratelimit-remaining-tokens": "250",
                       "x-ratelimit-reset-tokens": "1m1s"}
    assert limits.rate_headers({}) == {}


def test_unused_tokens_are_what_max_tokens_left() -> None:
    assert unused_tokens(64, 10) == 54
    assert unused_tokens(64, None) == 64  # nothing generated: all of it
    assert unused_tokens(4, 12) == 0  # n choices may pass max_tokens: never negative
    assert unused_tokens(None, 3) == 0


def tenant(budget: int | None) -> SimpleNamespace:
    return SimpleNamespace(id=7, monthly_token_budget=budget)


def test_a_spent_budget_is_a_429_quota_exceeded_until_next_month() -> None:
    limits.check_budget(tenant(None), lambda _: 10**12)  # type: ignore[arg-type]
    limits.check_budget(tenant(100), lambda _: 99)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as refused:
        limits.check_budget(tenant(100), lambda _: 100)  # type: ignore[arg-type]
    assert refused.value.status == 429 and refused.value.kind == "quota_exceeded"
    assert 0 < int(refused.value.headers["Retry-After"]) <= 31 * 86400
    assert refused.value.headers["x-should-retry"] == "false"


def test_the_month_is_read_at_most_every_fresh_s_per_tenant() -> None:
    reads: list[tuple[int, date]] = []

    def read(tenant_id: int, first: date) -> int:
        reads.append((tenant_id, first))
        return 5 * len(reads)

    usage = limits.MonthUsage(read, fresh_s=3600)
    assert usage.get(1) == 5 and usage.get(1) == 5 and usage.get(2) == 10
    assert len(reads) == 2 and all(first.day == 1 for _, first in reads)
    assert limits.MonthUsage(read, fresh_s=0).get(1) == 15  # stale at once: read again


def test_a_stale_count_answers_while_the_next_is_read_behind_and_a_lost_one_is_read_inline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past fresh_s a submit gets the count it had while the refresher reads the next;
    past the grace too it reads the count itself (and would meet a store's failure)."""
    counts, reads, read_behind = [4], [], threading.Event()

    def count(tenant_id: int) -> int:
        reads.append(threading.current_thread().name)
        if threading.current_thread().name == "api-refresher":
            read_behind.set()
        return counts[0]

    in_flight = limits.InFlightCounts(count, fresh_s=0, behind=limits.Refresher())
    assert in_flight.get(1) == 4 and reads == ["MainThread"]  # none known: read inline
    counts[0] = 9
    assert in_flight.get(1) == 4  # stale: the known count answers, the next is read behind
    assert read_behind.wait(10), "the refresher never read the count"
    wait_until(lambda: in_flight.get(1) == 9, 10, "the count read behind to answer")
    monkeypatch.setattr(limits, "STALE_GRACE_S", 0.0)
    counts[0], inline = 2, reads.count("MainThread")
    assert in_flight.get(1) == 2  # past the grace: read inline
    assert reads.count("MainThread") == inline + 1
