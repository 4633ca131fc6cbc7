"""FastAPI application: jobs, SSE token streams, health and metrics.

HTTP only: routes, bodies, headers and streams. What a submit checks and does is
api/submit.py, which knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import redis as syncredis
import redis.asyncio as aioredis
from celery import Celery
from fastapi import FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import OperationalError

from api.admission import Admission, RecentLanes
from api.auth import authenticate, bearer_key, tenant_for_key
from api.errors import ApiError, bad_request, not_found, unavailable
from api.metrics import ApiMetrics, FleetCollector
from api.prompts import PromptRenderer
from api.schemas import JobAccepted, JobRequest, parse_job_request
from api.submit import submit as submit_job
from scheduler.router import WorkerView
from store import Store
from tasks.app import make_app
from tidegate import keys
from tidegate.events import TERMINAL, Event
from tidegate.fleet import read_fleet
from tidegate.records import Heartbeat, JobStatus, WorkerState
from tidegate.settings import Settings, get_settings

log = logging.getLogger("tidegate.api")

SSE_BLOCK_MS = 15_000
API_THREADS = 12
# Submits run on a few threads of their own, most urgent lane first (api/admission.py):
# enough to overlap their store and broker round trips, few enough that the queue orders.
SUBMIT_THREADS = 4
UNKNOWN_LANE_RANK = 100.0
RECENT_JOBS = 10_000  # lanes of the jobs this process accepted last, to rank their streams
FLEET_CACHE_S = 0.25  # an SSE comment is sent this often while a job is quiet


class Deps:
    """What the handlers share; built once at startup."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.db_url)
        # Reads block up to SSE_BLOCK_MS: the socket timeout must be longer.
        self.redis: Any = aioredis.Redis.from_url(settings.redis_url,
                                             socket_timeout=SSE_BLOCK_MS / 1000 + 10)
        self.sync_redis = syncredis.Redis.from_url(settings.redis_url)  # handler threads
        self.celery: Celery = make_app(settings)
        self.prompts = PromptRenderer(settings.model_path)
        self.metrics = ApiMetrics()
        self.admission = Admission(SUBMIT_THREADS)
        self.recent_lanes = RecentLanes(RECENT_JOBS)
        self.metrics.registry.register(FleetCollector(
            lambda: read_fleet(self.sync_redis, settings.namespace)))
        self._fleet: tuple[float, list[WorkerView]] = (0.0, [])
        self._fleet_lock = threading.Lock()

    def fleet(self) -> list[WorkerView]:
        """Worker heartbeats, read at most every FLEET_CACHE_S: heartbeats change every
        `heartbeat_s`, and a SCAN per submit was a large share of the API's time."""
        with self._fleet_lock:
            read_at, views = self._fleet
            if time.monotonic() - read_at > FLEET_CACHE_S:
                views = [WorkerView.from_heartbeat(hb)
                         for hb in read_fleet(self.sync_redis, self.settings.namespace)]
                self._fleet = (time.monotonic(), views)
            return views


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    deps = Deps(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Store and broker calls block: give them more threads than the default
        # (cores + 4), so SSE readers' lookups do not queue behind a burst of submits.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(API_THREADS, thread_name_prefix="api-io"))
        follower = asyncio.create_task(deps.metrics.follow(deps.redis, settings.namespace))
        yield
        follower.cancel()
        deps.admission.close()
        await deps.redis.aclose()

    app = FastAPI(title="tidegate", version="0.1.0", lifespan=lifespan)
    app.state.deps = deps
    app.add_exception_handler(ApiError, handle_api_error)
    app.add_exception_handler(syncredis.RedisError, handle_unreachable)
    app.add_exception_handler(OperationalError, handle_unreachable)
    _routes(app, deps)
    return app


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    """An ApiError as its JSON body, naming the field at fault, with its headers; counted
    by field (`none` when no field is at fault: a 404, a 503) for ops' refusal alerts."""
    assert isinstance(exc, ApiError)
    request.app.state.deps.metrics.rejected.labels(exc.field or "none").inc()
    body = {"error": {"type": exc.kind, "field": exc.field, "message": exc.message}}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def handle_unreachable(request: Request, exc: Exception) -> JSONResponse:
    """Redis or the database not answering is what the system lacks right now, not a bug:
    a 503 with a retry hint (the invariant: never a 500)."""
    what = "Redis" if isinstance(exc, syncredis.RedisError) else "the database"
    log.error("%s %s: %s unreachable (%s)", request.method, request.url.path, what,
              type(exc).__name__)
    return await handle_api_error(request, unavailable(f"{what} is unavailable; retry later"))


def _routes(app: FastAPI, deps: Deps) -> None:
    @app.post("/v1/jobs", status_code=202)
    async def submit(request: Request, idempotency_key: str | None = Header(None)) -> JSONResponse:
        key = bearer_key(request)
        req = await _job_request(request, deps)
        rank = _lane_rank(deps, req.lane, req.priority)
        accepted = await deps.admission.run(rank, _admit, deps, key, req, idempotency_key)
        return JSONResponse(accepted.model_dump(), status_code=202 if accepted.created else 200)

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        job = await asyncio.to_thread(deps.store.get_job, job_id, tenant.id)
        if job is None:
            raise not_found("job")
        return JSONResponse(_job_json(job))

    @app.delete("/v1/jobs/{job_id}")
    async def cancel(job_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        job = await asyncio.to_thread(_cancel, deps, job_id, tenant.id)
        return JSONResponse(_job_json(job))

    @app.get("/v1/jobs/{job_id}/events")
    async def events(job_id: str, request: Request,
                     last_event_id: str | None = Header(None)) -> StreamingResponse:
        key = bearer_key(request)
        rank = _lane_rank(deps, deps.recent_lanes.get(job_id))  # a stream opened after its submit
        if await deps.admission.run(rank, _owned_job, deps, key, job_id) is None:
            raise not_found("job")
        after = _parse_last_event_id(last_event_id or request.query_params.get("last_event_id"))
        return StreamingResponse(_sse(deps, job_id, after), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        checks = await _readiness(deps)
        ok = all(c["ok"] for c in checks.values())
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # The fleet's gauges read Redis: not on the event loop.
        body = await asyncio.to_thread(generate_latest, deps.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


async def _job_request(request: Request, deps: Deps) -> JobRequest:
    try:
        return parse_job_request(await _json_body(request, deps))
    except ApiError:
        await authenticate(deps.store, request)  # an unknown key hears 401 before a 400
        raise


async def _json_body(request: Request, deps: Deps) -> Any:
    limit = deps.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body", f"body: larger than the limit of {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, "body", f"body: larger than the limit of {limit} bytes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "body", f"body: not valid JSON ({exc})") from None


def _lane_rank(deps: Deps, lane_name: str | None, priority: int | None = None) -> tuple[float, ...]:
    """A submit's or a stream opening's place among the waiting ones: by its lane's cpu_nice
    (the lane that yields the hosts' CPU to the others yields the API's too), then by job
    priority, then in arrival order."""
    lane = deps.settings.lanes.get(lane_name or "")
    if lane is None:
        return (UNKNOWN_LANE_RANK,)  # a 400 to come, or a job this process did not submit
    return (lane.cpu_nice, -(lane.default_priority if priority is None else priority))


def _admit(deps: Deps, key: str, req: JobRequest, header_key: str | None) -> JobAccepted:
    """The submit's blocking part, on an admission thread: the key's tenant, then
    api/submit.py."""
    accepted = submit_job(deps, tenant_for_key(deps.store, key), req, header_key)
    deps.recent_lanes.add(accepted.job_id, accepted.lane)
    return accepted


def _owned_job(deps: Deps, key: str, job_id: str) -> Any:
    """The job, if the key's tenant owns it (else None: another tenant's job is a 404)."""
    return deps.store.get_job(job_id, tenant_for_key(deps.store, key).id)


def _cancel(deps: Deps, job_id: str, tenant_id: int) -> Any:
    job = deps.store.cancel_job(job_id, tenant_id)
    if job is None:
        raise not_found("job")
    if job.status != JobStatus.CANCELLED:
        return job  # already finished: nothing to cancel
    client = deps.sync_redis
    ns = deps.settings.namespace
    client.set(keys.job_cancel(ns, job_id), "1", ex=deps.settings.stream_ttl_s)
    client.publish(keys.cancel_channel(ns), job_id)
    if job.started_at is None:  # no worker will ever run it: end its stream here
        done = Event(job_id=job_id, seq=0, kind="done", data={"finish_reason": "cancelled"})
        client.xadd(keys.job_events(ns, job_id), done.stream_fields(),  # type: ignore[arg-type]
                    id=keys.stream_id(0))
        client.expire(keys.job_events(ns, job_id), deps.settings.stream_ttl_s)
    return job


def _parse_last_event_id(raw: str | None) -> int:
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise bad_request("last-event-id", "last-event-id: must be an event's integer id") from None
    if value < -1:
        raise bad_request("last-event-id", "last-event-id: must be -1 or more")
    return value


async def _sse(deps: Deps, job_id: str, after: int) -> AsyncIterator[bytes]:
    """Events after seq `after`, read from the job's stream: resumable, never repeated."""
    key = keys.job_events(deps.settings.namespace, job_id)
    last_id = keys.stream_id(after) if after >= 0 else "0-0"
    while True:
        reply: Any = await deps.redis.xread({key: last_id}, block=SSE_BLOCK_MS, count=256)
        if not reply:
            yield b": keep-alive\n\n"
            continue
        entries = reply[0][1]
        last_id = entries[-1][0]
        frames, ended = _sse_frames(entries)
        yield frames
        if ended:
            return


TERMINAL_KINDS = frozenset(kind.encode() for kind in TERMINAL)


def _sse_frames(entries: list[Any]) -> tuple[bytes, bool]:
    """Stream entries as SSE frames in one chunk (one write for all that were waiting), and
    whether a terminal event ended them. The event's JSON goes out as the worker stored it:
    only its kind is read, from the entry's own field, so a token costs no parse."""
    out = bytearray()
    for entry_id, fields in entries:
        body = fields[b"e"]
        kind = fields.get(b"k") or Event.from_json(body).kind.encode()  # entries without it
        out += b"id: %d\nevent: %s\ndata: %s\n\n" % (keys.seq_of(entry_id), kind, body)
        if kind in TERMINAL_KINDS:
            return bytes(out), True
    return bytes(out), False


def _job_json(job: Any) -> dict[str, Any]:
    body = asdict(job)
    body.pop("tenant_id", None)
    body.pop("idempotency_key", None)
    for name, value in body.items():
        if hasattr(value, "isoformat"):
            body[name] = value.isoformat()
    return body


async def _readiness(deps: Deps) -> dict[str, dict[str, Any]]:
    checks: dict[str, dict[str, Any]] = {}
    try:
        await deps.redis.ping()
        checks["redis"] = {"ok": True}
    except aioredis.RedisError as exc:
        checks["redis"] = {"ok": False, "error": type(exc).__name__}
    try:
        await asyncio.to_thread(deps.store.count_jobs)
        checks["database"] = {"ok": True}
    except Exception as exc:
        checks["database"] = {"ok": False, "error": type(exc).__name__}
    checks["workers"] = await _workers_check(deps) if checks["redis"]["ok"] else {"ok": False}
    return checks


async def _workers_check(deps: Deps) -> dict[str, Any]:
    ready = []
    pattern = keys.worker_heartbeat_pattern(deps.settings.namespace)
    async for key in deps.redis.scan_iter(match=pattern, count=100):
        raw = await deps.redis.get(key)
        hb = Heartbeat.from_json(raw) if raw else None
        if hb is not None and hb.state == WorkerState.ACTIVE:
            ready.append(hb.name)
    return {"ok": bool(ready), "active": sorted(ready)}
