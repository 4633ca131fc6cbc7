"""A batch's minimum share (the batch lane's `batch_min_share`, 0.1 in tests/lanes.toml):
chat traffic that never lets up cannot starve a batch into expiry. The batch driver keeps
a tenth of a batch's jobs in flight at chat's default priority, served in turn with chat's
own jobs; the others run behind chat at the batch lane's priority, may hold only the rest
of the batch's slots, and are submitted only while chat's queue is empty (spare capacity),
never into a backlog.

The API runs in-process on its own Redis database with a chat worker's heartbeat advertised and
no worker consuming; the test plays a chat worker so busy that it serves nothing below
chat's priority: it ends only the jobs at chat's priority, as they come. The batch still
completes every line it can run that way, and the starved lines still hold no more than
their share of the slots."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from store import Store, upgrade
from tests.helpers import own_db, running_driver
from tests.stack.test_openai_validation import advertise_chat_worker
from tidegate.records import JobStatus
from tidegate.settings import Settings
from tidegate_tools.procs import wait_until

REDIS_DB = own_db(__name__, "21")
IN_FLIGHT = 10
LINES = 30
CHAT = "/v1/chat/completions"


def line(i: int) -> str:
    return json.dumps({"custom_id": f"share-{i}", "method": "POST", "url": CHAT, "body": {
        "model": "chat", "max_tokens": 4,
        "messages": [{"role": "user", "content": f"Order {i}: where is it?"}]}})


@pytest.fixture()
def floor(redis_server: str, model_path: Path,
          tmp_root: Path) -> Iterator[tuple[TestClient, Store, Settings, int, str]]:
    url = f"sqlite:///{tmp_root / f'batch-share-{uuid.uuid4().hex[:8]}.db'}"
    upgrade(url)
    redis_url = os.environ["TIDEGATE_REDIS_URL"].rsplit("/", 1)[0] + f"/{REDIS_DB}"
    settings = Settings(redis_url=redis_url, database_url=url, batch_poll_s=0.05,
                        batch_driver_lock_s=2, batch_in_flight=IN_FLIGHT)
    store = Store(url)
    record, key = store.tenants.create_tenant(f"share-{uuid.uuid4().hex[:6]}", ["chat", "batch"])
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_chat_worker(client, settings)
    try:
        with TestClient(create_app(settings)) as http:
            yield http, store, settings, record.id, key
    finally:
        client.flushdb()


def test_chat_traffic_cannot_starve_a_batch(
        floor: tuple[TestClient, Store, Settings, int, str]) -> None:
    http, store, settings, tenant_id, key = floor
    auth = {"Authorization": f"Bearer {key}"}
    chat_priority = settings.lanes["chat"].default_priority
    batch_lane = settings.lanes["batch"]
    reserved = math.ceil(batch_lane.batch_min_share * IN_FLIGHT)
    assert batch_lane.default_priority < chat_priority and reserved == 1

    body = "".join(line(i) + "\n" for i in range(LINES)).encode()
    upload = http.post("/v1/files", headers=auth, data={"purpose": "batch"},
                       files={"file": ("in.jsonl", body)})
    assert upload.status_code == 200, upload.text
    made = http.post("/v1/batches", headers=auth, json={
        "input_file_id": upload.json()["id"], "endpoint": CHAT, "completion_window": "24h"})
    assert made.status_code == 200, made.text
    batch_id = made.json()["id"]

    def jobs() -> list[Any]:
        return store.jobs.list_jobs(tenant_id)

    def served_at_chat_priority() -> int:
        """What a chat worker that never runs out of chat work does: it ends the jobs at
        chat's priority, and leaves every one behind them waiting."""
        ended = 0
        for job in jobs():
            if not job.terminal and job.priority >= chat_priority:
                store.runs.claim_job(job.id, "chat-batch@test", "vllm")
                store.runs.end_job(job.id, JobStatus.DONE, finish_reason="stop", output_text="soon",
                                   completion_tokens=2)
                ended += 1
        return ended

    plain_slots = IN_FLIGHT - reserved
    promoted_lines = LINES - plain_slots  # every line but those the starved ones hold
    with running_driver(settings):
        # The queue is empty at first: the spare capacity's lines, then the reserved one.
        wait_until(lambda: len(jobs()) == IN_FLIGHT, 30, "the batch's first lines queued")
        first = jobs()
        assert sum(1 for j in first if j.priority == chat_priority) == reserved
        assert sum(1 for j in first if j.priority == batch_lane.default_priority) == plain_slots
        assert {j.lane for j in first} == {"batch"}

        def progressed() -> bool:
            served_at_chat_priority()
            return http.get(f"/v1/batches/{batch_id}", headers=auth).json()[
                "request_counts"]["completed"] == promoted_lines

        wait_until(progressed, 60, "the batch to run its lines through its reserved share")
        waiting = [j for j in jobs() if not j.terminal]
        # The starved lines hold their share of the slots, never more.
        assert len(waiting) == plain_slots
        assert all(j.priority == batch_lane.default_priority for j in waiting)
        assert len(jobs()) == LINES  # every line was submitted
        # Into a backlog (the starved lines wait in the queue), promoted lines only.
        assert sum(1 for j in jobs() if j.priority == chat_priority) == promoted_lines
