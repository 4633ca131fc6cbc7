"""The SDK retries what the API refuses for now (429, 503) after the API's Retry-After,
with the same idempotency key, so a retried submit makes one job. The API runs in-process
on its own Redis database and SQLite database; no worker is advertised until the first
refusal comes back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from tidegate_client import Client, TidegateError

from api.deps import FLEET_CACHE_S
from store import Store
from tests.helpers import in_process_api, own_db
from tests.stack.test_api_validation import advertise_worker
from tidegate.settings import Settings

Api = tuple[TestClient, Store, redis.Redis, Settings, str]


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Api]:
    with in_process_api(redis_server, tmp_root / "sdk-retries.db", own_db(__name__, "38"),
                        "sdk-retries",
                        ["chat"]) as app:
        yield app.http, app.store, app.redis, app.settings, app.key


def sdk(http: TestClient, key: str, retries: int) -> Client:
    """The SDK over the in-process app (TestClient is an httpx.Client); waits capped just
    past the API's fleet cache, so a retry sees the worker advertised meanwhile."""
    client = Client("http://testserver", key, retries=retries,
                    max_retry_wait_s=FLEET_CACHE_S + 0.05)
    client.http = TestClient(http.app, headers={"Authorization": f"Bearer {key}"})
    return client


def test_with_no_retries_the_refusal_is_the_callers(api: Api) -> None:
    http, _, _, _, key = api  # first in the module: no worker advertised yet
    client = sdk(http, key, retries=0)
    with pytest.raises(TidegateError) as err:
        client.submit("chat", prompt="Where is my parcel?", max_tokens=4)
    assert err.value.status == 503


def test_a_refused_submit_is_retried_with_its_key_and_makes_one_job(api: Api) -> None:
    http, store, redis_client, settings, key = api
    seen: list[tuple[int, str | None, str | None]] = []

    def on_response(resp: httpx.Response) -> None:
        seen.append((resp.status_code, resp.request.headers.get("idempotency-key"),
                     resp.headers.get("retry-after")))
        if resp.status_code == 503:  # a worker comes up while the client waits
            advertise_worker(redis_client, settings)

    client = sdk(http, key, retries=3)
    client.http.event_hooks = {"response": [on_response]}
    before = store.jobs.count_jobs()
    job = client.submit("chat", prompt="Where is my parcel?", max_tokens=4)
    assert [status for status, _, _ in seen] == [503, 202]
    assert seen[0][2] is not None and int(seen[0][2]) > 0  # the API said when
    assert seen[0][1] is not None and seen[0][1] == seen[1][1]  # one key for both tries
    assert store.jobs.count_jobs() == before + 1 and client.job(job["job_id"])["status"] == "queued"


def test_a_caller_given_key_is_sent_as_is(api: Api) -> None:
    http, _, redis_client, settings, key = api
    advertise_worker(redis_client, settings)
    sent: list[Any] = []
    client = sdk(http, key, retries=0)
    client.http.event_hooks = {"request": [sent.append]}
    first = client.submit("chat", prompt="Hello", max_tokens=4, idempotency_key="crm-42")
    again = client.submit("chat", prompt="Hello", max_tokens=4, idempotency_key="crm-42")
    assert first["job_id"] == again["job_id"] and again["created"] is False
    assert all("idempotency-key" not in req.headers for req in sent)  # the body's key rules
