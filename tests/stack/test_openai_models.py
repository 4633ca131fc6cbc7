"""Models and LoRA adapters on the OpenAI routes, with the official `openai` client against
the real stack: a vLLM worker of the `support` lane serving the test LoRA adapter
(tidegate_tools/testlora.py) as ADAPTER; GET /v1/models lists it with `parent` (and
`root`) the base model; GET /v1/models/{id} answers one model, 404 `model_not_found` in
OpenAI's shape for an unknown id; a completion whose `model` names the adapter runs as a
job with that adapter, on the worker serving it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import Stack, make_tenant
from tidegate_tools.procs import start_worker, wait_until
from tidegate_tools.stack import api_ready

MODEL = "tidegate-test"
ADAPTER = "refund-tone"  # not a lane's name: a lane alias would win the `model` name
WORKER = "support-lora@tidegate"
USER = [{"role": "user", "content": "Please check the status of my refund"}]


@pytest.fixture(scope="module")
def lora_worker(stack: Stack, model_path: Path, tmp_root: Path) -> Iterator[str]:
    from tidegate_tools.testlora import build_test_lora

    adapter = build_test_lora(model_path, model_path.parent / "tidegate-test-lora")
    env = {**os.environ, "TIDEGATE_LORA_ADAPTERS": f"{ADAPTER}={adapter}"}
    proc = start_worker(env, "support", WORKER, tmp_root / "logs", pool="fallback")
    try:
        wait_until(lambda: api_ready(stack.base_url, [WORKER]), 240,
                   "the LoRA worker to be active", [proc], poll_s=0.5)
        yield WORKER
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    _, key = make_tenant(stack.store, "openai-models", ["chat", "support"])
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def job_of(stack: Stack, client: openai.OpenAI, completion_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{stack.base_url}/v1/jobs/{completion_id}", timeout=10,
                     headers={"Authorization": f"Bearer {client.api_key}"})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_the_models_list_the_adapter_with_its_parent(client: openai.OpenAI,
                                                     lora_worker: str) -> None:
    cards = {m.id: m.to_dict() for m in client.models.list()}
    assert cards[MODEL]["root"] == MODEL and cards[MODEL]["parent"] is None
    assert cards["chat"]["parent"] is None  # a lane: an alias of the base model
    assert cards[ADAPTER]["parent"] == MODEL and cards[ADAPTER]["root"] == MODEL
    assert cards[ADAPTER]["object"] == "model"
    assert client.models.retrieve(ADAPTER).to_dict() == cards[ADAPTER]
    assert client.models.retrieve(MODEL).to_dict() == cards[MODEL]


def test_an_unknown_model_id_is_openais_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    assert missing.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as asked:
        client.chat.completions.create(model="no-such-model", messages=USER,  # type: ignore[arg-type]
                                       max_tokens=2)
    assert asked.value.param == "model"


def test_an_adapter_answers_by_model_name(stack: Stack, client: openai.OpenAI,
                                          lora_worker: str) -> None:
    def ask(model: str) -> Any:
        return client.chat.completions.create(
            model=model, messages=USER, max_tokens=24, temperature=0,  # type: ignore[arg-type]
            extra_body={"lane": "support"})

    base, tuned = ask(MODEL), ask(ADAPTER)
    assert tuned.model == ADAPTER and tuned.choices[0].message.content
    tuned_job, base_job = job_of(stack, client, tuned.id), job_of(stack, client, base.id)
    assert tuned_job["lora"] == ADAPTER and tuned_job["worker"] == lora_worker
    assert base_job["lora"] is None
    # The adapter changes the greedy tokens (tidegate_tools/testlora.py).
    assert tuned.choices[0].message.content != base.choices[0].message.content
