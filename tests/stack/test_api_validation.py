"""Bad input gets a 4xx JSON error naming the field, and nothing is enqueued: no job row,
no message in any lane queue. The API runs in-process on its own Redis DB and database,
with no worker consuming, so queue lengths show exactly what was enqueued."""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.deps import FLEET_CACHE_S
from store import Store, upgrade
from tasks.app import queue_lengths
from tests.helpers import metric, own_redis_url
from tidegate import keys
from tidegate.settings import Settings

QUEUES = ("finance.vllm", "finance.trtllm", "chat.vllm", "chat.trtllm")
ApiUnderTest = tuple[TestClient, Store, redis.Redis, str]
OK = {"lane": "chat", "messages": [{"role": "user", "content": "Is my refund on its way?"}],
      "max_tokens": 8}


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[ApiUnderTest]:
    url = f"sqlite:///{tmp_root / 'validation.db'}"
    upgrade(url)
    redis_url = own_redis_url(redis_server, __name__, "1")
    settings = Settings(redis_url=redis_url, database_url=url, max_body_bytes=64 * 1024,
                        webhook_deny_hosts="denied.example")
    store = Store(url)
    _, key = store.tenants.create_tenant("validation", ["chat"])
    client = redis.Redis.from_url(redis_url)
    advertise_worker(client, settings)
    with TestClient(create_app(settings)) as http:
        yield http, store, client, key
    client.flushdb()


def advertise_worker(client: redis.Redis, settings: Settings) -> None:
    """The heartbeat an active vLLM worker of the chat lane would write. No worker runs
    here, so that the queue lengths show exactly what the API enqueued."""
    body = {"name": "chat-advertised@test", "state": "active", "lanes": ["chat"],
            "pool": "vllm", "engine": "vllm", "slots": 4, "lora": ["support"],
            "kv_cache_dtype": "fp8", "dtype": "float16", "stats": {}}
    client.set(keys.worker_heartbeat(settings.namespace, "chat-advertised@test"),
               json.dumps(body))


def waiting(client: redis.Redis, queue: str) -> int:
    """Messages in a lane queue, over its ten priority sub-lists."""
    return queue_lengths(client, [queue])[queue]


def nothing_enqueued(store: Store, client: redis.Redis) -> bool:
    return store.jobs.count_jobs() == 0 and all(waiting(client, q) == 0 for q in QUEUES)


def post(http: TestClient, key: str | None, body: object = None, raw: bytes | None = None):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = raw if raw is not None else json.dumps(body).encode()
    return http.post("/v1/jobs", content=content,
                     headers={**headers, "Content-Type": "application/json"})


def rejected(http: TestClient, reason: str, status: int) -> float:
    """`tidegate_requests_rejected_total` for the error's type and status, as /metrics
    shows it."""
    return metric(http.get("/metrics").text, "tidegate_requests_rejected_total",
                  reason=reason, status=str(status))


LONG = "refund invoice order shipping " * 600

CASES = [
    ("malformed JSON", None, b'{"lane": "chat", ', 400, "body"),
    ("no messages", {"lane": "chat", "max_tokens": 8}, None, 422, "messages"),
    ("empty messages", {**OK, "messages": []}, None, 422, "messages"),
    ("unknown lane", {**OK, "lane": "gold"}, None, 422, "lane"),
    ("callback not http", {**OK, "callback_url": "ftp://crm.example.com/x"}, None, 422,
     "callback_url"),
    ("callback denied host", {**OK, "callback_url": "https://denied.example/x"}, None, 422,
     "callback_url"),
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
    ("negative priority", {**OK, "priority": -1}, None, 422, "priority"),
    ("deadline_s above the lane", {**OK, "deadline_s": 61}, None, 422, "deadline_s"),
    ("unknown LoRA adapter", {**OK, "lora": "nope"}, None, 422, "lora"),
    ("unknown field", {**OK, "colour": "blue"}, None, 422, "colour"),
    ("body over the size limit", None, json.dumps({**OK, "pad": "x" * 70_000}).encode(), 413,
     "body"),
    # Text no field may hold (issue 10, finding 11): NUL, which PostgreSQL refuses, and a
    # lone surrogate, which cannot be encoded to UTF-8.
    ("NUL in a message", {**OK, "messages": [{"role": "user", "content": "refund\u0000"}]},
     None, 400, "messages.0.content"),
    ("lone surrogate in the prompt", None,
     b'{"lane": "chat", "prompt": "refund \\ud800", "max_tokens": 8}', 400, "prompt"),
    ("NUL in session_id", {**OK, "session_id": "chat\u0000"}, None, 400, "session_id"),
    ("lone surrogate in a field name", None,
     b'{"lane": "chat", "\\udc00": 1, "prompt": "refund", "max_tokens": 8}', 400,
     "\\udc00"),
    ("arrays nested too deeply", None,
     b'{"lane": "chat", "pad": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "body"),
]


@pytest.mark.parametrize(("name", "body", "raw", "status", "field"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_field(api, name, body, raw, status, field) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    counted = rejected(http, "invalid_request", status)
    resp = post(http, key, body, raw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["field"] == field and field in error["message"]
    assert error["type"] == "invalid_request"
    assert nothing_enqueued(store, client)
    assert rejected(http, "invalid_request", status) == counted + 1


def test_prompt_longer_than_the_model_context(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    _, finance_key = store.tenants.create_tenant("validation-finance", ["finance"])
    # The test lanes let finance prompts reach 4096 tokens: the model's 2048 is the limit.
    body = {**OK, "lane": "finance", "messages": [{"role": "user", "content": LONG}]}
    resp = post(http, finance_key, body)
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "messages"
    assert "context" in resp.json()["error"]["message"]
    assert nothing_enqueued(store, client)


@pytest.mark.parametrize(("header", "value"), [
    ("Idempotency-Key", b"k" * 256),  # the store's column holds 255
    ("Idempotency-Key", b"order 1"),
    ("Idempotency-Key", "ordre-n\xb01".encode("latin-1")),
    ("Authorization", b"Bearer " + b"k" * 1100),
    ("Authorization", b"Bearer tg_\x7f"),
])
def test_a_header_of_the_wrong_shape_is_400_naming_it(api, header, value) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    field = header.lower()
    counted = rejected(http, "invalid_request", 400)
    headers = {"Authorization": f"Bearer {key}", header: value}
    resp = http.post("/v1/jobs", json=OK, headers=headers)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["field"] == field and field in error["message"]
    assert error["type"] == "invalid_request"
    assert nothing_enqueued(store, client)
    assert rejected(http, "invalid_request", 400) == counted + 1


@pytest.mark.parametrize("header", [None, "Bearer tg_wrong", "Basic abc", "Bearer "])
def test_missing_or_wrong_api_key_is_401(api, header) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    headers = {"Authorization": header} if header else {}
    resp = http.post("/v1/jobs", json=OK, headers=headers)
    assert resp.status_code == 401
    assert resp.json()["error"]["field"] == "authorization"
    assert resp.json()["error"]["type"] == "unauthorized"
    assert nothing_enqueued(store, client)


def test_a_lane_the_tenant_may_not_use_is_403(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    resp = post(http, key, {**OK, "lane": "finance"})
    assert resp.status_code == 403 and resp.json()["error"]["field"] == "lane"
    assert resp.json()["error"]["type"] == "forbidden"
    assert nothing_enqueued(store, client)


def test_valid_job_is_enqueued_once_with_its_priority(api) -> None:  # type: ignore[no-untyped-def]
    """The control for the cases above: the same checks do see a real enqueue."""
    http, store, client, key = api
    resp = post(http, key, {**OK, "priority": 3, "idempotency_key": "order-1"})
    assert resp.status_code == 202, resp.text
    again = post(http, key, {**OK, "priority": 3, "idempotency_key": "order-1"})
    assert again.status_code == 200 and again.json()["job_id"] == resp.json()["job_id"]
    assert store.jobs.count_jobs() == 1
    # Public priority 3 of 0-9 (9 most urgent) is Redis step 6; no TensorRT-LLM worker
    # advertises, so the job went to the vLLM pool.
    assert waiting(client, "chat.vllm") == 1 and client.llen("chat.vllm|6") == 1
    job = store.jobs.get_job(resp.json()["job_id"])
    assert job is not None and job.status == "queued" and job.priority == 3
    assert job.route_reason is not None
    assert "pool trtllm: no healthy active worker" in job.route_reason
    _cleanup(store, client, job.id)


def test_the_task_carries_the_system_turns_length_for_kv_retention(api) -> None:  # type: ignore[no-untyped-def]
    """Engines that keep KV blocks per token range (TensorRT-LLM) learn how long the shared
    system turn is from the task; a job without one says 0."""
    http, store, client, key = api
    system = {"role": "system", "content": "You answer for the shop's service desk."}
    sent = {}
    for name, messages in (("with", [system, *OK["messages"]]), ("without", OK["messages"])):
        resp = post(http, key, {**OK, "messages": messages})
        assert resp.status_code == 202, resp.text
        (raw,) = client.lrange("chat.vllm|5", 0, -1)  # the lane's default priority, 4
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        sent[name] = body[0][0]["shared_prefix_tokens"]
        _cleanup(store, client, resp.json()["job_id"])
    assert sent["with"] > 5 and sent["without"] == 0


def _cleanup(store: Store, client: redis.Redis, job_id: str) -> None:
    """Empty the queues so the other cases (in any order) start from nothing enqueued."""
    for queue in QUEUES:
        client.delete(*keys.queue_sublists(queue))
    store.jobs.delete_job(job_id)


def test_no_active_worker_for_the_lane_is_503_with_retry_after(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    _, finance_key = store.tenants.create_tenant("validation-no-worker", ["finance"])
    counted = rejected(http, "unavailable", 503)
    resp = post(http, finance_key, {**OK, "lane": "finance"})
    assert resp.status_code == 503 and "Retry-After" in resp.headers
    assert resp.json()["error"]["type"] == "unavailable"
    assert rejected(http, "unavailable", 503) == counted + 1
    assert "no healthy worker serves lane 'finance'" in resp.json()["error"]["message"]
    assert nothing_enqueued(store, client)


def test_revoked_key_is_401(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    store.tenants.create_tenant("validation-revoked", ["chat"])
    _, key = store.tenants.create_tenant("validation-revoked-2", ["chat"])
    assert store.tenants.revoke_tenant("validation-revoked-2")
    resp = post(http, key, OK)
    assert resp.status_code == 401 and resp.json()["error"]["field"] == "authorization"
    assert nothing_enqueued(store, client)


def test_rate_limits_answer_429_with_retry_after(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    _, key = store.tenants.create_tenant("validation-limited", ["chat"], requests_per_minute=2)
    accepted = [post(http, key, {**OK, "idempotency_key": f"rl-{i}"}) for i in range(2)]
    assert [r.status_code for r in accepted] == [202, 202]
    refused = post(http, key, {**OK, "idempotency_key": "rl-3"})
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limited"
    # The sliding window (tidegate/ratelimit.py) is whole again at most two minutes on.
    assert 1 <= int(refused.headers["Retry-After"]) <= 120
    assert "2 requests per minute" in refused.json()["error"]["message"]
    assert store.jobs.count_jobs() == 2 and waiting(client, "chat.vllm") == 2
    for r in accepted:
        _cleanup(store, client, r.json()["job_id"])
    _, tok_key = store.tenants.create_tenant("validation-tokens", ["chat"], tokens_per_minute=50)
    big = post(http, tok_key, {**OK, "max_tokens": 60})  # prompt + 60 > 50 tokens
    assert big.status_code == 429 and "tokens per minute" in big.json()["error"]["message"]
    assert nothing_enqueued(store, client)


# -- replays and sessions: checked before anything is charged, routed or written ---------


def post_keyed(http: TestClient, key: str, where: str, idempotency_key: str):  # type: ignore[no-untyped-def]
    """A valid job whose idempotency key is in the `Idempotency-Key` header or the body."""
    if where == "body":
        return post(http, key, {**OK, "idempotency_key": idempotency_key})
    return http.post("/v1/jobs", json=OK, headers={"Authorization": f"Bearer {key}",
                                                   "Idempotency-Key": idempotency_key})


@contextlib.contextmanager
def cleaned_up(store: Store, client: redis.Redis, job_id: str) -> Iterator[None]:
    """_cleanup even when the case fails, so the cases after it start from nothing."""
    try:
        yield
    finally:
        _cleanup(store, client, job_id)


def rate_counters(http: TestClient, client: redis.Redis, tenant_id: int) -> tuple[int, list]:  # type: ignore[type-arg]
    """The minute, and what is left of the tenant's requests and tokens limits (the
    sliding windows of tidegate/ratelimit.py, as the API reads them)."""
    limiter = http.app.state.deps.rate_limits  # type: ignore[attr-defined]
    minute = int(time.time() // 60)
    return minute, [limiter.window(kind, tenant_id, limit).remaining
                    for kind, limit in (("requests", 100), ("tokens", 100_000))]


@pytest.mark.parametrize("where", ["header", "body"])
def test_a_replayed_idempotency_key_is_not_charged_again(api, where) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    tenant, key = store.tenants.create_tenant(f"validation-replay-{where}", ["chat"],
                                              requests_per_minute=100, tokens_per_minute=100_000)
    first = post_keyed(http, key, where, f"replay-{where}")
    assert first.status_code == 202, first.text
    with cleaned_up(store, client, first.json()["job_id"]):
        for _ in range(3):  # a minute boundary between the two reads: replay again
            minute, before = rate_counters(http, client, tenant.id)
            again = post_keyed(http, key, where, f"replay-{where}")
            after_minute, after = rate_counters(http, client, tenant.id)
            if after_minute == minute:
                break
        else:
            pytest.skip("the minute changed between the counter reads three times")
        assert again.status_code == 200 and again.json()["job_id"] == first.json()["job_id"]
        assert after == before
        assert store.jobs.count_jobs() == 1 and waiting(client, "chat.vllm") == 1


def test_a_replay_at_the_rate_limit_answers_with_the_job(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, _ = api
    tenant, key = store.tenants.create_tenant("validation-replay-at-limit", ["chat"],
                                              requests_per_minute=1)
    first = post_keyed(http, key, "header", "at-limit")
    assert first.status_code == 202, first.text
    with cleaned_up(store, client, first.json()["job_id"]):
        # The first submit spent the one request of the sliding window (tidegate/ratelimit.py).
        again = post_keyed(http, key, "header", "at-limit")
        assert again.status_code == 200, again.text
        assert again.json()["job_id"] == first.json()["job_id"]
        assert post_keyed(http, key, "header", "at-limit-new").status_code == 429  # control
        assert store.jobs.count_jobs() == 1 and waiting(client, "chat.vllm") == 1


def test_a_replay_with_no_worker_for_the_lane_answers_with_the_job(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    settings = http.app.state.deps.settings
    first = post_keyed(http, key, "header", "unrouted")
    assert first.status_code == 202, first.text
    client.delete(keys.worker_heartbeat(settings.namespace, "chat-advertised@test"))
    with cleaned_up(store, client, first.json()["job_id"]):
        try:
            time.sleep(FLEET_CACHE_S + 0.1)  # the API's cached fleet is read again
            assert post_keyed(http, key, "header", "unrouted-new").status_code == 503  # control
            again = post_keyed(http, key, "header", "unrouted")
            assert again.status_code == 200, again.text
            assert again.json()["job_id"] == first.json()["job_id"]
            assert store.jobs.count_jobs() == 1 and waiting(client, "chat.vllm") == 1
        finally:
            advertise_worker(client, settings)
            time.sleep(FLEET_CACHE_S + 0.1)  # the next cases see the worker again


# -- DELETE and session affinity: what the API does with nothing consuming ---------------


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sse_events(http: TestClient, key: str, job_id: str) -> list[dict]:  # type: ignore[type-arg]
    """The job's SSE events (the stream ends at a terminal one)."""
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth(key)) as resp:
        assert resp.status_code == 200
        return [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]


def test_delete_of_a_queued_job_ends_it_cancelled_for_its_consumer(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    job_id = post(http, key, OK).json()["job_id"]
    with cleaned_up(store, client, job_id):
        resp = http.delete(f"/v1/jobs/{job_id}", headers=auth(key))
        assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
        job = store.jobs.get_job(job_id)
        assert job is not None and job.status == "cancelled" and job.started_at is None
        # No worker ever ran it: its consumer still hears the end.
        (done,) = sse_events(http, key, job_id)
        assert done["kind"] == "done" and done["data"]["finish_reason"] == "cancelled"


def test_a_second_delete_answers_with_the_cancelled_job(api) -> None:  # type: ignore[no-untyped-def]
    """DELETE is idempotent (issue 10, finding 7): the second writes no second end event
    (Redis refuses its id) and answers 200 with the job, as the first did."""
    http, store, client, key = api
    job_id = post(http, key, OK).json()["job_id"]
    with cleaned_up(store, client, job_id):
        answers = [http.delete(f"/v1/jobs/{job_id}", headers=auth(key)) for _ in range(2)]
        assert [r.status_code for r in answers] == [200, 200], answers[1].text
        assert answers[1].json()["status"] == "cancelled" and answers[1].json()["id"] == job_id
        (done,) = sse_events(http, key, job_id)  # one end event, as after one DELETE
        assert done["kind"] == "done" and done["data"]["finish_reason"] == "cancelled"


def test_delete_of_another_tenants_job_is_404_and_leaves_it_queued(api) -> None:  # type: ignore[no-untyped-def]
    http, store, client, key = api
    _, other_key = store.tenants.create_tenant("validation-other-deleter", ["chat"])
    job_id = post(http, key, OK).json()["job_id"]
    with cleaned_up(store, client, job_id):
        resp = http.delete(f"/v1/jobs/{job_id}", headers=auth(other_key))
        assert resp.status_code == 404
        assert resp.json()["error"]["type"] == "not_found"
        job = store.jobs.get_job(job_id)
        assert job is not None and job.status == "queued"
        ns = http.app.state.deps.settings.namespace
        assert not client.exists(keys.job_cancel(ns, job_id))
        assert not client.exists(keys.job_events(ns, job_id))
        assert waiting(client, "chat.vllm") == 1


@pytest.mark.parametrize("affinity", [True, False])
def test_session_affinity_setting(api, affinity: bool) -> None:  # type: ignore[no-untyped-def]
    """On, a session's turn goes to the direct queue of the worker holding its prefix;
    off (TIDEGATE_SESSION_AFFINITY=false), to the lane's pool like any job."""
    http, store, client, key = api
    settings = http.app.state.deps.settings.model_copy(update={"session_affinity": affinity})
    direct = keys.direct_queue(settings.namespace, "chat-advertised@test")
    session = f"validation-affinity-{affinity}"
    body = {**OK, "session_id": session}
    with TestClient(create_app(settings)) as other:
        first = post(other, key, body)
        assert first.status_code == 202, first.text
        with cleaned_up(store, client, first.json()["job_id"]):
            tenant_id = store.jobs.get_job(first.json()["job_id"]).tenant_id  # type: ignore[union-attr]
            # it ran there
            store.sessions.set_session_worker(session, tenant_id, "chat-advertised@test")
            resp = post(other, key, body)
            assert resp.status_code == 202, resp.text
            with cleaned_up(store, client, resp.json()["job_id"]):
                job = store.jobs.get_job(resp.json()["job_id"])
                client.delete(*keys.queue_sublists(direct))
    assert job is not None and job.route_reason is not None
    if affinity:
        assert job.queue == direct and job.route_reason.startswith("session affinity")
    else:
        assert job.queue == "chat.vllm" and "session affinity" not in job.route_reason
