"""What OpenAI clients really send, with the official `openai` SDK (sync and async),
unchanged, against a real stack (the API, a Celery worker hosting vLLM on CPU, Redis, the
store): a conversation built by appending the returned messages; `n` choices from one
job; logprobs; penalties, logit_bias and vLLM's extras reaching the engine; unknown fields
ignored with a header; a cancelled job answered as an error; a default max_tokens that
cuts said in the usage and a header.

The stack is this module's own (the API in this process on its own Redis database, one vLLM worker):
one engine loads faster than the session stack's two on a shared machine, and its lanes
are shaped for these cases (`chat`'s default cut is short; `long` runs on chat's worker
with room to cancel a long answer)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from store import Store
from tests.helpers import api_of_its_own, end_tokens_banned, engine_stats, hold, own_db
from tidegate_tools.procs import Proc, start_worker, wait_until
from tidegate_tools.stack import api_ready

# The vLLM engine's start on a shared two-core machine comes with the first test.
pytestmark = pytest.mark.timeout(900)

MODEL = "tidegate-test"
REDIS_DB = own_db(__name__, "40")
WORKER = "chat-sampling@tidegate"
LANES = """
[lanes.chat]
queue = "chat"
dtype = "float16"
kv_cache_dtype = "auto"
pools = ["vllm"]
max_prompt_tokens = 1536
max_output_tokens = 48
deadline_s = 300
ttft_p99_objective_ms = 600000

[lanes.long]
queue = "chat"
runs_on = "chat"
dtype = "float16"
kv_cache_dtype = "auto"
pools = ["vllm"]
max_prompt_tokens = 1536
max_output_tokens = 1800
deadline_s = 300
ttft_p99_objective_ms = 600000

[service_tiers]
default = "chat"
auto = "chat"
priority = "long"
"""


@dataclass
class Stack:
    base_url: str
    store: Store
    procs: list[Proc]
    broker_url: str  # the worker's control commands (hold, stats) go here


@pytest.fixture(scope="module")
def stack(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Stack]:
    lanes = tmp_root / "sampling-lanes.toml"
    lanes.write_text(LANES)
    with api_of_its_own(redis_server, tmp_root, "sampling", REDIS_DB, [],
                        lanes_file=lanes) as api:
        settings = api.app.state.deps.settings
        env = {**os.environ, "TIDEGATE_REDIS_URL": settings.redis_url,
               "TIDEGATE_NAMESPACE": api.namespace, "TIDEGATE_LANES_FILE": str(lanes),
               "TIDEGATE_DATABASE_URL": settings.database_url}
        worker = start_worker(env, "chat", WORKER, tmp_root / "logs", pool="vllm")
        try:
            wait_until(lambda: api_ready(api.base_url, [WORKER]), 840, "the vLLM worker",
                       [worker])
            yield Stack(api.base_url, api.store, [worker], settings.redis_url)
        finally:
            worker.stop()


def make_tenant(store: Store, name: str, lanes: list[str]) -> tuple[int, str]:
    tenant, key = store.tenants.create_tenant(name, lanes)
    return tenant.id, key


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    _, api_key = make_tenant(stack.store, "openai-sampling", ["chat", "long"])
    return api_key


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def job_of(stack: Stack, completion_id: str, key: str) -> dict[str, Any]:
    resp = httpx.get(f"{stack.base_url}/v1/jobs/{completion_id.split('-', 1)[1]}",
                     timeout=10, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_three_turn_chat_built_by_appending_the_answers(stack: Stack, key: str) -> None:
    client = sdk(stack, key)
    messages: list[Any] = [{"role": "developer", "content": "You answer about orders."},
                           {"role": "user", "content": "Where is order 1234?"}]
    for turn in range(3):
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0)
        message = resp.choices[0].message
        assert message.role == "assistant" and message.content and message.refusal is None
        messages.append(message)  # the SDK sends it back as it came, refusal: null included
        messages.append({"role": "user", "content": [
            {"type": "text", "text": f"And turn {turn + 2}?"},
            {"type": "text", "text": " Briefly."}]})
    # Each turn's prompt held the answers before it: the last job's prompt is the longest.
    assert resp.usage is not None and resp.usage.prompt_tokens > 40


def test_an_assistant_turn_of_tool_calls_and_its_tool_answer_are_accepted(stack: Stack,
                                                                         key: str) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "order_status", "arguments": '{"order": 1234}'}}
    messages: list[Any] = [
        {"role": "user", "content": "Where is order 1234?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None,
         "annotations": [], "audio": None, "function_call": None},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'}]
    resp = sdk(stack, key).chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=4, temperature=0)
    assert resp.choices[0].message.content


def test_an_image_part_is_refused_naming_it_and_the_capability(stack: Stack, key: str) -> None:
    messages: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    before = stack.store.jobs.count_jobs()
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(stack, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert caught.value.param == "messages.0.content.1"
    assert "'vision' capability" in caught.value.message
    assert stack.store.jobs.count_jobs() == before


def test_n_gives_that_many_choices_from_one_job(stack: Stack, key: str) -> None:
    resp = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=3,
        max_tokens=5, temperature=1.0, seed=11)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1  # sampled apart
    job = job_of(stack, resp.id, key)  # one job, whose usage counts every choice
    assert resp.usage is not None and resp.usage.completion_tokens == 15
    assert job["completion_tokens"] == 15 and job["output_text"] == resp.choices[0].message.content


def test_n_streams_each_choice_with_its_index(stack: Stack, key: str) -> None:
    stream = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=2,
        max_tokens=4, temperature=1.0, seed=5, stream=True,
        stream_options={"include_usage": True})
    texts: dict[int, str] = {0: "", 1: ""}
    ends: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert texts[0] and texts[1] and ends == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 8


def test_logprobs_come_with_the_asked_number_of_alternatives(stack: Stack, key: str) -> None:
    client = sdk(stack, key)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    assert resp.choices[0].logprobs is not None and resp.usage is not None
    content = resp.choices[0].logprobs.content or []
    assert len(content) == resp.usage.completion_tokens == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # Greedy: the sampled token is the best alternative.
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                     temperature=0, logprobs=3)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 4 and all(len(t) == 3 for t in logprobs.top_logprobs or [])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]


def test_streamed_logprobs_come_with_each_chunk(stack: Stack, key: str) -> None:
    stream = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=1, stream=True)
    tokens = [t for c in stream for ch in c.choices if ch.logprobs
              for t in ch.logprobs.content or []]
    assert len(tokens) == 5 and all(len(t.top_logprobs) == 1 for t in tokens)


def test_logit_bias_and_vllms_extras_reach_the_engine(stack: Stack, key: str) -> None:
    client = sdk(stack, key)
    user = [{"role": "user", "content": "Tell me about refunds."}]
    greedy = client.chat.completions.create(model=MODEL, messages=user, max_tokens=6,
                                            temperature=0).choices[0].message.content
    # top_k=1 leaves one candidate: sampling at temperature 1 is then greedy decoding.
    top1 = client.chat.completions.create(
        model=MODEL, messages=user, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert top1.choices[0].message.content == greedy
    # A +100 bias makes one token the only likely one: every output token is it.
    biased = client.chat.completions.create(
        model=MODEL, messages=user, max_tokens=5, temperature=0, logprobs=True,
        logit_bias={"42": 100})
    content = biased.choices[0].logprobs.content if biased.choices[0].logprobs else None
    assert content is not None and len({t.token for t in content}) == 1
    # Penalties and the other extras are taken as vLLM takes them.
    penalised = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=user, max_tokens=6, temperature=0.7, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2, "top_k": 20, "min_p": 0.05})
    assert penalised.status_code == 200 and "x-tidegate-ignored-fields" not in penalised.headers
    assert penalised.parse().choices[0].message.content


def test_unknown_fields_are_ignored_and_named_in_a_header(stack: Stack, key: str) -> None:
    raw = sdk(stack, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi", "mood": "happy"}],
        max_tokens=2, extra_body={"bogus": 1, "use_beam_search": False})
    assert raw.status_code == 200
    assert raw.headers["x-tidegate-ignored-fields"] == "bogus,use_beam_search,messages.0.mood"
    assert raw.parse().choices[0].message.content


def test_a_default_max_tokens_that_cuts_is_said(stack: Stack, key: str) -> None:
    raw = sdk(stack, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
        temperature=0)  # lane chat: max_output_tokens 48
    resp = raw.parse()
    assert raw.headers["x-tidegate-default-max-tokens"] == "48"
    assert resp.usage is not None and resp.usage.model_extra == {"default_max_tokens": 48}
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 48
    asked = sdk(stack, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "x-tidegate-default-max-tokens" not in asked.headers
    assert not (asked.parse().usage.model_extra or {})  # type: ignore[union-attr]


def running_job(stack: Stack, key: str) -> str | None:
    resp = httpx.get(f"{stack.base_url}/v1/jobs", params={"status": "running"}, timeout=10,
                     headers={"Authorization": f"Bearer {key}"})
    jobs = resp.json()["data"] if resp.status_code == 200 else []
    return jobs[0]["id"] if jobs else None


def test_a_cancelled_job_is_an_error_to_its_client(stack: Stack, model_path: Path) -> None:
    no_end = end_tokens_banned(model_path)
    _, key = make_tenant(stack.store, "openai-cancelled", ["long"])  # its jobs alone
    client = sdk(stack, key)
    caught: list[BaseException] = []

    def ask() -> None:
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a long essay."}],
                max_tokens=1500, service_tier="priority", logit_bias=no_end, n=8)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            caught.append(exc)

    # The worker holds the job after its first tokens, its engine request running on, so
    # the cancel finds it mid-generation however fast the engine (an unheld answer of
    # 8 x 1,500 tokens once ended before the test saw it run).
    hold([WORKER], 4, stack.broker_url)
    thread = threading.Thread(target=ask)
    thread.start()
    try:
        wait_until(lambda: engine_stats(WORKER, stack.broker_url)["held"], 60,
                   "the worker to hold the job", stack.procs, poll_s=0.1)
        job_id = running_job(stack, key)
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.delete(f"{stack.base_url}/v1/jobs/{job_id}", headers=headers,
                            timeout=10).status_code == 200
    finally:
        hold([WORKER], 0, stack.broker_url)
        thread.join(120)
    assert len(caught) == 1 and isinstance(caught[0], openai.ConflictError), caught
    assert caught[0].code == "job_cancelled" and caught[0].status_code == 409
    # Streamed: the stream ends in an error event, which the SDK raises.
    hold([WORKER], 4, stack.broker_url)
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a long essay."}],
            max_tokens=1500, service_tier="priority", stream=True, logit_bias=no_end,
            n=8)
        with pytest.raises(openai.APIError) as streamed:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    httpx.delete(f"{stack.base_url}/v1/jobs/{chunk.id.split('-', 1)[1]}",
                                 headers={"Authorization": f"Bearer {key}"}, timeout=10)
                    hold([WORKER], 0, stack.broker_url)
    finally:
        hold([WORKER], 0, stack.broker_url)
    assert "cancelled" in streamed.value.message


def test_the_async_client_appends_turns_and_gets_n_choices(stack: Stack, key: str) -> None:
    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=key,
                                      max_retries=0, timeout=120) as client:
            messages: list[Any] = [{"role": "user", "content": "Hello there."}]
            first = await client.chat.completions.create(model=MODEL, messages=messages,
                                                         max_tokens=4, temperature=0)
            messages += [first.choices[0].message, {"role": "user", "content": "And?"}]
            return await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, n=2, temperature=1.0,
                logprobs=True, presence_penalty=0.3)

    resp = asyncio.run(run())
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.logprobs is not None and len(c.logprobs.content or []) == 4
               for c in resp.choices)
