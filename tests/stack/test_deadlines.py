"""Deadlines on real parts. A job whose deadline passed while it waited in the queue ends
`expired` without a token, and its engine never sees it; one whose deadline passes while
it generates ends `expired` after the tokens it streamed, and its engine lets it go."""

from __future__ import annotations

import time
import uuid

from tidegate_client import Client

from tasks.app import make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.helpers import Stack, engine_stats, hold
from tidegate.events import Event
from tidegate.settings import get_settings
from tidegate_tools.procs import wait_until

PROMPT = "Your refund of"


def engine_counts(worker: str) -> tuple[int, int]:
    """Requests the engine aborted and finished so far."""
    stats = engine_stats(worker)
    return stats["aborted"], sum(stats["finished_by_reason"].values())


def test_a_deadline_passed_in_the_queue_expires_before_generating(stack: Stack) -> None:
    """The task reaches the worker after its deadline (it sat in Redis too long): the job
    ends expired with no token, and its engine never took the request."""
    worker = stack.workers["chat"]
    before = engine_counts(worker)
    job_id = str(uuid.uuid4())
    stack.store.jobs.create_job(job_id, stack.tenant_id, "chat", "chat.vllm", 5, None,
                                {"max_tokens": 32}, 4)
    payload = GeneratePayload(job_id=job_id, lane="chat", prompt=PROMPT, prompt_tokens=4,
                              sampling=Sampling(max_tokens=32), deadline_at=time.time() - 1)
    send_generate(make_app(get_settings()), payload, "chat.vllm", 5)
    with Client(stack.base_url, stack.api_key) as client:
        events = list(client.stream(job_id))
        row = client.job(job_id)

    assert [e.kind for e in events] == ["started", "error"]
    assert events[-1].data["code"] == "deadline_exceeded"
    assert row["status"] == "expired" and row["completion_tokens"] == 0
    assert row["first_token_at"] is None
    assert engine_counts(worker) == before  # neither aborted nor finished: never there


HELD_AFTER = 30  # tokens the job streams before its worker holds it
DEADLINE_S = 10.0  # ample for the first tokens, however loaded the machine


def streamed(events: list[Event]) -> int:
    return sum(len(e.token_ids) for e in events if e.kind == "token")


def test_a_deadline_passing_during_generation_expires_after_the_streamed_tokens(
        stack: Stack) -> None:
    """Mid-generation by construction, whatever the engine's speed: the worker holds the job
    after its first tokens and stops its engine (SIGSTOP) that moment (workers/faults.py
    TokenHold, freeze_engine), so the 1,800 tokens cannot all be made; both are let go
    once the deadline has passed: the worker's own timer ended the request meanwhile."""
    worker = stack.workers["finance"]
    aborted, _ = engine_counts(worker)
    hold([worker], HELD_AFTER, stack.broker_url, freeze_engine=True)
    try:
        with Client(stack.base_url, stack.api_key) as client:
            job_id = client.submit("finance", prompt=PROMPT, max_tokens=1800,
                                   deadline_s=DEADLINE_S)["job_id"]
            due = time.time() + DEADLINE_S
            wait_until(lambda: engine_stats(worker)["held"] == job_id, DEADLINE_S,
                       f"the worker to hold job {job_id} before its deadline", poll_s=0.05)
            wait_until(lambda: time.time() > due + 1, DEADLINE_S + 2,
                       "the job's deadline to pass")
            hold([worker], 0, stack.broker_url)
            events = list(client.stream(job_id))
            row = client.job(job_id)
    finally:
        hold([worker], 0, stack.broker_url)
    assert HELD_AFTER <= streamed(events) < 1800
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].kind == "error" and events[-1].data["code"] == "deadline_exceeded"
    assert row["status"] == "expired"
    assert row["completion_tokens"] == streamed(events)
    assert row["output_text"] == "".join(e.text for e in events if e.kind == "token")
    # The engine aborted the request and holds nothing of it.
    wait_until(lambda: engine_stats(worker)["unfinished"] == 0, 30,
               "the engine to let the expired request go")
    assert engine_counts(worker)[0] == aborted + 1
