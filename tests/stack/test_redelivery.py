"""A job past its deadline ends `expired` (a killed worker's job resuming after the tokens
already published is tests/stack/test_recovery.py)."""

from __future__ import annotations

from api.client import Client
from tests.helpers import Stack

PROMPT = "Your refund of"


def test_a_job_past_its_deadline_ends_expired(stack: Stack) -> None:
    with Client(stack.base_url, stack.api_key) as client:
        job = client.submit("finance", prompt=PROMPT, max_tokens=1800, deadline_s=0.05)
        events = list(client.stream(job["job_id"]))
        row = client.job(job["job_id"])
    assert events[-1].kind == "error" and events[-1].data["code"] == "deadline_exceeded"
    assert row["status"] == "expired"
    assert sum(len(e.token_ids) for e in events) < 1800
