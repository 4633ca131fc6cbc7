"""Where a stranded message goes, and how it is read and rewritten (tasks/recovery.py,
tidegate/keys.py), and the reconciler's place in the scheduler's beat (scheduler/
service.py). No process, no socket: the messages are the dicts kombu stores."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tasks.payloads import GENERATE, GeneratePayload, Sampling
from tasks.recovery import (
    live_queue,
    message_payload,
    message_priority,
    message_task_id,
    push_served_next,
    rerouted,
    stranded_worker,
    target_queue,
    task_id,
)
from tidegate import keys
from tidegate.records import Heartbeat, WorkerState
from tidegate.settings import Settings

LANES = Path(__file__).resolve().parent.parent / "lanes.toml"  # chat: pools trtllm, vllm


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(lanes_file=LANES, namespace="ns", database_url=f"sqlite:///{tmp_path}/t.db")


def hb(name: str, pool: str, state: WorkerState = WorkerState.ACTIVE,
       lora: tuple[str, ...] = ()) -> Heartbeat:
    return Heartbeat(name=name, state=state, lanes=("chat",), pool=pool, slots=4, lora=lora)


def message(payload: GeneratePayload, queue: str, priority: int = 5) -> dict[str, Any]:
    """A generate message as kombu keeps it in a list (Celery's protocol 2)."""
    body = json.dumps([[payload.to_dict()], {}, {"callbacks": None}]).encode()
    return {"body": base64.b64encode(body).decode(), "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"id": payload.job_id, "task": GENERATE, "lang": "py"},
            "properties": {"priority": priority, "body_encoding": "base64",
                           "delivery_info": {"exchange": "", "routing_key": queue},
                           "delivery_tag": "tag-1"}}


PAYLOAD = GeneratePayload(job_id="j-1", lane="chat", prompt="hi", prompt_tokens=1,
                          sampling=Sampling(max_tokens=4), lora="adapter-a")


def test_direct_queue_names_and_priority_steps() -> None:
    queue = keys.direct_queue("ns", "chat-1-77@host")
    assert keys.direct_queue_worker("ns", queue) == "chat-1-77@host"
    assert keys.direct_queue_worker("ns", keys.queue_sublists(queue)[3]) == "chat-1-77@host"
    assert keys.direct_queue_worker("ns", "chat.vllm") is None
    assert keys.direct_queue_worker("other", queue) is None
    assert [keys.sublist_step(s) for s in keys.queue_sublists("chat.vllm")] == list(range(10))


def test_a_direct_queue_is_stranded_only_when_its_worker_is_gone() -> None:
    queue = keys.direct_queue("ns", "w1@h")
    assert stranded_worker("ns", queue, {"w2@h"}) == "w1@h"
    assert stranded_worker("ns", queue, {"w1@h"}) is None
    assert stranded_worker("ns", "chat.vllm", set()) is None


@pytest.mark.parametrize(("fleet", "lora", "expected"), [
    ([hb("t1", "trtllm"), hb("v1", "vllm")], None, "chat.trtllm"),  # the preferred pool
    ([hb("v1", "vllm")], None, "chat.vllm"),
    ([hb("t1", "trtllm", WorkerState.STANDBY), hb("v1", "vllm")], None, "chat.vllm"),
    ([], None, "chat.vllm"),  # nobody: the last (flexible) pool, for the next worker
    ([hb("v1", "vllm"), hb("v2", "vllm", lora=("adapter-a",))], "adapter-a", "ns.direct.v2"),
    ([hb("v1", "vllm")], "adapter-a", "chat.vllm"),
])
def test_live_queue(settings: Settings, fleet: list[Heartbeat], lora: str | None,
                    expected: str) -> None:
    assert live_queue(settings, fleet, "chat", lora) == expected


def test_a_generate_message_is_read_and_sent_on(settings: Settings) -> None:
    dead = keys.direct_queue("ns", "gone@h")
    m = message(PAYLOAD, dead)
    assert message_task_id(m) == "j-1"
    assert task_id(json.dumps([m, "", dead])) == "j-1"
    assert message_payload(m) == PAYLOAD.to_dict()
    assert target_queue(settings, [hb("v1", "vllm")], m) == "chat.vllm"
    other = {**m, "headers": {**m["headers"], "task": "celery.ping"}}
    assert message_payload(other) is None and target_queue(settings, [], other) is None

    moved = rerouted(m, "chat.vllm")
    assert moved["properties"]["delivery_info"] == {
        "exchange": "", "routing_key": "chat.vllm", "redelivered": True}
    assert moved["headers"]["redelivered"] is True
    assert m["properties"]["delivery_info"]["routing_key"] == dead  # the original unchanged
    assert moved["body"] == m["body"]


def test_a_handed_back_message_goes_where_it_is_served_next() -> None:
    calls: list[tuple[str, str]] = []

    class Pipe:
        def rpush(self, key: str, value: str) -> None:
            calls.append((key, value))

    m = message(PAYLOAD, "x", priority=3)
    push_served_next(Pipe(), m, "chat.vllm")
    assert calls == [("chat.vllm|3", json.dumps(m))]
    assert message_priority(message(PAYLOAD, "x", priority=0)) == 0
    assert message_priority({"properties": {}}) == 0


def test_the_scheduler_runs_the_reconciler_on_its_own_period(settings: Settings) -> None:
    from scheduler.service import RECONCILE, make_scheduler_app, scheduler_queue

    app = make_scheduler_app(settings.model_copy(update={"reconcile_s": 0.5}))
    entry = app.conf.beat_schedule["reconcile"]
    assert entry["task"] == RECONCILE and entry["schedule"] == 0.5
    assert entry["options"]["queue"] == scheduler_queue(settings)
    assert RECONCILE in app.tasks
