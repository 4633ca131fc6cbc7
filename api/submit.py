"""Submitting a job, as plain code: the routes (api/job_routes.py, api/openai_routes.py,
the batch driver) read the request and write the response; everything between is here,
with no HTTP in it.

Checks come before effects, so a refused request changed nothing:

    check    the lane, the tenant's right to it, the lane's limits, the priority the
             tenant may ask, the prompt rendered and counted, the tenant's session: reads
             only (4xx)
    replay   a known idempotency key answers with its job: not charged, not routed,
             nothing published (200)
    bound    the lane's queue depth, the tenant's jobs in flight and its monthly token
             budget (429, api/limits.py)
    route    the pure router picks a queue from the fleet and the backlogs (503 or 4xx)
    charge   the tenant's rate limits (429)
    persist  the job row, with its task's payload, and the session's turn, in one
             transaction: the job is durable from here (a message Redis loses is sent
             again from the row: scheduler/reconcile.py)
    publish  the task to the broker, in one round trip with the lane's traffic sample;
             the one step taken back when it fails (503)
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Protocol

import redis
from celery import Celery
from redis.client import Pipeline

from api import limits, openai_tools
from api.errors import ApiError, bad_request, malformed, unavailable
from api.fleet import LentSlots
from api.metrics import ApiMetrics
from api.prompts import PromptRenderer
from api.schemas import JobAccepted, JobRequest
from store import JobRecord, SessionRecord, Store
from tasks import webhooks
from tasks.app import generate_message, push_generate, send_generate, writes_to
from tasks.payloads import GeneratePayload, Sampling
from tidegate import capabilities as cap
from tidegate import fairq, hot, keys, ratelimit, router, tracing
from tidegate.fairq import FairPush
from tidegate.lanes import Lane, lenders_of, pool_queue, redis_priority
from tidegate.settings import Settings

if TYPE_CHECKING:  # api.auth reads the HTTP request: only its Tenant record is used here
    from api.auth import Tenant

log = logging.getLogger("tidegate.api")

class SubmitDeps(Protocol):
    """What a submit uses of the API's shared dependencies (api.deps.Deps)."""

    settings: Settings
    store: Store
    sync_redis: redis.Redis  # blocking, called from the submit threads
    fair_push: FairPush  # on sync_redis (the broker, where `writes_to` it)
    celery: Celery
    prompts: PromptRenderer
    metrics: ApiMetrics
    in_flight: limits.InFlightCounts
    backlogs: limits.Backlogs
    rate_limits: ratelimit.RateLimits  # per-minute limits, on Redis
    month_usage: limits.MonthUsage  # tokens this month, per tenant (the usage ledger)
    lent: LentSlots  # borrowed jobs sent to lenders since their beats (tidegate/router.py)

    def fleet(self) -> list[router.WorkerView]: ...


@dataclass(frozen=True)
class Checked:
    """A request that passed every check, with what the checks computed."""

    tenant: Tenant
    req: JobRequest
    lane: Lane
    priority: int  # public 0-9: the request's, else the lane's default
    prompt: str  # rendered with the model's chat template
    prompt_tokens: int
    session: SessionRecord | None  # the tenant's session the request continues, if it exists
    idempotency_key: str | None  # the body's, else the `Idempotency-Key` header's


def submit(deps: SubmitDeps, tenant: Tenant, req: JobRequest,
           header_key: str | None) -> JobAccepted:
    """Accept a job (created=True) or answer with the one its idempotency key already
    made (created=False); an ApiError for anything refused."""
    checked = check(deps, tenant, req, header_key)
    known = replay(deps, checked)
    if known is not None:
        return _accepted(known, created=False)
    backlog = lane_backlog(deps, checked.lane)
    bound(deps, checked, backlog)
    decision = route(deps, checked, backlog)
    rate_headers = charge(deps, checked)
    system = _system_prefix(deps, checked.req)
    job, created, payload = persist(deps, checked, decision, system)
    tracing.annotate(job_id=job.id, lane=job.lane)
    if created:  # else a concurrent request with the same key made the job first
        publish(deps, checked, job, payload, system)
        deps.in_flight.admitted(tenant.id)
        deps.backlogs.queued(job.queue)
    accepted = _accepted(job, created)
    accepted._rate_limits = rate_headers
    return accepted


# -- check: reads only ---------------------------------------------------------------


def check(deps: SubmitDeps, tenant: Tenant, req: JobRequest,
          header_key: str | None) -> Checked:
    lane = _check_lane(deps, tenant, req)
    openai_tools.check(req.response_format, req.tools, req.tool_choice, lane.tool_parser)
    priority = _check_priority(tenant, lane, req.priority)
    _check_callback(deps, req)
    prompt = deps.prompts.render(req)
    prompt_tokens = deps.prompts.count(prompt)
    _check_prompt(deps, lane, req, prompt_tokens)
    return Checked(tenant=tenant, req=req, lane=lane, priority=priority,
                   prompt=prompt, prompt_tokens=prompt_tokens,
                   session=_check_session(deps, tenant, req.session_id),
                   idempotency_key=req.idempotency_key or header_key)


def _check_lane(deps: SubmitDeps, tenant: Tenant, req: JobRequest) -> Lane:
    lane = deps.settings.lanes.get(req.lane)
    if lane is None:
        known = ", ".join(sorted(deps.settings.lanes))
        raise bad_request("lane", f"lane: unknown lane {req.lane!r}; lanes are {known}")
    if req.lane not in tenant.lanes:
        raise ApiError(403, "lane", f"lane: this API key may not use lane {req.lane!r}",
                       kind="forbidden")
    if req.max_tokens > lane.max_output_tokens:
        raise bad_request("max_tokens", f"max_tokens: {req.max_tokens} is above the limit of "
                          f"lane {lane.name!r} ({lane.max_output_tokens})")
    if req.deadline_s is not None and req.deadline_s > lane.deadline_s:
        raise bad_request("deadline_s", f"deadline_s: {req.deadline_s} is above the limit of "
                          f"lane {lane.name!r} ({lane.deadline_s})")
    return lane


def highest_priority(tenant: Tenant, lane: Lane) -> int:
    """The most urgent priority (public: 9 is the most urgent, served first) the tenant's
    jobs may ask in `lane`: its max_priority; unset, the lane's default, so that no tenant
    jumps ahead of a shared lane's other tenants unless an admin granted it."""
    return lane.default_priority if tenant.max_priority is None else tenant.max_priority


def _check_priority(tenant: Tenant, lane: Lane, asked: int | None) -> int:
    """The job's priority: the one asked, at most the tenant's highest (a 4xx naming
    `priority` above it). Asked for none: the lane's default, down to that highest."""
    highest = highest_priority(tenant, lane)
    if asked is None:
        return min(lane.default_priority, highest)
    if asked > highest:
        raise bad_request("priority", f"priority: {asked} is above the highest this API key "
                          f"may ask in lane {lane.name!r} ({highest}; 9 is the most urgent)")
    return asked


def _check_callback(deps: SubmitDeps, req: JobRequest) -> None:
    """The URL parsed strictly and what the URL policy can say without DNS (a delivery
    checks the addresses too): 400 for a URL that is not one, 422 for one refused."""
    if req.callback_url is None:
        return
    try:
        webhooks.check_url(req.callback_url, deps.settings)
    except webhooks.UrlMalformed as exc:
        raise malformed("callback_url", f"callback_url: {exc}") from None
    except webhooks.UrlRefused as exc:
        raise bad_request("callback_url", f"callback_url: {exc}") from None


def _check_prompt(deps: SubmitDeps, lane: Lane, req: JobRequest, prompt_tokens: int) -> None:
    field = "prompt" if req.prompt is not None else "messages"
    if prompt_tokens > lane.max_prompt_tokens:
        raise bad_request(field, f"{field}: the prompt is {prompt_tokens} tokens; lane "
                          f"{lane.name!r} allows {lane.max_prompt_tokens}")
    context = deps.settings.max_model_len
    if prompt_tokens + req.max_tokens > context:
        raise bad_request(field, f"{field}: the prompt ({prompt_tokens} tokens) plus max_tokens "
                          f"({req.max_tokens}) exceeds the model's context of {context} tokens")


def _check_session(deps: SubmitDeps, tenant: Tenant,
                   session_id: str | None) -> SessionRecord | None:
    """The tenant's session of this id (None for a new one). Sessions are keyed by tenant
    and id: another tenant's session of the same id is another session, never a 403."""
    if session_id is None:
        return None
    return deps.store.sessions.get_session(session_id, tenant.id)


# -- replay, route, charge -----------------------------------------------------------


def replay(deps: SubmitDeps, checked: Checked) -> JobRecord | None:
    """The job an earlier request with this idempotency key made, if any."""
    if checked.idempotency_key is None:
        return None
    return deps.store.jobs.job_by_idempotency_key(checked.tenant.id, checked.idempotency_key)


def lane_backlog(deps: SubmitDeps, lane: Lane) -> dict[str, int]:
    """Messages waiting in each of the lane's pool queues, read at most every
    limits.BACKLOG_FRESH_S, plus what this process queued since (limits.Backlogs)."""
    return deps.backlogs.get([pool_queue(lane, pool) for pool in lane.pools])


def bound(deps: SubmitDeps, checked: Checked, backlog: dict[str, int]) -> None:
    """The load bounds (api/limits.py): the lane's depth, then the tenant's jobs in flight
    (an indexed count in the store, at most IN_FLIGHT_FRESH_S old)."""
    limits.check_queue_depth(checked.lane, deps.settings.max_queue_depth, checked.priority,
                             sum(backlog.values()))
    limits.check_in_flight(deps.in_flight.get(checked.tenant.id),
                           deps.settings.max_in_flight_per_tenant)
    limits.check_budget(checked.tenant, deps.month_usage.get)


def route(deps: SubmitDeps, checked: Checked, backlog: dict[str, int]) -> router.Route:
    lane, req = checked.lane, checked.req
    affinity = checked.session if deps.settings.session_affinity else None
    fleet = deps.fleet()
    lanes = deps.settings.lanes
    lenders = lenders_of(lane, lanes)
    for lender in lenders:  # whether a lender's own jobs wait (then it has no idle slot)
        backlog = {**backlog, **lane_backlog(deps, lender)}
    try:
        decision = router.route(
            lane, fleet, backlog, lambda name: keys.direct_queue(deps.settings.namespace, name),
            lora=req.lora, session_worker=affinity.last_worker if affinity else None,
            needs=needs(req), lanes=lanes if lenders else None,
            lent=deps.lent.since_beats(fleet) if lenders else None)
    except router.NoRoute as exc:
        if exc.field is not None:
            raise bad_request(exc.field, str(exc)) from None
        raise unavailable(str(exc)) from None
    if decision.borrowed and decision.worker is not None:
        deps.lent.sent(decision.worker)
    return decision


def charge(deps: SubmitDeps, checked: Checked) -> dict[str, str]:
    """The tenant's per-minute limits charged (429 when over); OpenAI's x-ratelimit-*
    headers as they then stand. The worker that ends the job gives back the max_tokens it
    did not generate (workers/runner.py, tidegate/ratelimit.py)."""
    tokens = checked.prompt_tokens + checked.req.max_tokens
    return limits.charge(deps.rate_limits, checked.tenant, tokens)


# -- persist, publish: the effects ---------------------------------------------------


def persist(deps: SubmitDeps, checked: Checked, decision: router.Route,
            system: str) -> tuple[JobRecord, bool, GeneratePayload]:
    """The job row with its task's payload, and its session's turn, in one transaction:
    (job, created, the payload with that turn). The payload's deadline starts here, at
    accept (the deadline rule: scheduler/reconcile.py)."""
    req = checked.req
    payload = _payload(deps, checked, str(uuid.uuid4()), system)
    job, created, turn = deps.store.jobs.create_job(
        payload.job_id, checked.tenant.id, req.lane, decision.queue, checked.priority,
        req.session_id, asdict(_sampling(req)), checked.prompt_tokens,
        idempotency_key=checked.idempotency_key, lora=req.lora,
        route_reason=decision.reason, payload=payload.to_dict(),
        callback_url=req.callback_url or checked.tenant.webhook_url,
        trace_id=tracing.current_trace_id())
    return job, created, replace(payload, turn=turn)


def _payload(deps: SubmitDeps, checked: Checked, job_id: str, system: str) -> GeneratePayload:
    req = checked.req
    return GeneratePayload(
        job_id=job_id, lane=req.lane, prompt=checked.prompt,
        prompt_tokens=checked.prompt_tokens, sampling=_sampling(req),
        session_id=req.session_id, tenant_id=checked.tenant.id,
        deadline_at=time.time() + (req.deadline_s or checked.lane.deadline_s), lora=req.lora,
        shared_prefix_tokens=deps.prompts.count_prefix(system),
        cache_salt=checked.lane.cache_salt(checked.tenant.id),
        guided=openai_tools.guided(req.response_format, req.tools, req.tool_choice,
                                   req.parallel_tool_calls),
        tool_parse=openai_tools.tool_parse(req.tools, req.tool_choice, checked.lane.tool_parser),
        trace_context=tracing.carrier())


def publish(deps: SubmitDeps, checked: Checked, job: JobRecord, payload: GeneratePayload,
            system: str) -> None:
    """Send the job's task and the lane's traffic sample, then count it (metrics)."""
    priority = redis_priority(job.priority)
    # deps.sync_redis is redisconn.sync_client(settings.redis_url) (api/deps.py).
    if writes_to(deps.celery, deps.settings.redis_url):
        _send(deps, job, functools.partial(_push, deps, checked, job.queue, priority,
                                           payload, system))
    else:  # the broker is not the API's Redis: Celery sends, the sample follows
        _send(deps, job, functools.partial(send_generate, deps.celery, payload, job.queue,
                                           priority))
        pipe = deps.sync_redis.pipeline(transaction=False)
        _sample_traffic(deps, pipe, checked.lane, system)
        pipe.execute()
    log.info("job %s queued on %s at priority %d, %d prompt tokens", job.id, job.queue,
             job.priority, checked.prompt_tokens, extra={"job_id": job.id, "lane": job.lane})
    deps.metrics.admitted.labels(checked.req.lane).inc()


def _send(deps: SubmitDeps, job: JobRecord, send: Callable[[], None]) -> None:
    try:
        send()
    except Exception as exc:
        # The one step taken back. The store is written before the broker so that a job
        # the broker holds always has its row, and an accepted job is durable; when the
        # send fails, the row is deleted and the caller told to retry. A process dying
        # between the two leaves a queued row with no message: the reconciler sends it
        # from the row's payload (scheduler/reconcile.py).
        log.error("enqueue of job %s failed: %s", job.id, type(exc).__name__,
                  extra={"job_id": job.id, "lane": job.lane})
        deps.store.jobs.delete_job(job.id)
        raise unavailable("the job queue is unavailable; retry later") from None


def _push(deps: SubmitDeps, checked: Checked, queue: str, priority: int,
          payload: GeneratePayload, system: str) -> None:
    """The task's message (the LPUSH Celery's send_task would make: tasks/app.py), placed
    in its tenant's fair order (tidegate/fairq.py) unless fair queuing is off, and the
    lane's traffic sample, in one round trip. Only the push decides: a sample that failed
    is a sample lost, not a reason to take back a job already queued."""
    pipe = deps.sync_redis.pipeline(transaction=False)
    fair: tuple[str, str, str, int, float] | None = None
    if deps.settings.fair_queuing:
        sublist, message = generate_message(deps.celery, payload, queue, priority)
        job_cost = fairq.cost(checked.prompt_tokens, checked.req.max_tokens,
                              checked.tenant.fair_weight)
        fair = (sublist, message, payload.job_id, checked.tenant.id, job_cost)
        deps.fair_push.add(pipe, *fair)
    else:
        push_generate(pipe, deps.celery, payload, queue, priority)
    _sample_traffic(deps, pipe, checked.lane, system)
    pushed = pipe.execute(raise_on_error=False)[0]
    if fair and isinstance(pushed, redis.exceptions.NoScriptError):
        # A broker new since this process's last push (restarted, flushed): the script
        # is loaded and the push made alone. Nothing was pushed by the failed EVALSHA.
        deps.fair_push.push(*fair)
    elif isinstance(pushed, Exception):
        raise pushed


def _sample_traffic(deps: SubmitDeps, pipe: Pipeline, lane: Lane, system: str) -> None:
    """Adds to `pipe` the lane's arrivals per minute (the scheduler moves them into the
    store for its forecast), and on a lane that shares its prefix cache, the system
    prompts by use (warmed into activated workers; tidegate/hot.py)."""
    ns = deps.settings.namespace
    # Counted by the planning clock's minute (a replay's simulated minute; tidegate/clock.py).
    key = keys.arrivals(ns, lane.name, deps.settings.clock.minute())
    pipe.incr(key)
    pipe.expire(key, keys.ARRIVALS_TTL_S)
    if system and lane.share_prefix_cache:
        hot.record(pipe, ns, lane.name, system, deps.settings.hot_prefix_ttl_s)


def _system_prefix(deps: SubmitDeps, req: JobRequest) -> str:
    """The request's rendered system turn, the prefix its lane's requests share ("" if
    none): rendered once for the KV retention and the hot-prefix sample."""
    system = [m for m in req.messages or [] if m.role == "system"]
    return deps.prompts.render_prefix(system) if system else ""


def _sampling(req: JobRequest) -> Sampling:
    bias = tuple(sorted((int(token), bias) for token, bias in (req.logit_bias or {}).items()))
    return Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    seed=req.seed, stop=tuple(req.stop), n=req.n,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    repetition_penalty=req.repetition_penalty, top_k=req.top_k,
                    min_p=req.min_p, logit_bias=bias, logprobs=req.logprobs)


def needs(req: JobRequest) -> dict[str, str]:
    """The engine capabilities the job needs (tidegate/capabilities.py), each to the request
    field that needs it: the router refuses the job, naming that field, on a lane where no
    active worker has the capability. Fields at their neutral values need nothing."""
    out = cap.needs(req)
    out.update(openai_tools.needs(req.response_format, req.tools, req.tool_choice))
    return out


def _accepted(job: JobRecord, created: bool) -> JobAccepted:
    return JobAccepted(job_id=job.id, status=job.status, lane=job.lane, queue=job.queue,
                       priority=job.priority, events_url=f"/v1/jobs/{job.id}/events",
                       created=created)
