"""The Batch API's bounds as its driver keeps them (issue 33): a batch longer than
TIDEGATE_BATCH_IN_FLIGHT never has more than that many jobs queued or running; a line the
lane or the tenant refuses with a 429 or a 503 at submit waits and is submitted later,
never failed; and a batch still open at the end of its 24 h completion window ends
`expired`, its unfinished lines in the error file as `batch_expired`, as OpenAI's does.

The API runs in-process on its own Redis database and a SQLite file of its own, a chat worker's
heartbeat advertised and no worker consuming: a job a batch submits stays queued until the
test ends it in the store, as a worker would. The driver (api/batch_driver.py's Driver) is
stepped in this process one pass at a time, so each count is read between two passes; the
24 h are crossed by the driver's clock (`utcnow` in api/batch_driver.py), not waited for.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import api.batch_driver
from api.batch_driver import Driver
from api.deps import Deps
from store.batches import Batches
from tests.helpers import own_db
from tests.stack.test_batch_isolation import Floor, floor_on, request
from tests.stack.test_openai_validation import advertise_chat_worker
from tidegate import keys
from tidegate.records import JobStatus
from tidegate_tools.procs import wait_until

REDIS_DB = own_db(__name__, "32")
CAP = 3  # TIDEGATE_BATCH_IN_FLIGHT here
DAY = timedelta(hours=24)  # the batch's completion window, as OpenAI's "24h"


@pytest.fixture(autouse=True)
def services(redis_server: str, model_path: Path) -> None:
    """The session's Redis and the test checkpoint (the API counts prompt tokens)."""


def plain_batch_lanes(tmp_root: Path) -> Path:
    """The tests' lanes file, its batch lane without `batch_min_share`: every line at the
    lane's own priority, so TIDEGATE_BATCH_IN_FLIGHT alone bounds the batch (a min share
    holds promoted lines to their share while the host lane has a backlog, and the jobs
    here stay queued)."""
    text = (Path(__file__).parents[1] / "lanes.toml").read_text()
    assert "\nbatch_min_share = 0.1\n" in text
    path = tmp_root / "batch-limits-lanes.toml"
    path.write_text(text.replace("\nbatch_min_share = 0.1\n", "\n"))
    return path


@contextlib.contextmanager
def floor_on_db(tmp_root: Path, **values: Any) -> Iterator[Floor]:
    """The API in-process on a SQLite file of its own and Redis database REDIS_DB (emptied
    before and after), tenants `x` and `y` on the chat and batch lanes."""
    url = f"sqlite:///{tmp_root / f'batch-limits-{uuid.uuid4().hex[:8]}.db'}"
    with floor_on(url, tmp_root, REDIS_DB, namespace="tgbatchlimits",
                  lanes_file=plain_batch_lanes(tmp_root), **values) as floor:
        yield floor


@contextlib.contextmanager
def driver_of(floor: Floor) -> Iterator[Driver]:
    """A driver of the floor's batches holding the driver lock, stepped by the test."""
    deps = Deps(floor.settings)
    try:
        driver = Driver(deps, Batches(deps.store))
        assert driver.lock.acquire()
        yield driver
        driver.lock.release()
    finally:
        deps.admission.close()
        deps.sync_redis.close()


def in_flight(floor: Floor, tenant: str) -> list[Any]:
    return [job for job in floor.jobs(tenant)
            if job.status in (JobStatus.QUEUED, JobStatus.RUNNING)]


def finish_one(floor: Floor, tenant: str) -> None:
    """What a worker does with one of the tenant's queued jobs: it runs and ends `done`."""
    job = next(job for job in floor.jobs(tenant) if not job.terminal)
    floor.store.runs.claim_job(job.id, "chat-batch@test", "vllm")
    floor.store.runs.end_job(job.id, JobStatus.DONE, finish_reason="stop", output_text="on its way",
                             completion_tokens=3)


def pass_until(driver: Driver, done: Callable[[], bool], what: str) -> None:
    """Driver passes until `done`: the tenant's in-flight count the submit path reads
    may be up to api.limits.IN_FLIGHT_FRESH_S old, so a freed place shows a pass later."""
    def passed() -> bool:
        driver.pass_once()
        return done()

    wait_until(passed, 30, what, poll_s=0.05)


def file_lines(floor: Floor, tenant: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    resp = floor.http.get(f"/v1/files/{file_id}/content", headers=floor.auth(tenant))
    assert resp.status_code == 200, resp.text
    return [json.loads(line) for line in resp.text.splitlines()]


# -- the in-flight cap ------------------------------------------------------------------


def test_a_batch_longer_than_its_in_flight_cap_keeps_at_most_the_cap_in_flight(
        tmp_root: Path) -> None:
    lines = 8
    with floor_on_db(tmp_root, batch_in_flight=CAP) as floor, driver_of(floor) as driver:
        batch = floor.batch("x", [request(f"cap-{i}") for i in range(lines)])
        seen: list[int] = []
        while floor.get("x", batch)["status"] != "completed":
            driver.pass_once()
            count = len(in_flight(floor, "x"))
            seen.append(count)
            assert count <= CAP, f"{count} of the batch's jobs in flight, the cap is {CAP}"
            if count:
                finish_one(floor, "x")
            assert len(seen) <= 3 * lines, f"the batch never completed: {seen}"
        # Full while lines were left: a line ended, one more was sent.
        assert seen[:lines - CAP + 1] == [CAP] * (lines - CAP + 1), seen
        done = floor.get("x", batch)
    assert done["request_counts"] == {"total": lines, "completed": lines, "failed": 0}
    output = file_lines(floor, "x", done["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == sorted(f"cap-{i}"
                                                                 for i in range(lines))


def test_lines_refused_429_by_the_tenants_cap_are_submitted_later_not_failed(
        tmp_root: Path) -> None:
    """The tenant may have 2 jobs in flight, the batch 3: the third line's submit answers
    429 too_many_in_flight; it waits in the store and goes once a job has ended."""
    lines = 5
    with floor_on_db(tmp_root, batch_in_flight=CAP, max_in_flight_per_tenant=2) as floor, \
            driver_of(floor) as driver:
        batch = floor.batch("x", [request(f"busy-{i}") for i in range(lines)])
        driver.pass_once()
        assert len(in_flight(floor, "x")) == 2
        row = floor.row(batch)
        assert row.submitted == 2 and row.line_errors == [] and row.failed == 0
        for _ in range(3):  # refused on every pass while the tenant is full
            driver.pass_once()
        assert floor.row(batch).submitted == 2
        assert floor.get("x", batch)["request_counts"]["failed"] == 0
        while floor.row(batch).submitted < lines:
            finish_one(floor, "x")
            submitted = floor.row(batch).submitted
            pass_until(driver, lambda s=submitted: floor.row(batch).submitted > s,  # type: ignore[misc]
                       "the refused line to be submitted once a place is free")
            assert len(in_flight(floor, "x")) <= 2
        while in_flight(floor, "x"):
            finish_one(floor, "x")
        pass_until(driver, lambda: floor.get("x", batch)["status"] == "completed",
                   "the batch to complete")
        assert floor.get("x", batch)["request_counts"] == {
            "total": lines, "completed": lines, "failed": 0}


def test_lines_refused_503_while_no_worker_serves_the_lane_are_submitted_later(
        tmp_root: Path) -> None:
    """No worker's heartbeat: the lane's submit answers 503; the batch waits, and goes on
    once a worker is back."""
    with floor_on_db(tmp_root, batch_in_flight=CAP) as floor, driver_of(floor) as driver:
        beat = keys.worker_heartbeat(floor.settings.namespace, "chat-batch@test")
        floor.redis.delete(beat)
        refused = floor.http.post("/v1/chat/completions", headers=floor.auth("y"), json={
            "model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 503, refused.text  # what each line's submit meets
        batch = floor.batch("x", [request(f"down-{i}") for i in range(2)])
        for _ in range(3):
            driver.pass_once()
        row = floor.row(batch)
        assert row.submitted == 0 and row.line_errors == [] and floor.jobs("x") == []
        assert floor.get("x", batch)["status"] == "in_progress"
        advertise_chat_worker(floor.redis, floor.settings)
        pass_until(driver, lambda: len(in_flight(floor, "x")) == 2,
                   "the lines to be submitted once a worker is back")
        assert floor.row(batch).line_errors == []


# -- the 24 h completion window -------------------------------------------------------


def test_a_batch_past_its_24h_window_ends_expired_with_its_unfinished_lines_expired(
        tmp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = 6
    with floor_on_db(tmp_root, batch_in_flight=CAP) as floor, driver_of(floor) as driver:
        batch = floor.batch("x", [request(f"late-{i}") for i in range(lines)])
        made = floor.get("x", batch)
        assert made["expires_at"] - made["created_at"] == DAY.total_seconds()
        driver.pass_once()
        finish_one(floor, "x")
        driver.pass_once()  # one line done, three in flight, two never sent
        assert floor.row(batch).submitted == CAP + 1
        assert floor.get("x", batch)["status"] == "in_progress"  # a day is not over yet
        ahead = datetime.fromtimestamp(made["expires_at"], UTC)
        monkeypatch.setattr(api.batch_driver, "utcnow", lambda: ahead + timedelta(seconds=1))
        pass_until(driver, lambda: floor.get("x", batch)["status"] == "expired",
                   "the batch past its window to end expired")
        final = floor.get("x", batch)
        output = file_lines(floor, "x", final["output_file_id"])
        errors = file_lines(floor, "x", final["error_file_id"])
        jobs = floor.jobs("x")
    assert final["expired_at"] is not None
    done = [line["custom_id"] for line in output]
    assert len(done) == 1, done
    expired = {line["custom_id"]: line for line in errors}
    assert sorted([*done, *expired]) == sorted(f"late-{i}" for i in range(lines))
    for line in expired.values():
        assert line["response"] is None and line["error"]["code"] == "batch_expired", line
    assert final["request_counts"] == {"total": lines, "completed": 1, "failed": lines - 1}
    # The lines in flight at the expiry were cancelled: no job is left to run.
    assert not any(job.status in (JobStatus.QUEUED, JobStatus.RUNNING) for job in jobs)
