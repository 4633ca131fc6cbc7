"""The official `openai` SDK, unchanged, against the real stack (API, Celery workers
hosting vLLM on CPU, Redis, the store): chat and text completions, sync and async,
streaming and not; service tiers choosing lanes; a completion is a job; a client that
leaves cancels its job (but not on a lane with keep_on_disconnect); the Batch API from
upload to output file; rate limits."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from api.app import create_app
from store.batches import Batches
from tests.helpers import Stack, end_tokens_banned, engine_stats, hold, make_tenant, served
from tidegate.settings import Settings, get_settings
from tidegate_tools.procs import wait_until

MODEL = "tidegate-test"
USER = [{"role": "user", "content": "Summarise the refund policy in one line."}]


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    _, api_key = make_tenant(stack.store, "openai-sdk", ["finance", "chat", "batch"])
    return api_key


def sdk(stack: Stack, key: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120, **options)


def job_of(stack: Stack, completion_id: str, key: str) -> dict[str, Any]:
    """GET /v1/jobs/{id} with the completion's own id."""
    resp = httpx.get(f"{stack.base_url}/v1/jobs/{completion_id}", timeout=10,
                     headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_chat_completion_is_a_job_on_the_tiers_lane(stack: Stack, key: str) -> None:
    done = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, temperature=0, service_tier="priority")
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    assert done.service_tier == "priority"
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert done.usage is not None and done.usage.completion_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.usage.prompt_tokens_details is not None
    job = job_of(stack, done.id, key)
    assert job["lane"] == "finance" and job["status"] == "done"
    assert job["output_text"] == choice.message.content
    assert job["completion_tokens"] == done.usage.completion_tokens


def test_a_streamed_chat_completion_sends_the_jobs_tokens_then_usage(stack: Stack,
                                                                     key: str) -> None:
    stream = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0
    job = job_of(stack, chunks[0].id, key)
    assert job["lane"] == "chat" and job["output_text"] == text


def test_the_async_client_streams_and_completes_text(stack: Stack, key: str) -> None:
    async def run() -> tuple[Any, str, str]:
        async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=key,
                                      max_retries=0, timeout=120) as client:
            whole = await client.completions.create(model="finance", prompt="The invoice",
                                                    max_tokens=8, temperature=0, seed=7)
            stream = await client.completions.create(model="finance", prompt="The invoice",
                                                     max_tokens=8, temperature=0, seed=7,
                                                     stream=True)
            streamed = "".join([c.choices[0].text async for c in stream])
            return whole, whole.choices[0].text, streamed

    whole, text, streamed = asyncio.run(run())
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert text and streamed == text  # greedy: the same prompt, the same tokens
    assert job_of(stack, whole.id, key)["lane"] == "finance"  # `model` named the lane


def test_stop_ends_the_output_before_the_stop_string(stack: Stack, key: str) -> None:
    client = sdk(stack, key)
    free = client.completions.create(model=MODEL, prompt="The invoice", max_tokens=24,
                                     temperature=0)
    text = free.choices[0].text
    stop = text.strip()[4:8] if len(text.strip()) >= 8 else None
    if not stop:
        pytest.skip("the test model's greedy output is too short to stop inside")
    cut = client.completions.create(model=MODEL, prompt="The invoice", max_tokens=24,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and text.startswith(cut.choices[0].text)


def test_a_client_that_leaves_a_stream_cancels_its_job(stack: Stack, key: str) -> None:
    """Left after its first token, mid-generation: the job ends `cancelled` and the engine
    aborts the request (its slot is free again), not merely the stream closed."""
    aborted = {name: engine_stats(name)["aborted"] for name in set(stack.workers.values())}
    body = {"model": MODEL, "messages": USER, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = (json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                  if line.startswith("data: {"))
        first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get(
            "content"))
        completion_id = first["id"]
    wait_until(lambda: job_of(stack, completion_id, key)["status"] == "cancelled", 30,
               "the job of the stream its client left to be cancelled")
    job = job_of(stack, completion_id, key)
    worker = job["worker"]
    wait_until(lambda: engine_stats(worker)["aborted"] > aborted[worker], 30,
               "the engine to abort the left stream's request")
    assert engine_stats(worker)["aborted"] == aborted[worker] + 1
    assert engine_stats(worker)["unfinished"] == 0
    assert (job.get("usage") or {}).get("completion_tokens", 0) < 200


def test_a_lane_that_keeps_its_jobs_runs_a_left_streams_job_to_its_end(
        stack: Stack, key: str, tmp_root: Path, model_path: Path) -> None:
    """A lane with keep_on_disconnect = true: a second API (in this process, on the
    session's Redis, store and workers; only its lanes file differs) lets the job of a
    stream its client left run on to `done`, its row keeping the whole answer."""
    lanes = tmp_root / "lanes-keep.toml"
    lanes.write_text(get_settings().lanes_file.read_text().replace(
        "[lanes.chat]\n", "[lanes.chat]\nkeep_on_disconnect = true\n", 1))
    # A new Settings, not a model_copy: the copy would keep the cached `lanes`.
    keeping = create_app(Settings(lanes_file=lanes))
    body = {"model": MODEL, "messages": USER, "max_tokens": 200, "stream": True,
            "logit_bias": end_tokens_banned(model_path)}  # runs to max_tokens
    with served(keeping) as base_url, httpx.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {key}"}, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = (json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                  if line.startswith("data: {"))
        completion_id = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get(
            "content"))["id"]
    wait_until(lambda: job_of(stack, completion_id, key)["status"] not in ("queued", "running"),
               120, "the job of the stream its client left to end")
    job = job_of(stack, completion_id, key)
    assert job["status"] == "done" and job["completion_tokens"] == 200
    assert len(job["output_text"]) > 0


def test_a_rate_limited_tenant_gets_the_sdks_rate_limit_error(stack: Stack) -> None:
    record, limited = stack.store.tenants.create_tenant("openai-limited", ["chat"],
                                                        requests_per_minute=1)
    client = sdk(stack, limited)
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert int(caught.value.response.headers["retry-after"]) > 0
    assert caught.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert len(stack.store.jobs.list_jobs(record.id)) == 1


def batch_lines() -> bytes:
    good = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Order {i}: where is it?"}]}}
            for i in range(3)]
    bad = [{"custom_id": "bad-n", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": USER, "n": 3}}]
    lines = [json.dumps(item) for item in (*good[:2], *bad, good[2])]
    return ("\n".join([*lines, "this is not json"]) + "\n").encode()


def test_a_batch_runs_every_line_and_reports_the_bad_ones(stack: Stack, key: str) -> None:
    client = sdk(stack, key)
    upload = client.files.create(file=("orders.jsonl", io.BytesIO(batch_lines())),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"crm": "orders"})
    assert batch.status == "validating" and batch.request_counts.total == 5  # type: ignore[union-attr]

    def ended() -> bool:
        nonlocal batch
        batch = client.batches.retrieve(batch.id)
        return batch.status in ("completed", "failed", "cancelled", "expired")

    wait_until(ended, 180, "the batch to complete", stack.procs, poll_s=0.5)
    assert batch.status == "completed" and batch.metadata == {"crm": "orders"}
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 2)
    assert batch.output_file_id and batch.error_file_id
    output = [json.loads(line) for line in
              client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["req-0", "req-1", "req-2"]
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        job = job_of(stack, body["id"], key)
        assert job["lane"] == "batch" and job["output_text"] == body["choices"][0]["message"][
            "content"]
    errors = [json.loads(line) for line in
              client.files.content(batch.error_file_id).text.splitlines()]
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["bad-n"]["response"]["body"]["error"]["param"] == "n"
    assert by_id[None]["response"]["status_code"] == 400  # the line that is not JSON
    listed = [b.id for b in client.batches.list(limit=10)]
    assert batch.id in listed


def test_a_cancelled_batch_cancels_its_jobs_and_ends_cancelled(stack: Stack, key: str) -> None:
    client = sdk(stack, key)
    long = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 250, "messages": USER}} for i in range(4)]
    body = "".join(json.dumps(item) + "\n" for item in long).encode()
    batches = Batches(stack.store)
    # The chat worker (it runs the batch lane) holds the first line to stream 4 tokens, its
    # engine request running on, so the cancel finds a line mid-generation however fast
    # the engine (a CI run ended all four lines before the cancel).
    worker = stack.workers["chat"]
    hold([worker], 4, stack.broker_url)
    try:
        upload = client.files.create(file=("long.jsonl", io.BytesIO(body)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        row = batches.get_batch(batch.id)
        assert row is not None

        def jobs() -> dict[int, Any]:
            return batches.line_jobs(row.tenant_id, batch.id, len(long))

        # Cancelled once its lines are jobs, one of them held running.
        wait_until(lambda: len(jobs()) == len(long), 120, "the batch's lines to become jobs",
                   stack.procs, poll_s=0.2)
        wait_until(lambda: engine_stats(worker, stack.broker_url)["held"], 120,
                   "the worker to hold a line", stack.procs, poll_s=0.2)
        assert client.batches.cancel(batch.id).status == "cancelling"
        wait_until(lambda: client.batches.retrieve(batch.id).status == "cancelled", 120,
                   "the cancelled batch to end", stack.procs, poll_s=0.5)
    finally:
        hold([worker], 0, stack.broker_url)
    final = client.batches.retrieve(batch.id)
    assert final.cancelled_at is not None and final.request_counts is not None
    assert final.request_counts.completed < 4
    # Its lines' jobs ended too: a cancelled batch leaves none queued or running.
    ended = jobs()
    assert {j.status for j in ended.values()} <= {"cancelled", "done"}, ended
    assert sum(j.status == "cancelled" for j in ended.values()) >= 1


def test_a_conversation_hits_the_same_prefix_cache_through_either_api(stack: Stack,
                                                                      key: str) -> None:
    """The same messages through POST /v1/jobs, then through /v1/chat/completions: one
    rendering, one tenant's cache salt, so the second finds the first's prefix cached."""
    from tidegate_client import Client

    # New to the engine, and several KV blocks long whatever the block size (128 on CPU).
    system = f"Ledger {uuid.uuid4().hex}. " + "Revenue rose while invoice totals fell. " * 60
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Summarise the ledger."}]
    with Client(stack.base_url, key) as client:
        job_id = client.submit("chat", messages=messages, max_tokens=1)["job_id"]
        assert list(client.stream(job_id))[-1].kind == "done"
    first = stack.store.jobs.get_job(job_id)
    done = sdk(stack, key).chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                   max_tokens=1)
    assert first is not None and first.prompt_tokens >= 512
    assert done.usage is not None and done.usage.prompt_tokens == first.prompt_tokens
    details = done.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= 256


def test_each_error_class_on_the_real_stack(stack: Stack, key: str) -> None:
    """The SDK's own classes, from the API process a deployment runs (the in-process
    cases, with the queue checks, are tests/stack/test_openai_validation.py)."""
    _, chat_only = make_tenant(stack.store, f"openai-chat-{uuid.uuid4().hex[:6]}", ["chat"])
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, "tg_not-a-key").models.list()
    with pytest.raises(openai.PermissionDeniedError) as denied:
        sdk(stack, chat_only).chat.completions.create(model=MODEL, messages=USER,  # type: ignore[arg-type]
                                                      service_tier="priority")
    assert denied.value.param == "service_tier"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk(stack, key).chat.completions.create(model=MODEL, messages=USER, n=99)  # type: ignore[arg-type]
    assert bad.value.param == "n"
    with pytest.raises(openai.NotFoundError):
        sdk(stack, key).batches.retrieve("batch_nope")
