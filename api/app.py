"""The FastAPI application: its factory, and what wraps every route (middlewares, error
handlers, tracing). The routes are their own modules, each with an `install`: the jobs
API (api/job_routes.py), the OpenAI-compatible one (api/openai_routes.py), files and
batches, webhooks, admin, usage, and what probes read (api/ops_routes.py).

HTTP only: routes, bodies, headers and streams. What a submit checks and does is
api/submit.py, which knows nothing of HTTP.

Every header the API reads is checked before a handler runs (400 naming it), a request's
API key before its body is read (api/auth.py), every body on the bytes read
(api/bodylimit.py: 413 at the first byte past the limit), and every wait is bounded: the
admission queue, the SSE streams open (per process and per tenant), the Redis connections
they hold, and each stream's life (api/job_sse.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import redis as syncredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisClusterException
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import Scope

from api import (
    admin,
    batches,
    job_routes,
    openai_routes,
    openapi,
    ops_routes,
    usage,
    webhook_routes,
)
from api.auth import follow_changes
from api.bodylimit import BodyLimit
from api.deps import Deps
from api.errors import ApiError, unavailable
from api.fleet import follow_fleet
from api.frontgate import FrontGate
from api.openai_answers import error_body
from store.batches import Batches
from tidegate import gcfreeze
from tidegate.settings import Settings, get_settings
from tidegate.tracing import setup_tracing

log = logging.getLogger("tidegate.api")

API_THREADS = 12
FORM_OVERHEAD_BYTES = 64 * 1024  # a multipart upload's parts beside its file


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
    job_routes.install(app)
    openai_routes.install(app, deps)
    batches.install(app, deps, batch_store)
    webhook_routes.install(app, deps)
    admin.install(app, deps)
    usage.install(app, deps)  # /v1/usage, /admin/v1/usage
    ops_routes.install(app)
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
