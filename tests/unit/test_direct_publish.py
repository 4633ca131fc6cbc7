"""The API's submit writes its task's message straight to the broker's Redis (tasks/app.py
`push_generate`), in the round trip that counts its traffic: the message and the list it
goes onto must be what Celery's send_task, through kombu's Redis transport, would write
there. Celery's publish is captured on kombu's in-memory transport, which shares the
envelope code (kombu/transport/virtual/base.py) with the Redis one; the list is kombu's
Redis channel's own choice. And the cached queue depths a submit reads (api/limits.py
Backlogs)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from celery import Celery
from kombu.transport import memory
from kombu.transport import redis as kombu_redis

from api.limits import Backlogs
from tasks.app import generate_message, make_app, push_generate, send_generate, writes_to
from tasks.payloads import GeneratePayload, Sampling
from tidegate import keys
from tidegate.settings import Settings, get_settings

PAYLOADS = [
    GeneratePayload(job_id="5d1c0b52-3f57-4b36-9d0e-1f6b7f0e9a11", lane="chat",
                    prompt="Wo ist mein Paket? \u00fc\u00df \u2603 \"quoted\"\n", prompt_tokens=12,
                    sampling=Sampling(max_tokens=8, temperature=0.2, seed=7, stop=("\n\n",)),
                    deadline_at=1_700_000_000.25, cache_salt="salt",
                    trace_context={"traceparent": "00-abc-def-01"}),
    GeneratePayload(job_id="job-2", lane="finance", prompt="p", prompt_tokens=1,
                    sampling=Sampling(max_tokens=1), session_id="s1", turn=3, lora="ad"),
]
# (queue, Redis priority): pool and direct queues, every end of the priority range.
SENDS = [("chat.vllm", 5), ("finance.trtllm", 0), ("tgtest.direct.w1@host", 9),
         ("chat.vllm", 2), ("chat.vllm", 12)]


@pytest.fixture
def memory_app() -> Celery:
    """tidegate's app, publishing on kombu's in-memory transport."""
    app = make_app(get_settings())
    app.conf.broker_url = "memory://"
    return app


Sent = tuple[str, dict[str, Any]]  # (queue, message)


def celery_messages(app: Celery, monkeypatch: pytest.MonkeyPatch,
                    sends: list[tuple[GeneratePayload, str, int]]) -> list[Sent]:
    """(queue, message) as send_generate's publish hands each to the transport's `_put`."""
    put: list[Sent] = []
    monkeypatch.setattr(memory.Channel, "_put",
                        lambda _self, queue, message, **_: put.append((queue, message)))
    for payload, queue, priority in sends:
        send_generate(app, payload, queue, priority)
    return put


def redis_channel() -> Any:
    """kombu's Redis channel as tidegate's app configures it, without a connection: only
    its choice of list (`_get_message_priority`, `_q_for_pri`) is used."""
    channel = object.__new__(kombu_redis.Channel)
    channel.priority_steps = list(keys.PRIORITY_STEPS)
    channel.sep = keys.PRIORITY_SEP
    return channel


def without_tag(message: dict[str, Any]) -> dict[str, Any]:
    """The message, its delivery tag (a new uuid per publish) left out."""
    properties = {k: v for k, v in message["properties"].items() if k != "delivery_tag"}
    return {**message, "properties": properties}


def test_the_direct_message_is_the_one_send_task_publishes(
        memory_app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    sends = [(payload, queue, priority) for payload in PAYLOADS for queue, priority in SENDS]
    published = celery_messages(memory_app, monkeypatch, sends)
    channel = redis_channel()
    for (payload, queue, priority), (celery_queue, celery_message) in zip(sends, published,
                                                                          strict=True):
        sublist, raw = generate_message(memory_app, payload, queue, priority)
        direct = json.loads(raw)
        assert celery_queue == queue
        assert without_tag(direct) == without_tag(json.loads(json.dumps(celery_message)))
        assert direct["properties"]["delivery_tag"]  # kombu's is a uuid too
        # Where kombu's Redis transport would push it.
        assert sublist == channel._q_for_pri(
            queue, channel._get_message_priority(celery_message, reverse=False))


def test_the_body_is_the_payload_in_task_protocol_2(memory_app: Celery) -> None:
    payload = PAYLOADS[0]
    _, raw = generate_message(memory_app, payload, "chat.vllm", 5)
    args, kwargs, embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
    assert args == [payload.to_dict()] and kwargs == {}
    assert GeneratePayload.from_dict(args[0]) == payload
    assert embed == {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    headers = json.loads(raw)["headers"]
    assert payload.prompt not in headers["argsrepr"]  # task events show no prompt


def test_push_generate_adds_one_lpush(memory_app: Celery) -> None:
    class Pipe:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def lpush(self, key: str, value: str) -> None:
            self.calls.append((key, value))

    pipe = Pipe()
    push_generate(pipe, memory_app, PAYLOADS[1], "finance.trtllm", 3)
    [(key, value)] = pipe.calls
    assert key == "finance.trtllm|3" and json.loads(value)["headers"]["id"] == "job-2"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6390/3",
                                 "sentinel://a:26379;b:26380/2?master=main"])
def test_the_direct_path_needs_the_broker_to_be_the_clients_redis(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(redis_url=url)
    assert writes_to(make_app(settings), url)
    assert not writes_to(make_app(settings), "redis://127.0.0.1:6390/4")
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://elsewhere:6379/0")  # Celery obeys it
    assert not writes_to(make_app(settings), url)


def test_queue_depths_are_read_at_most_every_fresh_s_plus_what_was_queued_since() -> None:
    depths = {"q.a": 3, "q.b": 0}
    reads: list[list[str]] = []

    def read(queues: list[str]) -> dict[str, int]:
        reads.append(queues)
        return {q: depths[q] for q in queues}

    backlogs = Backlogs(read, fresh_s=60)
    assert backlogs.get(["q.a", "q.b"]) == {"q.a": 3, "q.b": 0}
    backlogs.queued("q.b")
    backlogs.queued("elsewhere.direct.w1")  # a worker's own queue: no lane's depth
    depths["q.a"] = 0  # taken by a worker: seen at the next read
    assert backlogs.get(["q.a", "q.b"]) == {"q.a": 3, "q.b": 1}
    assert len(reads) == 1
    fresh = Backlogs(read, fresh_s=0)
    fresh.get(["q.a", "q.b"])
    assert fresh.get(["q.a", "q.b"]) == {"q.a": 0, "q.b": 0} and len(reads) == 3
