"""No tenant's batch can stop another's (issue 28, finding 1): a bad line is that line's
error, a broken batch fails alone, the driver is a process of its own (`tidegate
batches`) held by one lock that another process takes over when its holder dies, a lock
released late never deletes its successor's, and a batch list's cursor is the tenant's
own. The API runs in-process on its own Redis database with a chat worker's heartbeat
advertised and no worker consuming: a job a batch submits stays queued, and the test
ends it in the store, as a worker would."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import delete

from api.app import create_app
from api.batch_driver import Driver
from api.deps import Deps
from store import Store, upgrade
from store.batches import Batches, BatchRecord
from store.models import File, FilePart
from tests.helpers import own_db, postgres_or_skip, running_driver
from tests.stack.test_api_validation import waiting
from tests.stack.test_openai_validation import advertise_chat_worker
from tidegate import keys
from tidegate.locks import RedisLock
from tidegate.records import JobStatus
from tidegate.settings import Settings
from tidegate_tools.pg import private_database
from tidegate_tools.procs import Proc, start_batches, wait_until

REDIS_DB = own_db(__name__, "6")
PROMPT = "Where is my parcel, order 7731?"  # never in a log line
CHAT = "/v1/chat/completions"
BAD_CONTENTS = [("empty string", ""), ("no parts", []),
                ("an empty text part", [{"type": "text", "text": ""}])]


@dataclass
class Floor:
    http: TestClient
    store: Store
    batches: Batches
    redis: redis.Redis
    settings: Settings
    keys: dict[str, str]  # tenant name -> API key
    ids: dict[str, int]  # tenant name -> tenant id

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def batch(self, tenant: str, lines: list[str]) -> str:
        """A batch of /v1/chat/completions made of `lines`, through the Files and Batches
        routes; its id."""
        content = "".join(line + "\n" for line in lines).encode()
        upload = self.http.post("/v1/files", headers=self.auth(tenant), data={"purpose": "batch"},
                                files={"file": ("in.jsonl", content)})
        assert upload.status_code == 200, upload.text
        made = self.http.post("/v1/batches", headers=self.auth(tenant), json={
            "input_file_id": upload.json()["id"], "endpoint": CHAT, "completion_window": "24h"})
        assert made.status_code == 200, made.text
        return str(made.json()["id"])

    def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        resp = self.http.get(f"/v1/batches/{batch_id}", headers=self.auth(tenant))
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def row(self, batch_id: str) -> BatchRecord:
        found = self.batches.get_batch(batch_id)
        assert found is not None
        return found

    def jobs(self, tenant: str) -> list[Any]:
        return self.store.jobs.list_jobs(self.ids[tenant])

    def finish_jobs(self, tenant: str) -> None:
        """What a worker does with the tenant's queued jobs."""
        for job in self.jobs(tenant):
            if not job.terminal:
                self.store.runs.claim_job(job.id, "chat-batch@test", "vllm")
                self.store.runs.end_job(job.id, JobStatus.DONE, finish_reason="stop",
                                        output_text="on its way", completion_tokens=3)


def request(custom_id: str, content: Any = PROMPT) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {
        "model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}})


def settings_for(url: str, redis_url: str, **values: Any) -> Settings:
    return Settings(redis_url=redis_url, database_url=url, batch_poll_s=0.05,
                    batch_driver_lock_s=2, **values)


@contextlib.contextmanager
def floor_on(url: str, tmp_root: Path, redis_db: int = REDIS_DB,
             **values: Any) -> Iterator[Floor]:
    """The API in-process on database `url`, Redis database `redis_db` (this module's 6 by
    default; emptied before and after), tenants `x` and `y` on the chat and batch lanes;
    `values` are settings (tests/stack/test_batch_limits.py passes its own)."""
    upgrade(url)
    redis_url = os.environ["TIDEGATE_REDIS_URL"].rsplit("/", 1)[0] + f"/{redis_db}"
    settings = settings_for(url, redis_url, **values)
    store = Store(url)
    made = {name: store.tenants.create_tenant(f"{name}-{uuid.uuid4().hex[:6]}", ["chat", "batch"])
            for name in ("x", "y")}
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_chat_worker(client, settings)
    try:
        with TestClient(create_app(settings)) as http:
            yield Floor(http, store, Batches(store), client, settings,
                        {n: key for n, (_, key) in made.items()},
                        {n: rec.id for n, (rec, _) in made.items()})
    finally:
        client.flushdb()
        store.engine.dispose()


@pytest.fixture()
def floor(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Floor]:
    url = f"sqlite:///{tmp_root / f'batch-isolation-{uuid.uuid4().hex[:8]}.db'}"
    with floor_on(url, tmp_root, batch_step_failures=2) as built:
        yield built


# -- a bad line is that line's error; the route refuses it ---------------------------


def test_bad_lines_are_line_errors_and_another_tenants_later_batch_goes_on(
        floor: Floor) -> None:
    bad = [request(f"x-{name}", content) for name, content in BAD_CONTENTS]
    x_lines = [*bad, "this is not json", "[1, 2]", request("x-good")]
    x_batch = floor.batch("x", x_lines)
    y_batch = floor.batch("y", [request("y-0"), request("y-1")])  # created after x's
    with running_driver(floor.settings):
        wait_until(lambda: len(floor.jobs("y")) == 2 and len(floor.jobs("x")) == 1, 30,
                   "the driver to submit y's lines (and x's one good line)")
        assert {job.lane for job in floor.jobs("y")} == {"batch"}
        assert all(job.status == "queued" for job in floor.jobs("y"))
        queues = {job.queue for job in [*floor.jobs("x"), *floor.jobs("y")]}
        assert sum(waiting(floor.redis, queue) for queue in queues) == 3
        assert floor.get("y", y_batch)["status"] == "in_progress"
        wait_until(lambda: floor.get("x", x_batch)["request_counts"]["failed"] == 5, 30,
                   "x's five bad lines counted failed")
        floor.finish_jobs("x")
        floor.finish_jobs("y")
        wait_until(lambda: floor.get("x", x_batch)["status"] == "completed"
                   and floor.get("y", y_batch)["status"] == "completed", 30,
                   "both batches to complete")
    x_done, y_done = floor.get("x", x_batch), floor.get("y", y_batch)
    assert x_done["request_counts"] == {"total": 6, "completed": 1, "failed": 5}
    assert y_done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    errors = [json.loads(line) for line in floor.http.get(
        f"/v1/files/{x_done['error_file_id']}/content", headers=floor.auth("x")).text.splitlines()]
    params = {e["custom_id"]: e["response"]["body"]["error"]["param"] for e in errors}
    for name, _ in BAD_CONTENTS:  # each named as the route names it
        assert params[f"x-{name}"] == "messages.0.content"
    assert all(e["response"]["status_code"] == 400 for e in errors)
    assert params[None] == "line"  # the two lines that are no request


@pytest.mark.parametrize(("name", "content"), BAD_CONTENTS, ids=[n for n, _ in BAD_CONTENTS])
def test_a_message_without_text_is_a_400_naming_it_and_nothing_is_enqueued(
        floor: Floor, name: str, content: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    resp = floor.http.post(CHAT, headers=floor.auth("x"), json={
        "model": "chat", "max_tokens": 4, "messages": messages})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages.1.content" and error["type"] == "invalid_request_error"
    assert floor.store.jobs.count_jobs() == 0
    assert waiting(floor.redis, "chat.vllm") == 0


# -- a broken batch fails alone ------------------------------------------------------


def test_a_broken_batch_ends_failed_alone_and_the_others_go_on(
        floor: Floor, caplog: pytest.LogCaptureFixture) -> None:
    gone = floor.batch("x", [request("gone-0")])
    broken = floor.batch("x", [request("broken-0")])
    later = floor.batch("y", [request("y-0"), request("y-1")])
    file_id = floor.row(gone).input_file_id
    with floor.store.write() as session:  # its input file is gone (as a purge would)
        session.execute(delete(FilePart).where(FilePart.file_id == file_id))
        session.execute(delete(File).where(File.id == file_id))
    # A row no step can read: every step of this batch raises.
    floor.batches.update_batch(broken, line_errors=[{"not": "a line error"}])
    with caplog.at_level(logging.INFO), running_driver(floor.settings):
        wait_until(lambda: floor.get("x", gone)["status"] == "failed"
                   and floor.get("x", broken)["status"] == "failed", 30,
                   "the two broken batches to end failed")
        wait_until(lambda: len(floor.jobs("y")) == 2, 30, "y's later batch to go on")
        assert floor.get("y", later)["status"] == "in_progress"
    assert floor.get("x", gone)["errors"]["data"][0]["code"] == "input_file_missing"
    failed = floor.get("x", broken)["errors"]["data"][0]
    assert failed["code"] == "batch_failed" and "2 times in a row" in failed["message"]
    assert floor.jobs("x") == []
    lines = [r.getMessage() for r in caplog.records]
    assert any(broken in line and "KeyError" in line for line in lines)
    assert not any(PROMPT in line for line in lines)


# -- one driver process at a time, and a takeover -------------------------------------


def holder_pid(client: redis.Redis, settings: Settings) -> int | None:
    """The pid in the driver lock's token (`batches@host:pid/...`), if it is held."""
    token: Any = client.get(keys.batch_driver_lock(settings.namespace))
    found = re.search(rb":(\d+)/", token or b"")
    return int(found.group(1)) if found else None


def test_a_second_batches_process_takes_over_when_the_holder_is_killed(
        floor: Floor, tmp_root: Path) -> None:
    env = {**os.environ, "TIDEGATE_REDIS_URL": floor.settings.redis_url,
           "TIDEGATE_DATABASE_URL": floor.settings.db_url, "TIDEGATE_BATCH_POLL_S": "0.1",
           "TIDEGATE_BATCH_DRIVER_LOCK_S": "2", "TIDEGATE_BATCH_IN_FLIGHT": "1",
           "TIDEGATE_LOG_FORMAT": "text", "TIDEGATE_LOG_LEVEL": "INFO"}
    logs = tmp_root / "logs"
    procs: list[Proc] = []
    try:
        procs += [start_batches(env, logs, f"batches-{uuid.uuid4().hex[:6]}") for _ in range(2)]
        wait_until(lambda: holder_pid(floor.redis, floor.settings) is not None, 120,
                   "one `tidegate batches` to take the driver lock", procs)
        holder = next(p for p in procs if p.popen.pid == holder_pid(floor.redis, floor.settings))
        other = next(p for p in procs if p is not holder)
        batch = floor.batch("x", [request(f"x-{i}") for i in range(3)])
        wait_until(lambda: len(floor.jobs("x")) == 1, 30, "the holder to submit line 0", procs)
        assert "holding the lock" not in other.log_path.read_text()  # it waits
        os.killpg(holder.popen.pid, signal.SIGKILL)
        holder.popen.wait()
        floor.finish_jobs("x")  # the batch has room again: only a live driver fills it
        # 180 s: the other process may still be importing the project on a loaded machine
        # (a CI run timed out at 60 s); the lock itself lapses 2 s after the kill.
        wait_until(lambda: len(floor.jobs("x")) == 2, 180, "the other process to go on",
                   [other])
        assert holder_pid(floor.redis, floor.settings) == other.popen.pid
        assert floor.get("x", batch)["status"] == "in_progress"
    finally:
        for proc in procs:
            proc.stop()


# -- a lock released late never deletes its successor's --------------------------------


def test_a_lock_that_lapsed_and_was_taken_is_never_deleted_by_its_old_holder(
        redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    key = f"tgbatchiso:lock:{uuid.uuid4().hex}"
    old = RedisLock(client, key, ttl_s=0.2)
    assert old.acquire()
    wait_until(lambda: not client.exists(key), 10, "the old holder's TTL to lapse")
    new = RedisLock(client, key, ttl_s=30)
    assert new.acquire()
    assert old.release() is False and old.extend() is False
    assert client.get(key) == new.token.encode()
    ttl_ms: Any = client.pttl(key)
    assert 0 < ttl_ms <= 30_000
    assert new.release() and not client.exists(key)


class TakenOverOnRelease:
    """A Redis client through which another holder takes `key` at the moment this one
    releases it: the window between a holder's TTL lapsing and its release, made certain
    (any DEL or script that names the key lets the other in first)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key, self.taken = client, key, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def _take_over(self, names: tuple[Any, ...]) -> None:
        if not self.taken and self.key in [n.decode() if isinstance(n, bytes) else n
                                           for n in names]:
            self.client.set(self.key, "another-driver", px=60_000)
            self.taken = True

    def delete(self, *names: Any) -> Any:
        self._take_over(names)
        return self.client.delete(*names)

    def eval(self, script: str, numkeys: int, *args: Any) -> Any:
        self._take_over(args[:numkeys])
        return self.client.eval(script, numkeys, *args)


def test_the_driver_never_deletes_a_batch_lock_another_took(floor: Floor) -> None:
    batch = floor.batch("x", [request("x-0")])
    key = keys.batch_lock(floor.settings.namespace, batch)
    deps = Deps(floor.settings)
    try:
        proxy = TakenOverOnRelease(deps.sync_redis, key)
        deps.sync_redis = proxy  # type: ignore[assignment]
        driver = Driver(deps, Batches(deps.store))
        lock = getattr(driver, "lock", None)  # the driver's own (one driver at a time)
        if lock is not None:
            assert lock.acquire()
        driver.pass_once()
        assert len(floor.jobs("x")) == 1  # it stepped the batch
        assert proxy.taken and floor.redis.get(key) == b"another-driver"
    finally:
        deps.admission.close()


def test_a_driver_whose_lock_was_taken_stops_driving_and_leaves_it(floor: Floor) -> None:
    deps = Deps(floor.settings)
    driver = Driver(deps, Batches(deps.store))
    stop = threading.Event()
    thread = threading.Thread(target=driver.run, args=(stop,), daemon=True)
    thread.start()
    lock_key = keys.batch_driver_lock(floor.settings.namespace)
    try:
        wait_until(lambda: driver.lock.held, 20, "the driver to take its lock")
        floor.redis.set(lock_key, "another-driver", px=60_000)  # it lapsed, another took it
        floor.batch("x", [request("x-0")])
        wait_until(lambda: not driver.lock.held, 20, "the driver to see its lock taken")
        assert floor.jobs("x") == []  # it no longer drives
    finally:
        stop.set()
        thread.join(timeout=20)
        deps.admission.close()
    assert floor.redis.get(lock_key) == b"another-driver"


# -- input files read lazily, a few at a time -----------------------------------------


def test_the_driver_keeps_at_most_its_cache_of_input_files_and_rereads_the_rest(
        floor: Floor) -> None:
    made = [floor.batch(tenant, [request(f"{tenant}{i}-0"), request(f"{tenant}{i}-1")])
            for i, tenant in enumerate(("x", "y", "x"))]
    deps = Deps(floor.settings.model_copy(update={"batch_cache_files": 1,
                                                  "batch_in_flight": 1}))
    try:
        driver = Driver(deps, Batches(deps.store))
        assert driver.lock.acquire()
        for submitted in (1, 2):  # a line of each batch per pass, each file read again
            driver.pass_once()
            assert len(driver.cached_files) <= 1
            assert [floor.row(b).submitted for b in made] == [submitted] * 3
            floor.finish_jobs("x")
            floor.finish_jobs("y")
        driver.pass_once()
        assert len(driver.cached_files) <= 1
    finally:
        deps.admission.close()
    for batch_id, tenant in zip(made, ("x", "y", "x"), strict=True):
        done = floor.get(tenant, batch_id)
        assert done["status"] == "completed", done
        output = floor.http.get(f"/v1/files/{done['output_file_id']}/content",
                                headers=floor.auth(tenant)).text.splitlines()
        assert len({json.loads(line)["custom_id"] for line in output}) == 2


# -- the list's cursor is the tenant's own; ids with NUL -------------------------------


def test_after_with_another_tenants_batch_id_is_refused_as_an_unknown_one(floor: Floor) -> None:
    mine = [floor.batch("y", [request(f"y-{i}")]) for i in range(2)]
    theirs = floor.batch("x", [request("x-0")])  # newer than both of y's
    first = floor.http.get("/v1/batches", params={"after": mine[1]}, headers=floor.auth("y"))
    assert [b["id"] for b in first.json()["data"]] == [mine[0]]  # y's own cursor works
    for cursor in (theirs, "batch_0123456789abcdef01234567"):
        resp = floor.http.get("/v1/batches", params={"after": cursor}, headers=floor.auth("y"))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "after" and error["type"] == "invalid_request_error"
    # The store does not place a page by another's batch either.
    assert floor.batches.list_batches(floor.ids["y"], theirs, 10) == \
        floor.batches.list_batches(floor.ids["y"], None, 10)


def test_nul_in_a_batch_id_is_a_4xx_on_postgresql(redis_server: str, model_path: Path,
                                                  tmp_root: Path) -> None:
    postgres_or_skip()
    with private_database("tg_batch_isolation") as url, floor_on(url, tmp_root) as pg:
        batch = pg.batch("x", [request("x-0")])
        assert pg.get("x", batch)["id"] == batch
        auth = pg.auth("x")
        assert pg.http.get("/v1/batches/batch_%00x", headers=auth).status_code == 404
        assert pg.http.post("/v1/batches/batch_%00x/cancel", headers=auth).status_code == 404
        resp = pg.http.get("/v1/batches", params={"after": "batch_\x00"}, headers=auth)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "after"
