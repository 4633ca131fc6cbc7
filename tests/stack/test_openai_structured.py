"""Structured output with the official `openai` SDK, unchanged, against the real stack
(vLLM on CPU): `response_format` json_object and json_schema (strict, and the SDK's own
`parse` with a pydantic model) answer JSON that holds to the schema, whole and streamed,
sync and async; guided decoding guarantees it even on the toy test checkpoint. And an
engine without structured output or tools (the `sim` engine's heartbeat, advertised to an
in-process API) is refused at admission: a 400 naming the field, no row, no message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from api.app import create_app
from store import Store, upgrade
from tests.helpers import Stack, make_tenant, own_redis_url
from tests.stack.test_api_validation import nothing_enqueued
from tidegate import keys
from tidegate.settings import Settings

MODEL = "tidegate-test"
ASK = [{"role": "user", "content": "Where is my parcel? Answer as JSON."}]
# Small enough for the toy model to close within a few dozen tokens: enums, bounded
# integers, short strings.
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "status": {"type": "string", "enum": ["open", "shipped", "refunded"]},
        "refund": {"type": "boolean"},
    },
    "required": ["order_id", "status", "refund"],
    "additionalProperties": False,
}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    _, api_key = make_tenant(stack.store, "openai-structured", ["finance", "chat"])
    return api_key


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def test_json_object_answers_a_json_object(stack: Stack, key: str) -> None:
    """Any object: the toy model closes it at once ({}) or wanders into a key it never
    ends (cut by max_tokens), by the seed; every answer that stops is a JSON object."""
    client = sdk(stack, key)
    answers = [client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
        response_format={"type": "json_object"}).choices[0] for seed in (0, 1, 3)]
    stopped = [a.message.content or "" for a in answers if a.finish_reason == "stop"]
    assert stopped, [a.message.content for a in answers]
    assert all(isinstance(json.loads(text), dict) for text in stopped)
    assert all((a.message.content or "").startswith("{") for a in answers)


def test_a_strict_json_schema_answer_validates(stack: Stack, key: str) -> None:
    done = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "order", "schema": ORDER_SCHEMA, "strict": True}})
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), ORDER_SCHEMA)


class Order(BaseModel):
    order_id: int = Field(ge=0, le=9999)
    status: Literal["open", "shipped", "refunded"]


def test_the_sdks_parse_fills_a_pydantic_model(stack: Stack, key: str) -> None:
    """`parse` sends the model's strict JSON schema and reads the answer into it."""
    done = sdk(stack, key).chat.completions.parse(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0.7, seed=3,
        response_format=Order)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Order) and 0 <= parsed.order_id <= 9999


def test_a_non_strict_schema_streamed_by_the_async_client_validates(stack: Stack,
                                                                    key: str) -> None:
    async def run() -> tuple[str, list[str]]:
        async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=key,
                                      max_retries=0, timeout=120) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "order", "schema": ORDER_SCHEMA}})
            chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ends = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
        return text, ends

    text, ends = asyncio.run(run())
    assert ends == ["stop"]
    jsonschema.validate(json.loads(text), ORDER_SCHEMA)


def test_a_schema_that_is_no_json_schema_is_a_400(stack: Stack, key: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(stack, key).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "order", "schema": {"type": "no-such-type"}}})
    assert caught.value.param == "response_format.json_schema.schema"


# -- an engine without the capability: refused at admission ----------------------------


class SimApi:
    def __init__(self, http: TestClient, store: Store, client: redis.Redis, key: str) -> None:
        self.http, self.store, self.redis, self.key = http, store, client, key

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=self.key,
                             http_client=self.http, max_retries=0)


def advertise_sim_worker(client: redis.Redis, settings: Settings) -> None:
    """The heartbeat of an active `sim` worker of the chat and finance lanes: its engine
    has neither structured output nor tools (workers/sim_engine.py `capabilities`)."""
    body = {"name": "chat-sim@test", "state": "active", "lanes": ["chat", "finance"],
            "pool": "vllm",
            "engine": "sim", "slots": 4, "kv_cache_dtype": "fp8", "dtype": "float16",
            "stats": {}, "capabilities": ["lora", "stop"]}
    client.set(keys.worker_heartbeat(settings.namespace, "chat-sim@test"), json.dumps(body))


@pytest.fixture(scope="module")
def sim_api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[SimApi]:
    url = f"sqlite:///{tmp_root / 'openai-structured-sim.db'}"
    upgrade(url)
    redis_url = own_redis_url(redis_server, __name__, "20")
    settings = Settings(redis_url=redis_url, database_url=url)
    store = Store(url)
    _, api_key = store.tenants.create_tenant("openai-structured-sim", ["chat", "finance"])
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_sim_worker(client, settings)
    try:
        with TestClient(create_app(settings)) as http:
            yield SimApi(http, store, client, api_key)
    finally:
        client.flushdb()


LOOKUP = {"type": "function", "function": {
    "name": "lookup_order", "parameters": {"type": "object", "properties": {
        "order_id": {"type": "integer"}}, "required": ["order_id"]}}}
SIM_CASES = [  # (fields, the param the 400 names)
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "order", "schema": ORDER_SCHEMA, "strict": True}}}, "response_format"),
    # required and a named function need structured output; auto, the engine's parser
    # (finance has a tool_parser: tests/lanes.toml).
    ({"tools": [LOOKUP], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function",
                                         "function": {"name": "lookup_order"}}}, "tool_choice"),
    ({"tools": [LOOKUP], "service_tier": "priority"}, "tools"),
]


@pytest.mark.parametrize(("fields", "param"), SIM_CASES,
                         ids=["json_object", "json_schema", "required", "named", "auto"])
def test_an_engine_without_the_capability_refuses_at_admission(
        sim_api: SimApi, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sim_api.sdk().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                              **fields)
    assert caught.value.status_code == 400 and caught.value.param == param
    assert "capability" in caught.value.message
    assert nothing_enqueued(sim_api.store, sim_api.redis)

