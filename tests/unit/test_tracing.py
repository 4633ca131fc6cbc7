"""tidegate/tracing.py in one process: off without an endpoint; with an exporter, a span
continues a trace context handed over from another process, and hands its own on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tidegate import tracing
from tidegate.settings import Settings

UNTRACED = Settings(otlp_endpoint="")


def test_without_an_endpoint_nothing_is_installed() -> None:
    assert tracing.setup_tracing(UNTRACED, "tidegate-api") is None
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    with tracing.span("tidegate.job", {"job_id": "j1"}):
        assert tracing.current_trace_id() is None  # what a submit writes on the row
        assert tracing.carrier() == {}  # what it puts in the task's payload


@pytest.fixture(scope="module")
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = tracing.setup_tracing(UNTRACED, "tidegate-worker", exporter=exporter)
    assert provider is not None and trace.get_tracer_provider() is provider
    yield exporter
    provider.shutdown()


def test_a_span_continues_the_trace_context_it_is_handed(
        exported: InMemorySpanExporter) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    handed = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    with tracing.span("tidegate.job", {"job_id": "j1"}, parent=handed):
        tracing.annotate(attempt=2)
        assert tracing.current_trace_id() == trace_id
        with tracing.span("engine.generate", {"engine": "vllm"}):
            onward = tracing.carrier()
    engine, job = exported.get_finished_spans()
    assert onward["traceparent"].startswith(f"00-{trace_id}-")
    assert job.parent is not None and format(job.parent.span_id, "016x") == parent_id
    assert engine.parent is not None and engine.parent.span_id == job.context.span_id
    assert dict(job.attributes or {}) == {"tidegate.job_id": "j1", "tidegate.attempt": 2}
    assert job.resource.attributes["service.name"] == "tidegate-worker"
    assert tracing.current_trace_id() is None  # the block's span is current only inside it


def test_a_failed_span_names_the_exception_not_its_message(
        exported: InMemorySpanExporter) -> None:
    exported.clear()
    with pytest.raises(ValueError), tracing.span("engine.generate", {"engine": "vllm"}):
        raise ValueError("the prompt 'where is my parcel' is too long")
    (failed,) = exported.get_finished_spans()
    assert failed.status.status_code.name == "ERROR"
    assert failed.status.description == "ValueError" and not failed.events
