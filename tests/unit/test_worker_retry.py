"""The worker's retry of store and Redis calls (workers/retry.py): transient errors are
retried within the budget, then raised; bugs are raised at once."""

from __future__ import annotations

import time

import pytest
import redis
import sqlalchemy.exc

from tidegate.backoff import Backoff
from workers.retry import Retrier


class Flaky:
    """Fails its first `failures` calls with `error`, then answers."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self, value: str) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return value


def db_down() -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("database is locked"))


@pytest.mark.parametrize("error", [db_down(), redis.ConnectionError("refused"),
                                   redis.TimeoutError("timed out")])
def test_transient_errors_are_retried_until_the_call_succeeds(error: BaseException) -> None:
    call = Flaky(3, error)
    assert Retrier(5.0)(call, "ok") == "ok"
    assert call.calls == 4


def test_past_the_budget_the_last_error_is_raised() -> None:
    call = Flaky(10_000, db_down())
    started = time.monotonic()
    with pytest.raises(sqlalchemy.exc.OperationalError):
        Retrier(0.3)(call, "never")
    assert call.calls > 1 and time.monotonic() - started < 3.0


@pytest.mark.parametrize("error", [ValueError("a bug"), redis.ResponseError("WRONGTYPE"),
                                   sqlalchemy.exc.IntegrityError("INSERT", {}, Exception())])
def test_bugs_are_not_retried(error: BaseException) -> None:
    call = Flaky(1, error)
    with pytest.raises(type(error)):
        Retrier(5.0)(call, "never")
    assert call.calls == 1


def test_a_resubscribe_backs_off_doubling_to_its_cap_with_jitter_and_starts_over() -> None:
    """tidegate/backoff.py, as the cancel listener waits between resubscribes."""
    top = Backoff(first_s=0.5, max_s=4.0, rand=lambda: 1.0)
    assert [top.next_s() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    top.reset()
    assert top.next_s() == 0.5
    bottom = Backoff(first_s=0.5, max_s=4.0, rand=lambda: 0.0)
    assert [bottom.next_s() for _ in range(4)] == [0.25, 0.5, 1.0, 2.0]
