"""Every call to Redis or PostgreSQL has a timeout (issue 28, finding 7), and a worker's
retried end of a job tells the truth (a point 9 item).

A blackholed backend is a real TCP listener on 127.0.0.1 that accepts every connection
and never answers (a partitioned host, a dead proxy): the API, served over real HTTP in
a thread of the test, answers a submit 503 with Retry-After within the timeout, and
answers other requests afterwards. Without the timeouts the submit's admission thread
waited for ever. Its own Redis database where a real Redis is needed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from api.app import create_app
from store import FirstToken, JobRecord, Store, upgrade
from tasks.app import make_app
from tests.helpers import own_redis_url, postgres_or_skip, served
from tidegate import redisconn
from tidegate.records import JobStatus
from tidegate.settings import Settings
from tidegate_tools.pg import private_database
from workers.retry import Retrier

ASK = {"lane": "chat", "messages": [{"role": "user", "content": "Where is my parcel?"}],
       "max_tokens": 4}
REDIS_TIMEOUT_S = 1.0  # the blackholed Redis cases' connect and socket timeouts
DB_CONNECT_TIMEOUT_S = 2  # libpq's least
SLACK_S = 2.0  # the API's own time on a submit, on a loaded 2-core machine


@contextlib.contextmanager
def blackhole() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never sends a byte; yields the
    port. Its thread and every connection it took are closed on the way out."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)  # so the accept loop sees the stop
    taken: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                taken.append(server.accept()[0])

    thread = threading.Thread(target=accept, name="blackhole", daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
        for conn in taken:
            conn.close()


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    return call(), time.monotonic() - started


def unavailable(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["Retry-After"]) >= 1
    assert resp.json()["error"]["type"] == "unavailable"


# -- a blackholed Redis ----------------------------------------------------------------


def test_a_blackholed_redis_is_a_503_within_the_timeout(model_path: Path,
                                                         tmp_root: Path) -> None:
    url = f"sqlite:///{tmp_root / 'blackholed-redis.db'}"
    upgrade(url)
    _, key = Store(url).tenants.create_tenant("blackholed-redis", ["chat"])
    with blackhole() as port:
        settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", database_url=url,
                            namespace="tgblackholedredis",
                            redis_connect_timeout_s=REDIS_TIMEOUT_S,
                            redis_socket_timeout_s=REDIS_TIMEOUT_S)
        with served(create_app(settings)) as base, httpx.Client(
                base_url=base, timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
            unavailable(http.post("/v1/jobs", json=ASK))  # (the tokenizer loads meanwhile)
            again, took = timed(lambda: http.post("/v1/jobs", json=ASK))
            unavailable(again)
            assert took < REDIS_TIMEOUT_S + SLACK_S, f"the 503 took {took:.1f} s"
            assert "Redis" in again.json()["error"]["message"]
            # No thread is held: the API answers what needs no Redis, and submits again.
            assert http.get("/healthz").status_code == 200
            listed = http.get("/v1/jobs")
            assert listed.status_code == 200 and listed.json()["data"] == []
            unavailable(http.post("/v1/jobs", json=ASK))


def test_the_broker_connection_to_a_blackholed_redis_gives_up_within_its_timeouts() -> None:
    """Kombu's connections (the API's send_task, a worker's consumer, the scheduler) carry
    the timeouts: connecting to a blackholed broker fails instead of hanging."""
    outcome: list[BaseException | None] = []
    with blackhole() as port:
        settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0",
                            redis_connect_timeout_s=REDIS_TIMEOUT_S,
                            redis_socket_timeout_s=REDIS_TIMEOUT_S)
        app = make_app(settings)

        def connect() -> None:
            try:
                with app.connection_for_write() as conn:
                    conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - the outcome is the assertion
                outcome.append(exc)

        # A thread, so that a connection with no timeout fails the test, not hangs it.
        thread = threading.Thread(target=connect, name="broker-connect", daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(timeout=4 * REDIS_TIMEOUT_S + SLACK_S)
        took = time.monotonic() - started
    assert outcome, f"the broker connection still hung after {took:.1f} s"
    assert outcome[0] is not None and "Timeout" in str(outcome[0]), outcome[0]


def test_every_redis_client_takes_the_timeout_settings() -> None:
    """What the blackhole cases prove for the API's client, for the other paths: workers'
    and the scheduler's sync clients, the asyncio client, the sentinels and the broker."""
    settings = Settings(redis_connect_timeout_s=1.5, redis_socket_timeout_s=4.0)
    bounds = {"socket_connect_timeout": 1.5, "socket_timeout": 4.0}
    plain = redisconn.sync_client(settings.redis_url, **settings.redis_timeouts)
    assert bounds.items() <= plain.connection_pool.connection_kwargs.items()
    defaults = redisconn.sync_client(settings.redis_url).connection_pool.connection_kwargs
    assert redisconn.timeouts().items() <= defaults.items()  # no settings: still bounded
    aio = redisconn.async_client(settings.redis_url, **settings.redis_timeouts)
    assert bounds.items() <= aio.connection_pool.connection_kwargs.items()
    sentinel = redisconn.sync_client("sentinel://127.0.0.1:26379/0?master=main",
                                     **settings.redis_timeouts)
    assert bounds.items() <= sentinel.connection_pool.connection_kwargs.items()
    for asked in sentinel.connection_pool.sentinel_manager.sentinels:
        kwargs = asked.connection_pool.connection_kwargs
        assert bounds.items() <= kwargs.items() and kwargs["retry"].get_retries() == 0
    options = make_app(settings).conf.broker_transport_options
    assert bounds.items() <= options.items()


# -- a blackholed PostgreSQL ---------------------------------------------------------


def test_a_blackholed_database_is_a_503_within_the_connect_timeout(
        redis_server: str, model_path: Path) -> None:
    with blackhole() as port:
        settings = Settings(
            redis_url=own_redis_url(redis_server, __name__, "10"), namespace="tgblackholeddb",
            database_url=f"postgresql://postgres@127.0.0.1:{port}/tidegate",
            database_connect_timeout_s=DB_CONNECT_TIMEOUT_S)
        # Any key: the database that would say whose it is does not answer.
        with served(create_app(settings)) as base, httpx.Client(
                base_url=base, timeout=60,
                headers={"Authorization": "Bearer tg_blackholed"}) as http:
            first, took = timed(lambda: http.post("/v1/jobs", json=ASK))
            unavailable(first)
            assert "database" in first.json()["error"]["message"]
            assert took < DB_CONNECT_TIMEOUT_S + SLACK_S, f"the 503 took {took:.1f} s"
            assert http.get("/healthz").status_code == 200
            unavailable(http.get("/v1/jobs"))


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    postgres_or_skip()
    with private_database("tidegate_test_timeouts") as url:
        upgrade(url)
        yield url


@pytest.mark.postgres
def test_statement_timeout_is_in_force_on_postgresql(pg_url: str) -> None:
    """On every pooled connection, the hot statements' driver path included; the server
    cancels a statement past it, and the store's caller gets an OperationalError."""
    settings = Settings(database_url=pg_url, database_statement_timeout_s=0.5)
    store = Store(settings.db_url, **settings.store_timeouts)
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "500ms"
            started = time.monotonic()
            with pytest.raises(OperationalError, match="statement timeout"):
                conn.exec_driver_sql("SELECT pg_sleep(5)")
            assert time.monotonic() - started < 0.5 + SLACK_S
        raw = store.engine.raw_connection()  # what store/hot.py runs its statements on
        try:
            cursor = raw.cursor()
            cursor.execute("SHOW statement_timeout")
            assert cursor.fetchone()[0] == "500ms"  # type: ignore[index]
        finally:
            raw.close()
    finally:
        store.close()
    default = Store(pg_url)  # made without settings: the defaults bound it all the same
    try:
        with default.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "30s"
    finally:
        default.close()


# -- a retried end whose reply was lost ------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ends.db'}"
        upgrade(url)
    else:
        url = request.getfixturevalue("pg_url")
    st = Store(url)
    try:
        yield st
    finally:
        st.close()


class LostReply:
    """A store call whose first try commits, then loses its reply, as a connection that
    drops after COMMIT does: the caller gets an OperationalError for a write that is in
    the database."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call, self.tries = call, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tries += 1
        result = self.call(*args, **kwargs)
        if self.tries == 1:
            raise OperationalError("COMMIT", {}, ConnectionError(
                "server closed the connection unexpectedly"))
        return result


def running_job(store: Store) -> tuple[JobRecord, datetime]:
    tenant, _ = store.tenants.create_tenant(f"ends-{time.monotonic_ns()}", ["chat"])
    job, _, _ = store.jobs.create_job(f"job-{time.monotonic_ns()}", tenant.id, "chat", "chat.vllm",
                                      4, None, {"max_tokens": 4}, 5)
    claimed = store.runs.claim_job(job.id, "chat-w1@test", "vllm")
    assert claimed is not None and claimed.started_at is not None
    return claimed, claimed.started_at + timedelta(milliseconds=20)


@pytest.mark.parametrize("first_token", ["written", "with the end"])
def test_a_retried_end_whose_reply_was_lost_reports_done(store: Store, first_token: str) -> None:
    """As workers/endings.py `_finish` ends a job: the end's arguments built once, then the
    call through the worker's Retrier. Its first try ends the job `done` and loses the
    reply; the retry must say so ((True, the done row)), not that the job had ended
    before, which the runner reads as a cancel landed meanwhile (it then told the consumer
    `cancelled` for a finished job)."""
    job, first_at = running_job(store)
    marked: dict[str, Any] = {"first_token_at": None, "first_token": None}
    if first_token == "written":
        assert store.runs.mark_first_token(job.id, first_at, started_at=job.started_at)
        marked["first_token_at"] = first_at
    else:
        marked["first_token"] = FirstToken(first_at, job.started_at)
    end_job = LostReply(store.runs.end_job)
    ended, row = Retrier(5.0)(end_job, job.id, JobStatus.DONE, output_text="on its way",
                              completion_tokens=3, finished_at=datetime.now(UTC),
                              finish_reason="stop", **marked)
    assert end_job.tries == 2  # the retry ran
    assert ended is True and row is not None
    assert (row.status, row.finish_reason, row.output_text) == ("done", "stop", "on its way")
    stored = store.jobs.get_job(job.id)
    assert stored is not None and stored.status == "done" and stored.first_token_at == first_at
    # An end that is not this call's stays refused: a late `error` changes nothing.
    assert store.runs.end_job(job.id, JobStatus.ERROR, error="late",
                              finished_at=datetime.now(UTC)) == (False, stored)
