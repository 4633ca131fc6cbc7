"""Webhooks on the real stack, to a real HTTP receiver: one signed POST per job end (done,
error, cancelled, expired) that the `standardwebhooks` package verifies; a receiver that
fails three times gets its one accepted delivery on the fourth attempt, all four
recorded; a receiver that hangs holds up nothing but its own delivery."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from tidegate_client import Client, verify_webhook

from tasks.app import make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.helpers import Stack, make_tenant
from tidegate.settings import get_settings
from tidegate_tools.procs import Proc, tidegate_argv, wait_until

HANG_S = 20.0


class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST and answers by path: /ok 200,
    /flaky 500 three times then 200, /hang after HANG_S."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.flaky_left = 3
        self.hanging = threading.Event()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                status = receiver.answer(self.path)
                with receiver.lock:
                    receiver.requests.append({"path": self.path, "body": body.decode(),
                                              "headers": dict(self.headers), "status": status})
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> int:
        if path == "/hang":
            self.hanging.set()
            time.sleep(HANG_S)
            self.hanging.clear()
        if path == "/flaky":
            with self.lock:
                self.flaky_left -= 1
                if self.flaky_left >= 0:
                    return 500
        return 200

    def of_job(self, job_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if f'"id":"{job_id}"' in r["body"]]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.server.shutdown()


@pytest.fixture(scope="module")
def webhooks(stack: Stack, tmp_root: Path) -> Iterator[Proc]:
    env = {**os.environ, "TIDEGATE_WEBHOOK_BACKOFF_S": "0.3", "TIDEGATE_WEBHOOK_DISPATCH_S": "0.2",
           "TIDEGATE_WEBHOOK_TIMEOUT_S": "3"}
    proc = Proc("webhooks", tidegate_argv("webhooks"), tmp_root / "logs" / "webhooks.log", env)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tenant(stack: Stack) -> tuple[int, str]:
    return make_tenant(stack.store, f"hooks-{uuid.uuid4().hex[:6]}", ["finance", "chat"])


def rotate(stack: Stack, key: str) -> str:
    resp = httpx.post(f"{stack.base_url}/v1/webhook-secret", timeout=10,
                      headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["secret"])


def deliveries(stack: Stack, key: str, job_id: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{stack.base_url}/v1/jobs/{job_id}/deliveries", timeout=10,
                     headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["data"])


def delivered(stack: Stack, key: str, job_id: str) -> bool:
    """The job's one delivery is recorded delivered (there is none until the job ends)."""
    found = deliveries(stack, key, job_id)
    return bool(found) and found[0]["status"] == "delivered"


def verified(secret: str, request: dict[str, Any]) -> dict[str, Any]:
    """The SDK's helper, then the standardwebhooks package itself, on the same request."""
    event = verify_webhook(secret, request["body"], request["headers"])
    headers = {k.lower(): v for k, v in request["headers"].items()}
    assert Webhook(secret).verify(request["body"], headers) == event
    return event


def submit(client: Client, url: str, **fields: Any) -> str:
    body = {"prompt": "Where is my parcel?", "max_tokens": 8, **fields}
    return str(client.submit(body.pop("lane", "chat"), callback_url=url, **body)["job_id"])


def engine_error_job(stack: Stack, tenant_id: int, url: str) -> str:
    """A job the engine refuses (longer than the model's context), sent as a task: the
    API would refuse it first (as tests/stack/test_e2e.py does)."""
    job_id = str(uuid.uuid4())
    stack.store.jobs.create_job(job_id, tenant_id, "chat", "chat.vllm", 5, None, {"max_tokens": 8},
                                2500, callback_url=url)
    payload = GeneratePayload(job_id=job_id, lane="chat", prompt=" refund" * 2500,
                              prompt_tokens=2500, sampling=Sampling(max_tokens=8))
    send_generate(make_app(get_settings()), payload, "chat.vllm", 5)
    return job_id


def cancelled_job(client: Client, url: str) -> str:
    """A job whose DELETE answered `cancelled`. A fast engine can end a job (its end token)
    before the DELETE lands; that DELETE answers `done`, and so must the webhook, so such a
    job is no cancelled one: try again, a few times."""
    for _ in range(5):
        job_id = submit(client, url, lane="finance", max_tokens=1800)
        if client.cancel(job_id).status == "cancelled":
            return job_id
    raise AssertionError("5 jobs in a row ended before their DELETE")


def test_each_end_delivers_one_verified_webhook(stack: Stack, receiver: Receiver,
                                               webhooks: Proc, tenant: tuple[int, str]) -> None:
    tenant_id, key = tenant
    secret = rotate(stack, key)
    url = f"{receiver.url}/ok"
    with Client(stack.base_url, key) as client:
        done = submit(client, url)
        expired = submit(client, url, lane="finance", max_tokens=1800, deadline_s=0.5)
        cancelled = cancelled_job(client, url)
    error = engine_error_job(stack, tenant_id, url)
    ends = {done: "done", expired: "expired", cancelled: "cancelled", error: "error"}
    wait_until(lambda: all(receiver.of_job(j) for j in ends), 120,
               "a webhook for each job's end", [webhooks, *stack.procs])
    for job_id, status in ends.items():
        wait_until(lambda j=job_id: delivered(stack, key, j), 30,
                   f"job {job_id}'s delivery to be recorded", [webhooks])
        got = receiver.of_job(job_id)
        assert len(got) == 1, f"job {job_id} ({status}): {len(got)} webhooks"
        event = verified(secret, got[0])
        assert event["type"] == "job.ended" and event["data"]["status"] == status
        assert got[0]["headers"]["webhook-id"] == deliveries(stack, key, job_id)[0]["id"]
        assert "tenant_id" not in event["data"]
    # A rotation overlaps: the next webhook verifies with the old secret and the new.
    newer = rotate(stack, key)
    with Client(stack.base_url, key) as client:
        after = submit(client, url)
    wait_until(lambda: receiver.of_job(after), 60, "the webhook after the rotation", [webhooks])
    assert verified(secret, receiver.of_job(after)[0]) == verified(newer,
                                                                 receiver.of_job(after)[0])


def test_a_failing_receiver_gets_one_delivery_after_four_attempts(
        stack: Stack, receiver: Receiver, webhooks: Proc, tenant: tuple[int, str]) -> None:
    _, key = tenant
    rotate(stack, key)
    with Client(stack.base_url, key) as client:
        job_id = submit(client, f"{receiver.url}/flaky")
    wait_until(lambda: delivered(stack, key, job_id), 60,
               "the flaky receiver's delivery", [webhooks])
    record = deliveries(stack, key, job_id)[0]
    assert record["attempts"] == 4
    assert [a["status_code"] for a in record["log"]] == [500, 500, 500, 200]
    got = receiver.of_job(job_id)
    assert [r["status"] for r in got] == [500, 500, 500, 200]
    assert len({r["headers"]["webhook-id"] for r in got}) == 1  # one id: the receiver dedupes


def test_a_hanging_receiver_holds_up_nothing_else(stack: Stack, receiver: Receiver,
                                                  webhooks: Proc,
                                                  tenant: tuple[int, str]) -> None:
    _, key = tenant
    rotate(stack, key)
    with Client(stack.base_url, key) as client:
        hung = submit(client, f"{receiver.url}/hang")
        wait_until(receiver.hanging.is_set, 60, "the receiver to hang on the webhook", [webhooks])
        # While it hangs, the API and the workers serve, and other webhooks go out.
        other = submit(client, f"{receiver.url}/ok")
        assert list(client.stream(other))[-1].kind == "done"
        wait_until(lambda: receiver.of_job(other), 30, "another job's webhook", [webhooks])
        assert receiver.hanging.is_set()
    wait_until(lambda: any(a["error"] == "timeout"
                           for d in deliveries(stack, key, hung) for a in d["log"]), 30,
               "the hung attempt to time out and be recorded", [webhooks])
    assert json.loads(receiver.of_job(other)[0]["body"])["data"]["status"] == "done"
