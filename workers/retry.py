"""Retries for the worker's store and Redis calls: a transient outage must not lose a job.

A call that fails with a transient error (the database or Redis unreachable, locked, timed
out) is tried again with exponential backoff and jitter, for up to the worker's retry
budget (`Settings.io_retry_s`). Past the budget the error goes up to the runner, which
gives the job back to its queue (`AttemptOutcome.REQUEUED`, tidegate/records.py)
instead of acking a job it could not end. Other errors are bugs and are never retried.

tenacity does the retrying: its backoff with jitter, time-bounded stop and thread-local
state (task threads share one `Retrier`) are what a hand-written loop would redo.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import redis
import sqlalchemy.exc
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

log = logging.getLogger("tidegate.worker")

# What goes away on its own: a lost or refused connection, a lock or a pool wait that
# timed out. Not IntegrityError or ProgrammingError (bugs), nor redis.ResponseError.
TRANSIENT: tuple[type[BaseException], ...] = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
    redis.ConnectionError,
    redis.TimeoutError,
    # A Redis Cluster's failover (TIDEGATE_STREAMS_URL): the cluster answers CLUSTERDOWN or
    # TRYAGAIN, or the client finds no master for a slot, until a replica is promoted.
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ClusterError,
)
FIRST_WAIT_S = 0.05
MAX_WAIT_S = 2.0  # a store back after an outage is used within this

P = ParamSpec("P")
T = TypeVar("T")


class Retrier:
    """Calls a function, retrying transient errors for up to `budget_s` seconds; then
    raises the last error."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._retrying = Retrying(
            retry=retry_if_exception_type(TRANSIENT),
            stop=stop_after_delay(budget_s),
            # 50 ms, 100 ms, ... up to 2 s, each plus up to 50 ms of jitter: workers that
            # lost the store together do not come back in step.
            wait=wait_exponential(multiplier=FIRST_WAIT_S, max=MAX_WAIT_S)
            + wait_random(0, FIRST_WAIT_S),
            before_sleep=_log_retry,
            reraise=True,
        )

    def __call__(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        # The first try goes straight to the call: tenacity's bookkeeping cost tens of
        # microseconds a call, and every token's write goes through here. Its retries
        # (and its budget) start at the first failure.
        try:
            return call(*args, **kwargs)
        except TRANSIENT as exc:
            _log_first_failure(call, exc)
        return self._retrying(call, *args, **kwargs)


def _log_first_failure(call: Callable[..., Any], exc: BaseException) -> None:
    log.warning("%s failed (%s); retrying", getattr(call, "__qualname__", "a call"),
                type(exc).__name__)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    name = getattr(state.fn, "__qualname__", "a call")
    # The error's type and the call's name only: a database error's text may quote the
    # statement's parameters, which hold prompt and output text.
    log.warning("%s failed (%s), try %d; retrying", name, type(exc).__name__,
                state.attempt_number)
