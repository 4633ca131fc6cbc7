"""Bad input gets a 4xx JSON error naming the field, and nothing is enqueued: no job row,
no message in any lane queue. The API runs in-process on its own Redis DB and database,
with no worker consuming, so queue lengths show exactly what was enqueued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from store import Store, upgrade
from tests.stack import queue_length
from tidegate.settings import Settings

LANES = ("finance", "chat")
ApiUnderTest = tuple[TestClient, Store, redis.Redis, str]
OK = {"lane": "chat", "messages": [{"role": "user", "content": "Is my refund on its way?"}],
      "max_tokens": 8}


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[ApiUnderTest]:
    url = f"sqlite:///{tmp_root / 'validation.db'}"
    upgrade(url)
    redis_url = redis_server.rsplit("/", 1)[0] + "/1"
    settings = Settings(redis_url=redis_url, database_url=url, max_body_bytes=64 * 1024)
    store = Store(url)
    _, key = store.create_tenant("validation", ["chat"])
    client = redis.Redis.from_url(redis_url)
    with TestClient(create_app(settings)) as http:
        yield http, store, client, key
    client.flushdb()


def nothing_enqueued(store: Store, client: redis.Redis) -> bool:
    return store.count_jobs() == 0 and all(queue_length(client, q) == 0 for q in LANES)


def post(http: TestClient, key: str | None, body: object = None, raw: bytes | None = None):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = raw if raw is not None else json.dumps(body).encode()
    return http.post("/v1/jobs", content=content,
                     headers={**headers, "Content-Type": "application/json"})


LONG = "refund invoice order shipping " * 600

CASES = [
    ("malformed JSON", None, b'{"lane": "chat", ', 400, "body"),
    ("no messages", {"lane": "chat", "max_tokens": 8}, None, 422, "messages"),
    ("empty messages", {**OK, "messages": []}, None, 422, "messages"),
    ("unknown lane", {**OK, "lane": "gold"}, None, 422, "lane"),
    ("max_tokens zero", {**OK, "max_tokens": 0}, None, 422, "max_tokens"),
    ("max_tokens negative", {**OK, "max_tokens": -5}, None, 422, "max_tokens"),
    ("max_tokens above the lane", {**OK, "max_tokens": 257}, None, 422, "max_tokens"),
    ("negative temperature", {**OK, "temperature": -0.1}, None, 422, "temperature"),
    ("NaN temperature", None, json.dumps({**OK, "temperature": float("nan")}).encode(), 422,
     "temperature"),
    ("infinite temperature", None, json.dumps({**OK, "temperature": float("inf")}).encode(), 422,
     "temperature"),
    ("prompt above the lane's limit", {**OK, "messages": [{"role": "user", "content": LONG}]},
     None, 422, "messages"),
    ("priority outside 0-9", {**OK, "priority": 10}, None, 422, "priority"),
    ("unknown field", {**OK, "colour": "blue"}, None, 422, "colour"),
    ("body over the size limit", None, json.dumps({**OK, "pad": "x" * 70_000}).encode(), 413,
     "body"),
]


@pytest.mark.parametrize(("name", "body", "raw", "status", "field"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_field(api, name, body, raw, status, field) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    resp = post(http, key, body, raw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["field"] == field and field in error["message"]
    assert nothing_enqueued(store, client)


def test_prompt_longer_than_the_model_context(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    _, finance_key = store.create_tenant("validation-finance", ["finance"])
    # The test lanes let finance prompts reach 4096 tokens: the model's 2048 is the limit.
    body = {**OK, "lane": "finance", "messages": [{"role": "user", "content": LONG}]}
    resp = post(http, finance_key, body)
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "messages"
    assert "context" in resp.json()["error"]["message"]
    assert nothing_enqueued(store, client)


@pytest.mark.parametrize("header", [None, "Bearer tg_wrong", "Basic abc", "Bearer "])
def test_missing_or_wrong_api_key_is_401(api, header) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    headers = {"Authorization": header} if header else {}
    resp = http.post("/v1/jobs", json=OK, headers=headers)
    assert resp.status_code == 401
    assert resp.json()["error"]["field"] == "authorization"
    assert nothing_enqueued(store, client)


def test_a_lane_the_tenant_may_not_use_is_403(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    resp = post(http, key, {**OK, "lane": "finance"})
    assert resp.status_code == 403 and resp.json()["error"]["field"] == "lane"
    assert nothing_enqueued(store, client)


def test_valid_job_is_enqueued_once_with_its_priority(api) -> None:  # type: ignore[no-untyped-def]
    """The control for the cases above: the same checks do see a real enqueue."""
    http, store, client, key = api
    resp = post(http, key, {**OK, "priority": 3, "idempotency_key": "order-1"})
    assert resp.status_code == 202, resp.text
    again = post(http, key, {**OK, "priority": 3, "idempotency_key": "order-1"})
    assert again.status_code == 200 and again.json()["job_id"] == resp.json()["job_id"]
    assert store.count_jobs() == 1
    assert queue_length(client, "chat") == 1 and client.llen("chat|3") == 1
    job = store.get_job(resp.json()["job_id"])
    assert job is not None and job.status == "queued" and job.priority == 3
    # Clean up so the cases above (in any order) start from an empty queue.
    client.flushdb()
    store.delete_job(job.id)
