"""Traces: OpenTelemetry spans from the API through the Celery task to the worker's engine
call, exported over OTLP/HTTP. Off unless `otlp_endpoint` (TIDEGATE_OTLP_ENDPOINT) is set.

One job is one trace. The API's request span is the root (or continues the client's
`traceparent`); the submit writes that trace id on the job's row and the W3C trace
context into the task's payload (`GeneratePayload.trace_context`), which the store keeps
with the row, so a job the reconciler sends again continues the same trace. The worker
opens `tidegate.job` under that context for each attempt and `engine.generate` around
the engine call.

Spans carry ids, counts and names only: never a prompt, an output or a task's arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from tidegate.settings import Settings

# W3C trace context only: the client's `baggage` header is free text, and it must not
# ride along into task payloads.
_PROPAGATOR = TraceContextTextMapPropagator()
TRACER = "tidegate"


def setup_tracing(settings: Settings, service_name: str,
                  exporter: SpanExporter | None = None) -> TracerProvider | None:
    """This process's tracer provider, set as the global one; None (and nothing installed)
    when tracing is off. `exporter` replaces the OTLP exporter (tests: InMemorySpanExporter,
    exported at each span's end rather than in batches)."""
    if exporter is None and not settings.otlp_endpoint:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(settings.otlp_endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process; a second call is refused, logged
    return provider


def _otlp_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits), None outside a trace."""
    context = trace.get_current_span().get_span_context()
    return format_trace_id(context.trace_id) if context.is_valid else None


def carrier() -> dict[str, str]:
    """The current span's W3C trace context (`traceparent`, `tracestate`) to put in a
    message; empty outside a trace."""
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out)
    return out


@contextmanager
def span(name: str, attributes: Mapping[str, AttributeValue],
         parent: Mapping[str, str] | None = None,
         kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """A span around the block, current inside it: a child of the current span, or of the
    trace context in `parent` (a carrier from another process). A no-op while tracing is
    off. Attribute keys get the `tidegate.` prefix. Exceptions mark the span failed, but
    their messages are not recorded: a message may quote what it failed on."""
    context = _PROPAGATOR.extract(dict(parent)) if parent else None
    tracer = trace.get_tracer(TRACER)
    with tracer.start_as_current_span(name, context=context, kind=kind,
                                      attributes=_named(attributes), record_exception=False,
                                      set_status_on_exception=False) as current:
        try:
            yield current
        except BaseException as exc:
            current.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def annotate(**attributes: str | int | float | bool) -> None:
    """Attributes on the current span (ids and counts only), where one is recording."""
    trace.get_current_span().set_attributes(_named(attributes))


def _named(attributes: Mapping[str, AttributeValue]) -> dict[str, AttributeValue]:
    return {f"tidegate.{key}": value for key, value in attributes.items()}
