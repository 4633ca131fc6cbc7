"""Redelivery on real parts: a job whose first worker died mid-generation resumes after
the tokens already published (no token twice, none lost); a job past its deadline ends
`expired`."""

from __future__ import annotations

import uuid

from api.client import Client
from tasks.app import make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.helpers import Stack
from tidegate.events import Event
from tidegate.settings import get_settings
from workers.publisher import EventPublisher

PROMPT = "Your refund of"


def test_a_job_whose_worker_died_resumes_after_the_published_tokens(stack: Stack) -> None:
    job_id = str(uuid.uuid4())
    stack.store.create_job(job_id, stack.tenant_id, "chat", "chat.vllm", 5, None,
                           {"max_tokens": 12}, 4)
    stack.store.claim_job(job_id, "dead-worker@gone", "vllm")  # attempt 1, then it died
    publisher = EventPublisher(stack.redis, stack.namespace, 1000, 600)
    # What the dead attempt had published: started and two steps of one token each.
    earlier = [Event(job_id, 0, "started", data={"worker": "dead-worker@gone"}),
               Event(job_id, 1, "token", text=" refund", token_ids=[400]),
               Event(job_id, 2, "token", text=" of", token_ids=[324])]
    for event in earlier:
        publisher.publish(event)

    payload = GeneratePayload(job_id=job_id, lane="chat", prompt=PROMPT, prompt_tokens=4,
                              sampling=Sampling(max_tokens=12, temperature=0.0))
    send_generate(make_app(get_settings()), payload, "chat.vllm", 5)  # a redelivery
    with Client(stack.base_url, stack.api_key) as client:
        events = list(client.stream(job_id))

    assert events[:3] == earlier
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].kind == "done"
    token_ids = [i for e in events if e.kind == "token" for i in e.token_ids]
    assert len(token_ids) == 12 and token_ids[:2] == [400, 324]
    job = stack.store.get_job(job_id)
    assert job is not None and job.status == "done" and job.attempts == 2
    assert job.output_text == "".join(e.text for e in events if e.kind == "token")
    assert job.worker == stack.workers["chat"]


def test_a_job_past_its_deadline_ends_expired(stack: Stack) -> None:
    with Client(stack.base_url, stack.api_key) as client:
        job = client.submit("finance", prompt=PROMPT, max_tokens=1800, deadline_s=0.05)
        events = list(client.stream(job["job_id"]))
        row = client.job(job["job_id"])
    assert events[-1].kind == "error" and events[-1].data["code"] == "deadline_exceeded"
    assert row["status"] == "expired"
    assert sum(len(e.token_ids) for e in events) < 1800
