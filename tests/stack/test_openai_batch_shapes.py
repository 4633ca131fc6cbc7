"""The Batch API as OpenAI files it, with the official `openai` client against the real
stack (API, vLLM on CPU, the batch driver `tidegate batches`, the webhook sender
`tidegate webhooks`): a batch cancelled half-way and one that expires have exactly one
line per input line in the output or error file, matched by `custom_id` (lines never
submitted included), cancelled and expired lines as `response: null` with OpenAI's
`batch_cancelled` / `batch_expired` error; a batch carries `model` and `usage`; each end
is one signed `batch.*` webhook to a real HTTP receiver; GET /v1/files lists a tenant's own
files a page at a time, and DELETE /v1/files/{id} answers OpenAI's shape.

The expiring batch is created through a second API process whose completion window lasts
EXPIRY_WINDOW_S (TIDEGATE_BATCH_COMPLETION_WINDOW_S): the session's driver and workers run
it, as they run every batch."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch
from standardwebhooks.webhooks import Webhook

from store.batches import Batches
from store.webhooks import Webhooks
from tests.helpers import Stack, make_tenant
from tests.stack.test_webhooks import Receiver
from tidegate_tools.procs import Proc, free_port, start_api, tidegate_argv, wait_until
from tidegate_tools.stack import api_ready

MODEL = "tidegate-test"
CHAT = "/v1/chat/completions"
# Past TIDEGATE_BATCH_IN_FLIGHT (64) by two waves of long lines: a cancel or the expiry
# comes while some lines were never submitted.
LINES = 200
SHORT = 2  # lines that end within a second or two; the rest run long
EXPIRY_WINDOW_S = 12
# The expiring batch holds far more work than a fast machine ends in its window (CI ran
# 200 lines in under 12 s): the expiry is sure to find lines not yet sent.
EXPIRING_LINES = 2000
ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass
class Floor:
    key: str
    name: str
    secret: str
    receiver: Receiver
    expiring_url: str  # the API whose completion window is EXPIRY_WINDOW_S


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.server.shutdown()


@pytest.fixture(scope="module")
def webhooks(stack: Stack, tmp_root: Path) -> Iterator[Proc]:
    env = {**os.environ, "TIDEGATE_WEBHOOK_BACKOFF_S": "0.3",
           "TIDEGATE_WEBHOOK_DISPATCH_S": "0.2", "TIDEGATE_WEBHOOK_TIMEOUT_S": "3"}
    proc = Proc("webhooks-batch", tidegate_argv("webhooks"),
                tmp_root / "logs" / "webhooks-batch.log", env)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def expiring_api(stack: Stack, tmp_root: Path) -> Iterator[str]:
    env = {**os.environ, "TIDEGATE_BATCH_COMPLETION_WINDOW_S": str(EXPIRY_WINDOW_S)}
    port = free_port()
    proc = start_api(env, port, tmp_root / "logs")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: api_ready(url, []), 60, "the expiring API to be ready", [proc])
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def floor(stack: Stack, receiver: Receiver, webhooks: Proc, expiring_api: str) -> Floor:
    name = f"batch-shapes-{uuid.uuid4().hex[:6]}"
    _, key = make_tenant(stack.store, name, ["chat", "batch"])
    assert Webhooks(stack.store).set_tenant_url(name, f"{receiver.url}/ok")
    resp = httpx.post(f"{stack.base_url}/v1/webhook-secret", timeout=10,
                      headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return Floor(key, name, str(resp.json()["secret"]), receiver, expiring_api)


def sdk(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)


def request_line(custom_id: str, max_tokens: int, text: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": text}]}}


def input_lines(tag: str, count: int = LINES) -> list[dict[str, Any]]:
    """SHORT quick lines, then long ones up to `count`."""
    return [request_line(f"{tag}-{i}", 4 if i < SHORT else 250, f"Order {i}: where is it?")
            for i in range(count)]


def create_batch(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Batch:
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("in.jsonl", io.BytesIO(body)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                 completion_window="24h")


def wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
                stack: Stack, timeout_s: float = 240) -> Batch:
    found: list[Batch] = []

    def reached() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in statuses

    wait_until(reached, timeout_s, f"batch {batch_id} to be {' or '.join(statuses)}",
               stack.procs, poll_s=0.3)
    return found[0]


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def check_every_line(client: openai.OpenAI, batch: Batch, lines: list[dict[str, Any]],
                     stopped: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every input line has exactly one line in the output or the error file, by custom_id;
    an output line is the completion, an error line the batch's `stopped` error with no
    response. Returns (output, errors)."""
    output = file_lines(client, batch.output_file_id)
    errors = file_lines(client, batch.error_file_id)
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["model"] == MODEL
    for line in errors:
        assert line["id"].startswith("batch_req_")
        assert line["response"] is None, line
        assert line["error"]["code"] == stopped and line["error"]["message"], line
    assert batch.request_counts is not None
    assert batch.request_counts.total == len(lines)
    assert batch.request_counts.completed == len(output)
    assert batch.request_counts.failed == len(errors)
    return output, errors


def check_usage(batch: Batch, output: list[dict[str, Any]]) -> None:
    """The batch's `model`, and its `usage`: the sums of its output lines' usage."""
    assert batch.model == MODEL
    usage = batch.usage
    assert usage is not None
    prompt = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in output)
    completion = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    assert (usage.input_tokens, usage.output_tokens) == (prompt, completion)
    assert usage.total_tokens == prompt + completion
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def batch_events(floor: Floor, batch_id: str) -> list[dict[str, Any]]:
    """The verified `batch.*` webhooks the receiver got about `batch_id`."""
    with floor.receiver.lock:
        requests = list(floor.receiver.requests)
    found = []
    for request in requests:
        body = json.loads(request["body"])
        if body.get("object") == "event" and body["data"]["id"] == batch_id:
            headers = {k.lower(): v for k, v in request["headers"].items()}
            Webhook(floor.secret).verify(request["body"], headers)  # raises if not signed
            assert headers["webhook-id"] == body["id"]
            found.append(body)
    return found


def check_one_event(floor: Floor, stack: Stack, batch_id: str, event: str) -> None:
    wait_until(lambda: bool(batch_events(floor, batch_id)), 60,
               f"the {event} webhook of {batch_id}", stack.procs, poll_s=0.3)
    events = batch_events(floor, batch_id)
    assert [e["type"] for e in events] == [event]
    assert isinstance(events[0]["created_at"], int)


def test_a_batch_cancelled_half_way_has_one_line_per_input_line(stack: Stack,
                                                               floor: Floor) -> None:
    client = sdk(stack.base_url, floor.key)
    lines = input_lines("cancel")
    batch = create_batch(client, lines)
    assert batch.model is None and batch.usage is not None and batch.usage.total_tokens == 0
    wait_until(lambda: (client.batches.retrieve(batch.id).request_counts.completed or 0) >= 1,  # type: ignore[union-attr]
               180, "a line of the batch to complete", stack.procs, poll_s=0.3)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    final = wait_status(client, batch.id, ENDED, stack)
    assert final.status == "cancelled" and final.cancelled_at is not None
    row = Batches(stack.store).get_batch(batch.id)
    assert row is not None and row.submitted < row.total  # some lines were never sent
    output, errors = check_every_line(client, final, lines, "batch_cancelled")
    assert output and errors
    check_usage(final, output)
    check_one_event(floor, stack, batch.id, "batch.cancelled")


def test_a_batch_that_expires_has_one_line_per_input_line(stack: Stack, floor: Floor) -> None:
    client = sdk(floor.expiring_url, floor.key)
    lines = input_lines("expire", EXPIRING_LINES)
    batch = create_batch(client, lines)
    assert batch.expires_at is not None and batch.created_at is not None
    assert batch.expires_at - batch.created_at == EXPIRY_WINDOW_S
    final = wait_status(client, batch.id, ENDED, stack)
    assert final.status == "expired" and final.expired_at is not None
    row = Batches(stack.store).get_batch(batch.id)
    assert row is not None and row.submitted < row.total
    # lines never submitted or not finished: both end expired
    output, errors = check_every_line(client, final, lines, "batch_expired")
    assert errors
    if output:
        check_usage(final, output)
    check_one_event(floor, stack, batch.id, "batch.expired")


def test_a_completed_batch_has_model_usage_and_its_webhook(stack: Stack,
                                                          floor: Floor) -> None:
    client = sdk(stack.base_url, floor.key)
    lines = [request_line(f"done-{i}", 5, f"Invoice {i}: is it paid?") for i in range(3)]
    lines.append({**request_line("done-bad", 5, "x"), "url": "/v1/embeddings"})
    batch = create_batch(client, lines)
    final = wait_status(client, batch.id, ENDED, stack)
    assert final.status == "completed"
    output = file_lines(client, final.output_file_id)
    errors = file_lines(client, final.error_file_id)
    assert sorted(line["custom_id"] for line in output) == ["done-0", "done-1", "done-2"]
    [refused] = errors
    assert refused["custom_id"] == "done-bad" and refused["error"] is None
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["type"] == "invalid_request_error"
    check_usage(final, output)
    assert final.usage is not None and final.usage.output_tokens > 0
    check_one_event(floor, stack, batch.id, "batch.completed")


def test_files_are_listed_a_page_at_a_time_and_deleted(stack: Stack, floor: Floor) -> None:
    _, other_key = make_tenant(stack.store, f"files-other-{uuid.uuid4().hex[:6]}", ["chat"])
    _, key = make_tenant(stack.store, f"files-{uuid.uuid4().hex[:6]}", ["chat", "batch"])
    client, other = sdk(stack.base_url, key), sdk(stack.base_url, other_key)
    line = json.dumps(request_line("f-0", 4, "Where is my parcel?")) + "\n"
    made = [client.files.create(file=(f"in-{i}.jsonl", io.BytesIO(line.encode())),
                                purpose="batch").id for i in range(3)]
    theirs = other.files.create(file=("theirs.jsonl", io.BytesIO(line.encode())),
                                purpose="batch").id

    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == made[::-1][:2]  # newest first
    assert first.has_more
    assert [f.id for f in client.files.list()] == made[::-1]  # the SDK follows the pages
    assert [f.id for f in client.files.list(order="asc")] == made
    assert [f.id for f in client.files.list(purpose="batch_output")] == []
    assert theirs not in [f.id for f in client.files.list()]
    with pytest.raises(openai.BadRequestError) as cursor:
        client.files.list(after=theirs)  # another tenant's id is no cursor here
    assert cursor.value.param == "after"

    deleted = client.files.delete(made[0])
    assert (deleted.id, deleted.object, deleted.deleted) == (made[0], "file", True)
    assert [f.id for f in client.files.list()] == made[:0:-1]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made[0])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(theirs)  # not the caller's
    assert other.files.retrieve(theirs).id == theirs
