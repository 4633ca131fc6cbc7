"""The OpenAI-compatible endpoints refuse bad input in OpenAI's error shape, naming the
`param`, through the official `openai` SDK, unchanged; and a refused request leaves no job
row and no queue message. The API runs in-process on its own Redis DB and database, with
a chat worker's heartbeat advertised and no worker consuming, so the queues show exactly
what was enqueued (as tests/stack/test_api_validation.py). Besides: a batch goes on after
its API and driver processes (real ones, `tidegate api` and `tidegate batches`) are
SIGKILLed, finished by new ones."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from store import Store, upgrade
from tests.helpers import own_redis_url
from tests.stack.test_api_validation import advertise_worker, nothing_enqueued
from tidegate import keys
from tidegate.records import JobStatus
from tidegate.settings import Settings
from tidegate_tools.procs import Proc, free_port, start_api, start_batches, wait_until
from tidegate_tools.stack import api_ready

USER = [{"role": "user", "content": "Where is my parcel?"}]


class Api:
    def __init__(self, http: TestClient, store: Store, client: redis.Redis, key: str,
                 other_key: str) -> None:
        self.http, self.store, self.redis, self.key, self.other_key = (
            http, store, client, key, other_key)

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key or self.key,
                             http_client=self.http, max_retries=0)


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_root / 'openai-validation.db'}"
    upgrade(url)
    redis_url = own_redis_url(redis_server, __name__, "36")
    settings = Settings(redis_url=redis_url, database_url=url, batch_max_lines=3)
    store = Store(url)
    _, key = store.tenants.create_tenant("openai-validation", ["chat", "batch"])
    _, other = store.tenants.create_tenant("openai-chat-only", ["chat"])
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_worker(client, settings)
    try:
        with TestClient(create_app(settings)) as http:
            yield Api(http, store, client, key, other)
    finally:
        client.flushdb()


def chat(api: Api, key: str | None = None, **fields: Any) -> Any:
    body = {"model": "tidegate-test", "messages": USER, "max_tokens": 4, **fields}
    extra = {k: body.pop(k) for k in list(body) if k in ("lane", "tools", "bogus", "n")}
    return api.sdk(key).chat.completions.create(**body, extra_body=extra or None)


CASES = [  # (fields, the SDK's error class, status, param)
    ({"n": 17}, openai.BadRequestError, 400, "n"),  # above MAX_N
    ({"top_logprobs": 2}, openai.BadRequestError, 400, "top_logprobs"),  # without logprobs
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, openai.BadRequestError,
     400, "tools"),
    ({"temperature": 3}, openai.BadRequestError, 400, "temperature"),
    ({"messages": []}, openai.BadRequestError, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, openai.BadRequestError, 400,
     "messages.0.tool_call_id"),
    ({"messages": [{"role": "critic", "content": "x"}]}, openai.BadRequestError, 400,
     "messages.0.role"),
    ({"stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, 400, "stop"),
    ({"max_tokens": 100_000}, openai.BadRequestError, 400, "max_tokens"),
    ({"service_tier": "turbo"}, openai.BadRequestError, 400, "service_tier"),
    ({"model": "gpt-9"}, openai.NotFoundError, 404, "model"),
    ({"service_tier": "priority"}, openai.PermissionDeniedError, 403, "service_tier"),
    ({"lane": "finance"}, openai.PermissionDeniedError, 403, "lane"),
]


@pytest.mark.parametrize(("fields", "error", "status", "param"), CASES,
                         ids=[next(iter(c[0])) + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_refused_naming_the_param_and_enqueues_nothing(
        api: Api, fields: dict[str, Any], error: type[openai.APIStatusError], status: int,
        param: str) -> None:
    with pytest.raises(error) as caught:
        chat(api, **fields)
    assert caught.value.status_code == status
    body = caught.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}
    assert body["param"] == param
    assert nothing_enqueued(api.store, api.redis)


def test_a_wrong_key_is_an_authentication_error_in_openais_shape(api: Api) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(api, key="tg_not-a-key")
    assert caught.value.code == "invalid_api_key" and caught.value.param == "authorization"
    assert nothing_enqueued(api.store, api.redis)


def test_a_tier_the_tenant_may_not_use_names_it(api: Api) -> None:
    with pytest.raises(openai.PermissionDeniedError) as caught:
        chat(api, key=api.other_key, service_tier="flex")
    assert "'batch'" in caught.value.message and caught.value.param == "service_tier"


def test_completions_refuse_what_they_do_not_support(api: Api) -> None:
    sdk = api.sdk()
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="tidegate-test", prompt="Hello", echo=True)
    assert caught.value.param == "echo"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="tidegate-test", prompt=["a", "b"])
    assert caught.value.param == "prompt"
    assert nothing_enqueued(api.store, api.redis)


def test_models_lists_the_model_and_the_lanes(api: Api) -> None:
    ids = [m.id for m in api.sdk().models.list()]
    assert ids[0] == "tidegate-test" and {"chat", "finance", "batch"} <= set(ids)


def test_bad_files_and_batches_are_refused_naming_the_field(api: Api) -> None:
    sdk = api.sdk()
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="assistants")
    assert caught.value.param == "purpose"
    too_many = b"".join(json.dumps({"custom_id": str(i)}).encode() + b"\n" for i in range(4))
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("in.jsonl", io.BytesIO(too_many)), purpose="batch")
    assert caught.value.param == "file" and "at most 3" in caught.value.message
    good = sdk.files.create(file=("in.jsonl", io.BytesIO(b'{"custom_id": "1"}\n')),
                            purpose="batch")
    assert good.bytes == 19 and good.purpose == "batch"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.batches.create(input_file_id=good.id, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                           completion_window="24h")
    assert caught.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                           completion_window="1h")  # type: ignore[arg-type]
    assert caught.value.param == "completion_window"
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                           completion_window="24h")
    assert caught.value.param == "input_file_id"
    assert nothing_enqueued(api.store, api.redis)


def advertise_chat_worker(client: redis.Redis, settings: Settings) -> None:
    """A chat worker's heartbeat, as one that also runs the batch lane writes it."""
    body = {"name": "chat-batch@test", "state": "active", "lanes": ["chat", "batch"],
            "pool": "vllm", "engine": "vllm", "slots": 4, "kv_cache_dtype": "fp8",
            "dtype": "float16", "stats": {}}
    client.set(keys.worker_heartbeat(settings.namespace, "chat-batch@test"), json.dumps(body))


def test_a_batch_goes_on_after_its_api_and_driver_processes_are_killed(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    """A batch's state is in the store: the API process that took it and the driver that
    submitted its lines are SIGKILLed, a worker ends its jobs, and a new API process and
    driver finish the batch and write its output file, no line submitted twice."""
    url = f"sqlite:///{tmp_root / 'openai-restart.db'}"
    upgrade(url)
    redis_url = own_redis_url(redis_server, __name__, "37")
    settings = Settings(redis_url=redis_url, database_url=url)
    env = {**os.environ, "TIDEGATE_REDIS_URL": redis_url, "TIDEGATE_DATABASE_URL": url,
           "TIDEGATE_BATCH_POLL_S": "0.05", "TIDEGATE_BATCH_DRIVER_LOCK_S": "2"}
    store = Store(url)
    tenant, key = store.tenants.create_tenant("batch-restart", ["chat", "batch"])
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_chat_worker(client, settings)
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/chat/completions",
                                "body": {"model": "chat", "messages": USER, "max_tokens": 2}})
                    + "\n" for i in range(2)).encode()
    try:
        with api_and_driver(env, tmp_root / "logs", "first", key) as (sdk, procs):
            upload = sdk.files.create(file=("in.jsonl", io.BytesIO(lines)), purpose="batch")
            batch = sdk.batches.create(input_file_id=upload.id,
                                       endpoint="/v1/chat/completions", completion_window="24h")
            wait_until(lambda: len(store.jobs.list_jobs(tenant.id)) == 2, 120,
                       "the first driver to submit the batch's lines", procs)
            for proc in procs:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        jobs = store.jobs.list_jobs(tenant.id)
        assert {job.lane for job in jobs} == {"batch"} and all(j.priority == 0 for j in jobs)
        for job in jobs:  # what a worker does with them, while no API process runs
            store.runs.claim_job(job.id, "chat-batch@test", "vllm")
            store.runs.end_job(job.id, JobStatus.DONE, finish_reason="length",
                               output_text="on its way", completion_tokens=2)
        with api_and_driver(env, tmp_root / "logs", "second", key) as (sdk, procs):
            wait_until(lambda: sdk.batches.retrieve(batch.id).status == "completed", 180,
                       "the new processes to complete the batch", procs)
            done = sdk.batches.retrieve(batch.id)
            assert done.output_file_id is not None and done.error_file_id is None
            out = [json.loads(line) for line in
                   sdk.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == ["r0", "r1"]
        assert {o["response"]["body"]["choices"][0]["message"]["content"] for o in out} == {
            "on its way"}
        assert len(store.jobs.list_jobs(tenant.id)) == 2  # no line was submitted twice
    finally:
        client.flushdb()


@contextlib.contextmanager
def api_and_driver(env: dict[str, str], logs: Path, name: str,
                   key: str) -> Iterator[tuple[openai.OpenAI, list[Proc]]]:
    """`tidegate api` and `tidegate batches`, each a process of its own, with the SDK on
    the API; both stopped on the way out (a no-op for one the test killed)."""
    port = free_port()
    procs = [start_api(env, port, logs), start_batches(env, logs, f"batches-{name}")]
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: api_ready(base_url, []), 120, "the API to be ready", procs)
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0,
                            timeout=60), procs
    finally:
        for proc in procs:
            proc.stop()
