"""FastAPI application: jobs, SSE token streams, health and metrics.

HTTP only: routes, bodies, headers and streams. What a submit checks and does is
api/submit.py, which knows nothing of HTTP.

Every header the API reads is checked before a handler runs (400 naming it), a request's
API key before its body is read (api/auth.py), every body on the bytes read
(api/bodylimit.py: 413 at the first byte past the limit), and every wait is bounded: the
admission queue, the SSE streams open (per process and per tenant), the Redis connections
they hold, and each stream's life (`_sse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis as syncredis
import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisClusterException
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import Scope

from api import admin, batches, listing, openai_routes, openapi, usage, webhook_routes
from api.auth import authenticate, bearer_key, follow_changes
from api.bodylimit import BodyLimit
from api.deps import (
    Deps,
    EventStream,
    admit,
    cancel,
    check_headers,
    check_job_id,
    job_json,
    json_body,
    lane_rank,
    sse_error_frame,
    stream_rank,
)
from api.errors import ApiError, malformed, not_found, unavailable
from api.fleet import fleet_report, follow_fleet
from api.frontgate import FrontGate
from api.openai_api import error_body
from api.schemas import parse_job_request
from store.batches import Batches
from tidegate import gcfreeze, keys
from tidegate.events import TERMINAL, Event
from tidegate.fleet import read_fleet
from tidegate.settings import Settings, get_settings
from tidegate.tracing import setup_tracing

log = logging.getLogger("tidegate.api")

API_THREADS = 12
FORM_OVERHEAD_BYTES = 64 * 1024  # a multipart upload's parts beside its file
MAX_EVENT_ID = 2**63 - 1  # a stream id's first part is 64 bits; seq + 1 must fit


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    deps = Deps(settings)
    batch_store = Batches(deps.store)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Store and broker calls block: give them more threads than the default
        # (cores + 4), so SSE readers' lookups do not queue behind a burst of submits.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(API_THREADS, thread_name_prefix="api-io"))
        auth_changes = asyncio.create_task(follow_changes(deps.redis, settings.namespace,
                                                          deps.open_streams.changed))
        fleet_changes = asyncio.create_task(follow_fleet(deps.redis, settings.namespace,
                                                         deps.fleet_cache.changed))
        gcfreeze.after_start()
        yield
        fleet_changes.cancel()
        auth_changes.cancel()
        deps.admission.close()
        await deps.stream_hub.close()
        await deps.redis.aclose()
        if deps.stream_redis is not deps.redis:
            await deps.stream_redis.aclose()

    app = FastAPI(title="tidegate", version="0.1.0", lifespan=lifespan)
    app.state.deps = deps
    app.add_middleware(BodyLimit, limit_of=_body_limit(settings),
                       refusal=_body_refusal(deps))
    # Outermost: a stranger's request is refused before anything else runs (api/frontgate.py).
    app.add_middleware(FrontGate, gate=lambda: deps.key_gate,
                       render=lambda path, exc: error_response(deps, path, exc),
                       hold_s=settings.auth_failure_hold_s,
                       max_held=settings.auth_failure_holds)
    app.add_exception_handler(ApiError, handle_api_error)
    app.add_exception_handler(syncredis.RedisError, handle_unreachable)
    # A Redis Cluster with no master for a slot (TIDEGATE_STREAMS_URL, mid-failover):
    # redis-py's cluster errors are not all RedisErrors.
    app.add_exception_handler(RedisClusterException, handle_unreachable)
    app.add_exception_handler(OperationalError, handle_unreachable)
    app.add_exception_handler(PoolTimeout, handle_unreachable)  # every pooled connection busy
    _routes(app, deps)
    openai_routes.install(app, deps)
    batches.install(app, deps, batch_store)
    webhook_routes.install(app, deps)
    admin.install(app, deps)
    usage.install(app, deps)  # /v1/usage, /admin/v1/usage
    _ops_routes(app, deps)
    openapi.install(app, settings.lanes)  # /openapi.json; Starlette's 404/405 as JSON errors
    _trace(app, settings)
    return app


def _trace(app: FastAPI, settings: Settings) -> None:
    """With an OTLP endpoint, a span per request (continuing a client's `traceparent`);
    a submit writes its trace id on the job row and hands the context to the task."""
    provider = setup_tracing(settings, "tidegate-api")
    if provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    # Probes and scrapes are not traced; nor is each SSE frame (ASGI send spans).
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider,
                                       excluded_urls="/healthz,/readyz,/metrics",
                                       exclude_spans=["receive", "send"])


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    """An ApiError as its JSON body, naming the field at fault, with its headers; counted
    by the error's type and status (tidegate_requests_rejected_total) for ops' alerts."""
    assert isinstance(exc, ApiError)
    return error_response(request.app.state.deps, request.url.path, exc)


def error_response(deps: Deps, path: str, exc: ApiError) -> JSONResponse:
    if openai_routes.is_openai_path(path):
        status, body = error_body(exc)
        deps.metrics.refused(exc.kind, status)
        return JSONResponse(body, status_code=status, headers=exc.headers)
    deps.metrics.refused(exc.kind, exc.status)
    body = {"error": {"type": exc.kind, "field": exc.field, "message": exc.message}}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _body_limit(settings: Settings) -> Callable[[Scope], int]:
    """A request body's limit in bytes (api/bodylimit.py): an upload's (POST /v1/files,
    whose file part api/files.py bounds itself) is the file's and its form's; every other
    body's is `max_body_bytes`."""
    upload = settings.batch_max_file_bytes + FORM_OVERHEAD_BYTES

    def limit_of(scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"] == "/v1/files":
            return upload
        return settings.max_body_bytes

    return limit_of


def _body_refusal(deps: Deps) -> Callable[[Scope, int], JSONResponse]:
    def refusal(scope: Scope, limit: int) -> JSONResponse:
        if scope["path"] == "/v1/files":
            exc = ApiError(413, "file", "file: larger than the limit of "
                           f"{deps.settings.batch_max_file_bytes} bytes (the upload: "
                           f"{limit} bytes with its form)")
        else:
            exc = ApiError(413, "body", f"body: larger than the limit of {limit} bytes")
        return error_response(deps, scope["path"], exc)

    return refusal


async def handle_unreachable(request: Request, exc: Exception) -> JSONResponse:
    """Redis or the database not answering is what the system lacks right now, not a bug:
    a 503 with a retry hint (the invariant: never a 500)."""
    what = "Redis" if isinstance(exc, syncredis.RedisError | RedisClusterException) \
        else "the database"
    log.error("%s %s: %s unreachable (%s)", request.method, request.url.path, what,
              type(exc).__name__)
    return await handle_api_error(request, unavailable(f"{what} is unavailable; retry later"))


def _routes(app: FastAPI, deps: Deps) -> None:
    checked = [Depends(check_headers)]  # every /v1 route: its headers, before it runs

    @app.post("/v1/jobs", status_code=202, dependencies=checked)
    async def submit(request: Request, idempotency_key: str | None = Header(None)) -> JSONResponse:
        tenant = await authenticate(deps.store, request)  # before the body is read (api/auth.py)
        req = parse_job_request(await json_body(request, deps))
        await deps.prompts.loaded()  # a restarted API: here, not in an admission thread
        rank = lane_rank(deps, req.lane, req.priority, tenant)
        accepted = await deps.admission.run(rank, admit, deps, bearer_key(request), req,
                                            idempotency_key)
        return JSONResponse(accepted.model_dump(), status_code=202 if accepted.created else 200)

    @app.get("/v1/jobs", dependencies=checked)
    async def list_jobs(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)  # 401 before a 422
        query = listing.parse(request.query_params, deps.settings.lanes)
        return JSONResponse(await asyncio.to_thread(_job_page, deps, tenant.id, query))

    @app.get("/v1/jobs/{job_id}", dependencies=checked)
    async def get_job(job_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        job_id = check_job_id(job_id)
        job = await asyncio.to_thread(deps.store.jobs.get_job, job_id, tenant.id)
        if job is None:
            raise not_found("job")
        return JSONResponse(job_json(job))

    @app.delete("/v1/jobs/{job_id}", dependencies=checked)
    async def cancel_job(job_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        job_id = check_job_id(job_id)
        job = await asyncio.to_thread(cancel, deps, job_id, tenant.id)
        return JSONResponse(job_json(job))

    @app.get("/v1/jobs/{job_id}/events", dependencies=checked)
    async def events(job_id: str, request: Request,
                     last_event_id: str | None = Header(None)) -> StreamingResponse:
        tenant = await authenticate(deps.store, request)
        after = _resume_after(last_event_id, request.query_params.get("last_event_id"))
        job_id = check_job_id(job_id)
        if deps.recent_lanes.owner(job_id) not in (None, tenant.id):
            raise not_found("job")  # another tenant's job, as this process accepted it
        job: Any
        if after < 0 and deps.recent_lanes.fresh(job_id, tenant.id, JUST_ACCEPTED_S):
            # The usual producer: its stream, from the start, right after its submit here.
            # Its row exists, and its end, if it has come, is in its stream: no row read
            # (a store round trip and an admission thread's turn per job).
            job = _JustAccepted(job_id, tenant.id)
        else:
            job = await deps.admission.run(stream_rank(deps, job_id, after, tenant),
                                           deps.store.jobs.get_job, job_id, tenant.id)
        if job is None:
            raise not_found("job")
        give_back = deps.streams.take(job.tenant_id)  # 429 when the caps are reached
        return EventStream(_sse(deps, job, after), give_back)


def _ops_routes(app: FastAPI, deps: Deps) -> None:
    """What probes and Prometheus read: no key, no /v1 header checks."""

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        checks = await _readiness(deps)
        ok = all(c["ok"] for c in checks.values())
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/fleetz")
    async def fleetz() -> JSONResponse:
        # A report, not a probe: 200 whatever the fleet's state (`ready` says it; the
        # alert TidegateLaneWithoutActiveWorker watches it). A 5xx is kept for what the
        # API itself lacks: Redis down is handle_unreachable's 503 with Retry-After.
        fleet = await asyncio.to_thread(read_fleet, deps.sync_redis, deps.settings.namespace)
        return JSONResponse(fleet_report(fleet, deps.settings.lanes))

    @app.get("/metrics")
    async def metrics() -> Response:
        # Only this process's own counters (api/metrics.py): no I/O, cheap on the loop.
        body = generate_latest(deps.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def _job_page(deps: Deps, tenant_id: int, query: listing.JobQuery) -> dict[str, Any]:
    rows = deps.store.jobs.list_jobs(
        tenant_id, statuses=query.statuses, lane=query.lane, session_id=query.session_id,
        created_after=query.created_after, after=query.after,
        limit=query.limit + 1)  # one more: is there a next page
    page, more = rows[:query.limit], len(rows) > query.limit
    cursor = listing.encode_cursor(page[-1].enqueued_at, page[-1].id) if more else None
    return {"object": "list", "data": [job_json(job) for job in page], "has_more": more,
            "next_cursor": cursor}


EVENT_ID = re.compile(r"-?[0-9]{1,20}")
# A job this process accepted this recently is streamed without reading its row first:
# far shorter than any retention, so the row is there.
JUST_ACCEPTED_S = 60.0


@dataclass(frozen=True)
class _JustAccepted:
    """What a stream needs of a job's row, for a job this process has just accepted."""

    id: str
    tenant_id: int
    terminal: bool = False  # as far as the stream's start needs to know: its events say


def _resume_after(header: str | None, query: str | None) -> int:
    """The seq a stream resumes after: the Last-Event-ID header, else the `last_event_id`
    query parameter; -1 (from the start) without either. Checked before the answer
    starts: an id Redis cannot read would break the stream after its 200."""
    field, raw = ("last-event-id", header) if header else ("last_event_id", query)
    if not raw:
        return -1
    value = int(raw) if EVENT_ID.fullmatch(raw) else None
    if value is None or not -1 <= value <= MAX_EVENT_ID:
        raise malformed(field, f"{field}: an event's id, an integer from -1 to {MAX_EVENT_ID}")
    return value


async def _sse(deps: Deps, job: Any, after: int) -> AsyncIterator[bytes]:
    """Events after seq `after`, from the job's stream: resumable, never repeated, and
    never a wait without end.

    Events go out as they come. A quiet stream sends a keep-alive each `sse_keepalive_s`
    and looks at the stream's last entry and the job's row: one store read per quiet
    period, none per event. While the job is not terminal in the store the stream stays
    open, however quiet (queued; or its worker died and another attempt will resume).
    Otherwise it ends with an `error` event of its own, with no id (the client's
    Last-Event-ID stays its last job event) and data {"code", "message"}:

        past_end     the job's stream ended at or before Last-Event-ID: nothing follows
        stream_gone  the job ended, and `sse_end_grace_s` later its end is not in the
                     stream (expired, lost by Redis, never written); GET /v1/jobs/{id}
                     has the result
        reconnect    the stream reached `sse_max_lifetime_s`: reconnect with Last-Event-ID
        unavailable  Redis failed: reconnect with Last-Event-ID in a few seconds
    """
    s = deps.settings
    reader = _EventReader(deps, job.id, after)
    closes_at = time.monotonic() + s.sse_max_lifetime_s
    try:
        end = await reader.verdict(job)  # the row the handler read: no second store read
        while end is None:
            wait_s = min(s.sse_keepalive_s, closes_at - time.monotonic())
            if wait_s <= 0:
                end = ("reconnect", f"this stream reached its longest life, "
                       f"{s.sse_max_lifetime_s:g} s: reconnect with Last-Event-ID {reader.seq}")
                break
            frames, ended = await reader.read(wait_s)
            if frames:
                yield frames
                if ended:
                    return
                continue
            end = await reader.verdict()
            if end is None:
                yield b": keep-alive\n\n"
    except (aioredis.RedisError, RedisClusterException) as exc:
        log.warning("SSE of job %s: Redis failed (%s)", job.id, type(exc).__name__,
                    extra={"job_id": job.id})
        end = ("unavailable", f"Redis is unavailable: reconnect with Last-Event-ID {reader.seq} "
               "in a few seconds")
    yield sse_error_frame(*end)


_READ_IT = object()  # verdict(): read the job's row from the store


class _EventReader:
    """One SSE stream's place in a job's events, and what tells it that they ended."""

    def __init__(self, deps: Deps, job_id: str, after: int) -> None:
        self.deps, self.job_id = deps, job_id
        self.key = keys.job_events(deps.settings.namespace, job_id)
        self.cursor = keys.stream_id(after) if after >= 0 else "0-0"
        self.seq = after  # the last event the client has
        self.ended_at: float | None = None  # when the job ended, as the store first said

    async def read(self, wait_s: float) -> tuple[bytes, bool]:
        """The events after the cursor as SSE frames, waiting up to `wait_s` for one (b""
        if none came), and whether the job's terminal event was among them."""
        entries = await self.deps.stream_hub.read(self.key, self.cursor, wait_s)
        if not entries:
            return b"", False
        self.cursor = entries[-1][0]
        self.seq = keys.seq_of(self.cursor)
        return _sse_frames(entries)

    async def verdict(self, job: Any = _READ_IT) -> tuple[str, str] | None:
        """(code, message) of the error event that ends the stream now; None: wait on."""
        if self.seq < 0 and job is not _READ_IT and job is not None and not job.terminal:
            # From the start, a job not ended: neither its stream's end (ahead of any
            # Last-Event-ID) nor its row can end it, so the stream's last entry is not read.
            return None
        last: Any = await self.deps.stream_redis.xrevrange(self.key, count=1)
        if last and _kind_of(last[0][1]) in TERMINAL_KINDS:
            end_seq = keys.seq_of(last[0][0])
            if end_seq > self.seq:
                return None  # the end is in the stream, ahead: the next read brings it
            return ("past_end", f"the job's events ended at id {end_seq}: none follow "
                    f"Last-Event-ID {self.seq}")
        if job is _READ_IT:
            try:
                job = await asyncio.to_thread(self.deps.store.jobs.get_job, self.job_id)
            except SQLAlchemyError as exc:  # the store's outage must not end a stream
                log.warning("SSE of job %s: store failed (%s)", self.job_id,
                            type(exc).__name__, extra={"job_id": self.job_id})
                return None
        return self._job_ended(job)

    def _job_ended(self, job: Any) -> tuple[str, str] | None:
        if job is None:
            return ("stream_gone", "the job no longer exists")
        if not job.terminal:
            return None
        if self.ended_at is None:
            self.ended_at = job.finished_at.timestamp() if job.finished_at else time.time()
        if time.time() < self.ended_at + self.deps.settings.sse_end_grace_s:
            return None  # its end event may be on its way (written after the row)
        return ("stream_gone", f"the job ended ({job.status.value}) and its events are gone "
                f"(expired, or lost by Redis): GET /v1/jobs/{job.id} has its result")


TERMINAL_KINDS = frozenset(kind.encode() for kind in TERMINAL)


def _kind_of(fields: dict[bytes, bytes]) -> bytes:
    return fields.get(b"k") or Event.from_json(fields[b"e"]).kind.encode()  # entries without it


def _sse_frames(entries: list[Any]) -> tuple[bytes, bool]:
    """Stream entries as SSE frames in one chunk (one write for all that were waiting), and
    whether a terminal event ended them. The event's JSON goes out as the worker stored it:
    only its kind is read, from the entry's own field, so a token costs no parse."""
    out = bytearray()
    for entry_id, fields in entries:
        kind = _kind_of(fields)
        out += b"id: %d\nevent: %s\ndata: %s\n\n" % (keys.seq_of(entry_id), kind, fields[b"e"])
        if kind in TERMINAL_KINDS:
            return bytes(out), True
    return bytes(out), False


async def _readiness(deps: Deps) -> dict[str, dict[str, Any]]:
    """What this API process needs to serve, and nothing more: no worker (GET /fleetz,
    api/fleet.py), so a rolling worker restart takes no API out of its load balancer."""
    checks: dict[str, dict[str, Any]] = {}
    try:
        await deps.redis.ping()
        checks["redis"] = {"ok": True}
    except aioredis.RedisError as exc:
        checks["redis"] = {"ok": False, "error": type(exc).__name__}
    if deps.stream_redis is not deps.redis:  # the token streams live apart (TIDEGATE_STREAMS_URL)
        try:
            await deps.stream_redis.ping()
            checks["streams"] = {"ok": True}
        except aioredis.RedisError as exc:
            checks["streams"] = {"ok": False, "error": type(exc).__name__}
    try:
        await asyncio.to_thread(deps.store.jobs.count_jobs)
        checks["database"] = {"ok": True}
    except Exception as exc:
        checks["database"] = {"ok": False, "error": type(exc).__name__}
    checks["tokenizer"] = _no_paths(deps.prompts.readiness())
    return checks


def _no_paths(check: dict[str, Any]) -> dict[str, Any]:
    """A check as anyone may read it (/readyz takes no key): why the tokenizer failed names
    its path on this host, so that goes to the log (api/prompts.py), not here."""
    if check.get("ok") or check.get("error") == "loading":
        return check
    return {"ok": False, "error": "failed to load (the API's log says why)"}
