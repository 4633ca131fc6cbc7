"""Traces: one job is one trace, from the API's request span to the worker's job span and
its engine call, exported over OTLP/HTTP by the separate processes (the session stack
exports to tests/otlp.py's receiver), with the trace id on the job's row."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import Stack, api_of_its_own, own_db
from tests.otlp import OtlpReceiver, ReceivedSpan
from tidegate_tools.procs import wait_until


def _submit(stack: Stack, secret: str, headers: dict[str, str] | None = None) -> str:
    body = {"lane": "chat", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"Track parcel {secret} for me."}]}
    with stack.http() as http:
        resp = http.post("/v1/jobs", json=body, headers=headers or {})
    assert resp.status_code == 202, resp.text
    return str(resp.json()["job_id"])


def _job_when_done(stack: Stack, job_id: str) -> dict[str, Any]:
    with stack.http() as http:
        wait_until(lambda: http.get(f"/v1/jobs/{job_id}").json()["status"] == "done", 120,
                   f"job {job_id} done", stack.procs)
        return dict(http.get(f"/v1/jobs/{job_id}").json())


def _trace_of(traces: OtlpReceiver, job_id: str) -> list[ReceivedSpan]:
    """The spans of the job's trace, once its worker's job span, the engine's span under it
    and the API's request span have all arrived."""
    def trace() -> list[ReceivedSpan]:
        spans = traces.received()
        job = [s for s in spans if s.name == "tidegate.job"
               and s.attributes.get("tidegate.job_id") == job_id]
        return [s for s in spans if job and s.trace_id == job[0].trace_id]

    def arrived() -> bool:
        names = {(s.service, s.name) for s in trace()}
        return {("tidegate-worker", "tidegate.job"), ("tidegate-worker", "engine.generate"),
                ("tidegate-api", "POST /v1/jobs")} <= names

    wait_until(arrived, 30, f"the spans of job {job_id} at the OTLP receiver")
    return trace()


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, found)
    return found[0]


def _ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    by_id = {s.span_id: s for s in spans}
    chain = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        chain.append(span)
    return chain


def test_one_trace_spans_the_api_and_the_worker_for_one_job(stack: Stack,
                                                            traces: OtlpReceiver) -> None:
    secret = uuid.uuid4().hex
    job_id = _submit(stack, secret)
    row = _job_when_done(stack, job_id)
    spans = _trace_of(traces, job_id)

    request = _one(spans, "tidegate-api", "POST /v1/jobs")
    job = _one(spans, "tidegate-worker", "tidegate.job")
    engine = _one(spans, "tidegate-worker", "engine.generate")
    assert request.parent_id == ""  # the client sent no trace context: the API began it
    assert request in _ancestors(job, spans)
    assert engine.parent_id == job.span_id
    assert row["trace_id"] == job.trace_id == request.trace_id
    assert request.attributes["tidegate.job_id"] == job_id
    assert job.attributes == {
        "tidegate.job_id": job_id, "tidegate.lane": "chat", "tidegate.attempt": 1,
        "tidegate.worker": stack.workers["chat"], "tidegate.outcome": "done"}
    assert engine.attributes["tidegate.completion_tokens"] == 4
    # Ids and counts only: the prompt is on no span any process sent.
    assert not [s for s in traces.received() if secret in repr(s.attributes)]


def test_a_submit_continues_the_callers_trace(stack: Stack, traces: OtlpReceiver) -> None:
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    job_id = _submit(stack, "parcel", {"traceparent": f"00-{trace_id}-{parent_id}-01"})
    row = _job_when_done(stack, job_id)
    spans = _trace_of(traces, job_id)

    assert row["trace_id"] == trace_id
    assert _one(spans, "tidegate-api", "POST /v1/jobs").parent_id == parent_id
    assert _one(spans, "tidegate-worker", "tidegate.job").trace_id == trace_id


def test_an_api_without_an_otlp_endpoint_writes_no_trace_id(redis_server: str,
                                                            tmp_root: Path) -> None:
    with api_of_its_own(redis_server, tmp_root, "untraced", own_db(__name__, "14"),
                        [("chat", "vllm")]) as own:
        _, key = own.store.tenants.create_tenant("untraced", ["chat"])
        headers = {"Authorization": f"Bearer {key}"}
        body = {"lane": "chat", "max_tokens": 4, "prompt": "Hello"}
        accepted = httpx.post(f"{own.base_url}/v1/jobs", json=body, headers=headers, timeout=30)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["job_id"]
        job = httpx.get(f"{own.base_url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
    assert job["status"] == "queued" and job["trace_id"] is None
    payload = own.store.jobs.job_payload(job_id)
    assert payload is not None and payload["trace_context"] == {}  # nothing for the worker
