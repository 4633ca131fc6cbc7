"""The OpenAI-compatible endpoints refuse bad input in OpenAI's error shape, naming the
`param`, through the official `openai` SDK, unchanged; and a refused request leaves no job
row and no queue message. The API runs in-process on its own Redis DB and database, with
a chat worker's heartbeat advertised and no worker consuming, so the queues show exactly
what was enqueued (as tests/stack/test_api_validation.py)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from store import Store, upgrade
from tests.stack.test_api_validation import advertise_worker, nothing_enqueued
from tidegate.settings import Settings

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
    redis_url = redis_server.rsplit("/", 1)[0] + "/3"
    settings = Settings(redis_url=redis_url, database_url=url, batch_max_lines=3)
    store = Store(url)
    _, key = store.create_tenant("openai-validation", ["chat", "batch"])
    _, other = store.create_tenant("openai-chat-only", ["chat"])
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
    ({"n": 2}, openai.BadRequestError, 400, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, openai.BadRequestError,
     400, "tools"),
    ({"bogus": 1}, openai.BadRequestError, 400, "bogus"),
    ({"temperature": 3}, openai.BadRequestError, 400, "temperature"),
    ({"messages": []}, openai.BadRequestError, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, openai.BadRequestError, 400,
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
