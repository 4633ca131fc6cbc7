"""What the API's routes share: the dependencies built once at startup (Deps), and the
steps of a job's life that more than one front door takes (the jobs API,
api/job_routes.py; the OpenAI-compatible one, api/openai_routes.py): reading a body and
its headers, admitting a submit, cancelling, a job as JSON."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import TypedDict

import redis as syncredis
import redis.asyncio as aioredis
from celery import Celery
from fastapi import Request, params
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.admission import Admission, RecentLanes, StreamSlots
from api.auth import FailedAuth, KeyGate, OpenStreams, Tenant, bearer_key, tenant_for_key
from api.errors import ApiError, malformed, not_found, unauthorized
from api.fleet import FLEET_CACHE_S, FleetCache, LentSlots  # noqa: F401  (FLEET_CACHE_S: for the tests)
from api.limits import Backlogs, InFlightCounts, MonthUsage, Refresher
from api.metrics import ApiMetrics
from api.openai_answers import error_body
from api.prompts import PromptRenderer
from api.schemas import JobAccepted, JobRequest
from api.server import SERVER_SEND
from api.sse import error_frame
from api.streamhub import stream_hub
from api.submit import highest_priority
from api.submit import submit as submit_job
from store import JobRecord, Store
from store.usage import Usage
from tasks.app import make_app, queue_lengths
from tidegate import keys, redisconn
from tidegate.events import Event
from tidegate.fairq import FairPush
from tidegate.fleet import read_fleet
from tidegate.jsontypes import JSONObject
from tidegate.ratelimit import RateLimits
from tidegate.records import JobStatus
from tidegate.router import WorkerView
from tidegate.settings import Settings

# Submits run on a few threads of their own, most urgent lane first (api/admission.py):
# enough to overlap their store and broker round trips, few enough that the queue orders.
SUBMIT_THREADS = 4
UNKNOWN_LANE_RANK = 100.0
# A stream that resumes (Last-Event-ID) comes before every lane's submits: its consumer is
# mid-stream, waiting on tokens already made, and opening it costs one row read. Only the
# job's own tenant, as this process knows it (RecentLanes), gets that rank: anyone could
# send a Last-Event-ID. A resume of a job this process does not know (after a restart,
# beside the producers' retried submits) is ranked by its tenant's most urgent lane.
RESUME_RANK = (-1.0,)
# Key lookups of callers never seen with a valid key, waiting at once (api/admission.py):
# beside the tenants' calls, not among them.
MAX_UNKNOWN_WAITING = 64
RECENT_JOBS = 10_000  # lanes of the jobs this process accepted last, to rank their streams
# Redis connections beyond one per SSE stream: readiness, cancels, auth changes.
REDIS_SPARE_CONNECTIONS = 8
REDIS_POOL_WAIT_S = 5.0  # a command waits this long for a free connection, then 503s
# Headers: the idempotency key fits the store's column; an API key is 46 characters.
VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")
PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
MAX_IDEMPOTENCY_KEY = 255
MAX_AUTHORIZATION = 1024
JOB_ID = re.compile(r"[0-9A-Za-z_.:-]{1,64}")  # uuid4 strings; anything else is no job
# The ids the OpenAI-compatible API gives a job's completion: the job's id behind a prefix.
COMPLETION_ID_PREFIXES = ("chatcmpl-", "cmpl-")


class RouteOptions(TypedDict, total=False):
    """Keyword arguments a module gives each of its routes (`app.get(path, **options)`)."""

    dependencies: list[params.Depends]
    include_in_schema: bool


class Deps:
    """What the handlers share; built once at startup."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.db_url, **settings.store_timeouts)
        # SSE streams wait on one shared XREAD (api/streamhub.py), not a connection each;
        # the pool is bounded all the same (the socket timeout is longer than any block),
        # so the API can never take the connections Redis has for the workers.
        self.redis: aioredis.Redis = redisconn.async_client(
            settings.redis_url, max_connections=settings.sse_max_streams + REDIS_SPARE_CONNECTIONS,
            pool_timeout_s=REDIS_POOL_WAIT_S, socket_timeout=settings.sse_keepalive_s + 10,
            socket_connect_timeout=settings.redis_connect_timeout_s)
        # Handler and admission threads: no blocking reads, so each reply gets the plain
        # socket timeout, and a blackholed Redis is a 503 within it (api/app.py).
        self.sync_redis = redisconn.sync_client(settings.redis_url, **settings.redis_timeouts)
        # Places each job's message in its tenant's fair order (api/submit.py `_push`).
        self.fair_push = FairPush(self.sync_redis, settings.namespace, settings.fair_burst_jobs)
        # Jobs' streams and cancel keys (TIDEGATE_STREAMS_URL): the same clients unless
        # they live apart, maybe on a cluster.
        self.stream_redis: aioredis.Redis | aioredis.RedisCluster = self.redis
        self.sync_stream_redis: syncredis.Redis | syncredis.RedisCluster = self.sync_redis
        if settings.streams_url:
            self.stream_redis = redisconn.async_streams_client(
                settings.streams_url,
                max_connections=settings.sse_max_streams + REDIS_SPARE_CONNECTIONS,
                pool_timeout_s=REDIS_POOL_WAIT_S, socket_timeout=settings.sse_keepalive_s + 10,
                socket_connect_timeout=settings.redis_connect_timeout_s)
            self.sync_stream_redis = redisconn.sync_streams_client(settings.streams_url,
                                                              **settings.redis_timeouts)
        self.stream_hub = stream_hub(self.stream_redis, settings.namespace)  # SSE reads, XREADs
        self.celery: Celery = make_app(settings)
        # The tokenizer's files only: an API pod holds no weights (TIDEGATE_TOKENIZER).
        self.prompts = PromptRenderer(settings.tokenizer_path)
        self.metrics = ApiMetrics()
        # The three reads a submit's bounds need, run behind the submits (api/limits.py).
        behind = Refresher()
        self.in_flight = InFlightCounts(self.store.jobs.count_in_flight, behind=behind)
        self.backlogs = Backlogs(lambda queues: queue_lengths(self.sync_redis, queues),
                                 behind=behind)
        self.rate_limits = RateLimits(self.sync_redis, settings.namespace)
        self.month_usage = MonthUsage(Usage(self.store).tokens_since, behind=behind)
        self.admission = Admission(SUBMIT_THREADS, settings.max_admission_waiting,
                                   MAX_UNKNOWN_WAITING)
        # Keys are checked on the event loop before a body is read (api/auth.py).
        self.key_gate = KeyGate(self.admission, FailedAuth(settings.auth_failures,
                                                           settings.auth_failure_window_s))
        self.open_streams = OpenStreams(self.store)  # ended when their key is revoked
        self.streams = StreamSlots(settings.sse_max_streams, settings.sse_max_streams_per_tenant)
        self.metrics.sse_streams.set_function(self.streams.open)
        self.recent_lanes = RecentLanes(RECENT_JOBS)
        self.lent = LentSlots()  # borrowed jobs sent since each lender's beat
        # Refreshed at once on a worker's announcement (api/fleet.py follow_fleet, api/app.py).
        self.fleet_cache = FleetCache(lambda: read_fleet(self.sync_redis, settings.namespace),
                                      settings.fleet_cache_s)

    def fleet(self) -> list[WorkerView]:
        """Worker heartbeats as the router sees them (api/fleet.py FleetCache)."""
        return self.fleet_cache.views()


def app_deps(request: Request) -> Deps:
    """The app's Deps, as a FastAPI dependency of the handlers that are module functions."""
    deps: Deps = request.app.state.deps
    return deps


async def json_body(request: Request, deps: Deps) -> object:
    limit = deps.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:
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
    except RecursionError:  # arrays nested thousands deep
        raise ApiError(400, "body", "body: nested too deeply") from None


async def check_headers(request: Request) -> None:
    """The headers any route reads, checked before it runs: a value of the wrong shape is
    a 400 naming the header, never a 500 from the store or Redis further on.
    Last-Event-ID, read by one route, is checked there (`_resume_after`)."""
    key = request.headers.get("idempotency-key")
    if key is not None and not (len(key) <= MAX_IDEMPOTENCY_KEY and VISIBLE_ASCII.fullmatch(key)):
        raise malformed("idempotency-key", f"idempotency-key: 1 to {MAX_IDEMPOTENCY_KEY} "
                        "visible ASCII characters")
    auth = request.headers.get("authorization")
    if auth is not None and not (len(auth) <= MAX_AUTHORIZATION
                                 and PRINTABLE_ASCII.fullmatch(auth)):
        raise malformed("authorization", "authorization: expected `Bearer <API key>` in "
                        f"at most {MAX_AUTHORIZATION} printable ASCII characters")


def check_job_id(path_id: str) -> str:
    """The job a path's id names (a job's id, or a completion's: `chatcmpl-<job id>`). An
    id no job can have is a 404 without a store lookup (a NUL in it is an error on
    PostgreSQL, not a miss)."""
    job_id = job_id_of(path_id)
    if not JOB_ID.fullmatch(job_id):
        raise not_found("job")
    return job_id


def lane_rank(deps: Deps, lane_name: str | None, priority: int | None = None,
              tenant: Tenant | None = None) -> tuple[float, ...]:
    """A submit's or a stream opening's place among the waiting ones: by its lane's cpu_nice
    (the lane that yields the hosts' CPU to the others yields the API's too), then by job
    priority, then in arrival order. A tenant's submit ranks no higher than the priority
    it may ask (a request above it is refused, and must not wait ahead of others)."""
    lane = deps.settings.lanes.get(lane_name or "")
    if lane is None:
        return (UNKNOWN_LANE_RANK,)  # a 400 to come, or a job this process did not submit
    asked = lane.default_priority if priority is None else priority
    if tenant is not None:
        asked = min(asked, highest_priority(tenant, lane))
    return (lane.cpu_nice, -asked)


def stream_rank(deps: Deps, job_id: str, after: int,
                tenant: Tenant | None = None) -> tuple[float, ...]:
    """A stream opening's place among the waiting calls: its tenant's resume of a job this
    process accepted for it first (RESUME_RANK), else that job's lane; a job this process
    does not know as the tenant's by the tenant's most urgent lane when it resumes, else
    after every lane (UNKNOWN_LANE_RANK)."""
    mine = tenant is not None and deps.recent_lanes.owner(job_id) == tenant.id
    if mine:
        return RESUME_RANK if after >= 0 else lane_rank(deps, deps.recent_lanes.get(job_id))
    if after >= 0 and tenant is not None and deps.recent_lanes.owner(job_id) is None:
        return min((lane_rank(deps, lane) for lane in tenant.lanes),
                   default=(UNKNOWN_LANE_RANK,))
    return (UNKNOWN_LANE_RANK,)


def admit(deps: Deps, key: str, req: JobRequest, header_key: str | None) -> JobAccepted:
    """The submit's blocking part, on an admission thread: the key's tenant, then
    api/submit.py."""
    tenant = tenant_for_key(deps.store, key)  # checked again: revoked since the gate?
    accepted = submit_job(deps, tenant, req, header_key)
    deps.recent_lanes.add(accepted.job_id, accepted.lane, tenant.id)
    return accepted


def cancel(deps: Deps, job_id: str, tenant_id: int) -> JobRecord:
    """Cancel the job, however often asked: a job that had already ended (by an earlier
    DELETE too) comes back as it is, 200; the effects that are safe to repeat are."""
    job = deps.store.runs.cancel_job(job_id, tenant_id)
    if job is None:
        raise not_found("job")
    if job.status != JobStatus.CANCELLED:
        return job  # it had ended otherwise: nothing to cancel
    deps.in_flight.forget(tenant_id)  # its place is free now, not at the next count
    ns = deps.settings.namespace
    deps.sync_stream_redis.set(keys.job_cancel(ns, job_id), "1", ex=deps.settings.stream_ttl_s)
    deps.sync_redis.publish(keys.cancel_channel(ns), job_id)
    if job.started_at is None:  # no worker will ever run it: end its stream here
        end_unstarted(deps, job_id)
    return job


def end_unstarted(deps: Deps, job_id: str) -> None:
    """The end event of a job cancelled before any worker took it, at seq 0, written on
    every DELETE: Redis refuses a second entry with that id, which makes a repeated DELETE
    harmless (as in workers/publisher.py) and lets one repair a first whose write failed."""
    key = keys.job_events(deps.settings.namespace, job_id)
    done = Event(job_id=job_id, seq=0, kind="done", data={"finish_reason": "cancelled"})
    pipe = deps.sync_stream_redis.pipeline(transaction=True)
    pipe.xadd(key, done.stream_fields(), id=keys.stream_id(0))  # type: ignore[arg-type]
    pipe.expire(key, deps.settings.stream_ttl_s)
    added, _ = pipe.execute(raise_on_error=False)
    if isinstance(added, syncredis.ResponseError) and "equal or smaller" not in str(added):
        raise added


def job_json(job: JobRecord) -> JSONObject:
    body = asdict(job)
    body.pop("tenant_id", None)
    body.pop("idempotency_key", None)
    for name, value in body.items():
        if hasattr(value, "isoformat"):
            body[name] = value.isoformat()
    return body


def job_id_of(path_id: str) -> str:
    """The job a path's id names: a job id, or a completion's id (`chatcmpl-<job id>`)."""
    for prefix in COMPLETION_ID_PREFIXES:
        if path_id.startswith(prefix):
            return path_id[len(prefix):]
    return path_id


class EventStream(StreamingResponse):
    """An SSE answer holding its stream slot (api/admission.py StreamSlots) until it is
    done, however it ends: the events ran out, the client went away, an error, its API key
    revoked (then a last frame says so: an `error` event, or OpenAI's error chunk and
    `[DONE]` for `openai`).

    StreamingResponse's headers, with a plain ASGI loop of its own: StreamingResponse ran
    each stream in an anyio task group, a cost per stream and per frame that only the
    watch for the client's going away needs. Here that watch is one task (_Stop)."""

    def __init__(self, body: AsyncIterator[bytes], give_back: Callable[[], None],
                 headers: dict[str, str] | None = None, openai: bool = False) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self.give_back = give_back
        self.openai = openai
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stop = _Stop(receive)
        forget = _register(scope, stop.revoke)
        # The frames skip the middlewares' sends (measured: a sixth of the API's CPU per
        # token at 256 streams, bench/README.md): each of those acts on a response's head
        # or its end (access line, error pages, body limit, a trace span's end), and those
        # still go through them.
        frames = scope.get(SERVER_SEND, send)
        try:
            await self._send_all(send, frames)
        except asyncio.CancelledError:
            stop.halt()  # no cancel of its own after this: the last frame must go out
            if not stop.cancelled_it():
                raise  # a cancel of another's (a server shutting down) goes on
            if stop.revoked:
                await self._send_revoked(send)
        finally:
            stop.halt()
            forget()
            self.give_back()

    async def _send_all(self, send: Send, frames: Send) -> None:
        await self._start(send)
        async for chunk in self.body_iterator:
            await frames({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start(self, send: Send) -> None:
        self.started = True
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})

    async def _send_revoked(self, send: Send) -> None:
        if not self.started:
            await self._start(send)
        await send({"type": "http.response.body", "body": revoked_frames(self.openai),
                    "more_body": False})


REVOKED = "authorization: this stream's API key was revoked"


def revoked_frames(openai: bool) -> bytes:
    """The end of a stream whose key was revoked: OpenAI's error chunk (as a 401 would
    say it) and `[DONE]`, or the jobs API's `error` event `unauthorized`."""
    if not openai:
        return error_frame("unauthorized", REVOKED)
    _, body = error_body(unauthorized(REVOKED))
    return b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(body).encode()


def _register(scope: Scope, end: Callable[[], None]) -> Callable[[], None]:
    """The stream in its app's OpenStreams under the key it was opened with (api/auth.py);
    returns what takes it out."""
    app_state = getattr(scope.get("app"), "state", None)
    streams = getattr(getattr(app_state, "deps", None), "open_streams", None)
    if streams is None:  # not served by the app (a stream built on its own)
        return lambda: None
    try:
        key = bearer_key(Request(scope))
    except ApiError:
        return lambda: None
    forget: Callable[[], None] = streams.add(key, end)
    return forget


class _Stop:
    """Ends a stream from outside, by cancelling the task that sends it: when the server
    says its client went away (uvicorn drops what is sent after that without a word, so
    nothing else would notice until the job ended), or when its key is revoked."""

    RECANCEL_S = 0.1

    def __init__(self, receive: Receive) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        self.streaming = streaming
        self.cancels = 0
        self.revoked = False
        self.halted = False
        self._tasks = [asyncio.create_task(self._watch(receive))]

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # the request's body
        await self._cancel_until_ended()

    def revoke(self) -> None:
        if not (self.revoked or self.halted):
            self.revoked = True
            self._tasks.append(asyncio.create_task(self._cancel_until_ended()))

    async def _cancel_until_ended(self) -> None:
        # Cancelled again until it ends, as anyio does: asyncio.wait_for before Python
        # 3.12 drops a cancel that comes as what it waits on finishes, and redis-py sends
        # every command through one.
        while True:
            self.cancels += 1
            self.streaming.cancel()
            await asyncio.sleep(self.RECANCEL_S)

    def halt(self) -> None:
        """No more cancels from here (called on the streaming task, so none is pending)."""
        self.halted = True
        for task in self._tasks:
            task.cancel()

    def cancelled_it(self) -> bool:
        """Whether the stream's cancel was only this one's (its requests taken back)."""
        for _ in range(self.cancels):
            self.streaming.uncancel()
        cancels, self.cancels = self.cancels, 0
        return cancels > 0 and self.streaming.cancelling() == 0
