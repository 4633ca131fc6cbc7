"""The jobs API: POST/GET /v1/jobs, GET/DELETE /v1/jobs/{id}, GET /v1/jobs/{id}/events
(SSE: api/job_sse.py). HTTP only: what a submit checks and does is api/submit.py.

Each handler is a module-level function; what it shares with the others (Deps) comes
through FastAPI's dependencies (api/deps.py `app_deps`)."""

from __future__ import annotations

import asyncio
import re

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse

from api import listing
from api.auth import authenticate, bearer_key
from api.deps import (
    Deps,
    EventStream,
    admit,
    app_deps,
    cancel,
    check_headers,
    check_job_id,
    job_json,
    json_body,
    lane_rank,
    stream_rank,
)
from api.errors import malformed, not_found
from api.job_sse import JustAccepted, job_sse
from api.schemas import parse_job_request
from store import JobRecord
from tidegate.jsontypes import JSONObject

MAX_EVENT_ID = 2**63 - 1  # a stream id's first part is 64 bits; seq + 1 must fit
EVENT_ID = re.compile(r"-?[0-9]{1,20}")
# A job this process accepted this recently is streamed without reading its row first:
# far shorter than any retention, so the row is there.
JUST_ACCEPTED_S = 60.0


def install(app: FastAPI) -> None:
    checked = [Depends(check_headers)]  # every /v1 route: its headers, before it runs
    app.add_api_route("/v1/jobs", submit, methods=["POST"], status_code=202,
                      dependencies=checked)
    app.add_api_route("/v1/jobs", list_jobs, methods=["GET"], dependencies=checked)
    app.add_api_route("/v1/jobs/{job_id}", get_job, methods=["GET"], dependencies=checked)
    app.add_api_route("/v1/jobs/{job_id}", cancel_job, methods=["DELETE"],
                      dependencies=checked)
    app.add_api_route("/v1/jobs/{job_id}/events", events, methods=["GET"],
                      dependencies=checked)


async def submit(request: Request, idempotency_key: str | None = Header(None),
                 deps: Deps = Depends(app_deps)) -> JSONResponse:
    tenant = await authenticate(deps.store, request)  # before the body is read (api/auth.py)
    req = parse_job_request(await json_body(request, deps))
    await deps.prompts.loaded()  # a restarted API: here, not in an admission thread
    rank = lane_rank(deps, req.lane, req.priority, tenant)
    accepted = await deps.admission.run(rank, admit, deps, bearer_key(request), req,
                                        idempotency_key)
    return JSONResponse(accepted.model_dump(), status_code=202 if accepted.created else 200)


async def list_jobs(request: Request, deps: Deps = Depends(app_deps)) -> JSONResponse:
    tenant = await authenticate(deps.store, request)  # 401 before a 422
    query = listing.parse(request.query_params, deps.settings.lanes)
    return JSONResponse(await asyncio.to_thread(_job_page, deps, tenant.id, query))


async def get_job(job_id: str, request: Request, deps: Deps = Depends(app_deps)) -> JSONResponse:
    tenant = await authenticate(deps.store, request)
    job_id = check_job_id(job_id)
    job = await asyncio.to_thread(deps.store.jobs.get_job, job_id, tenant.id)
    if job is None:
        raise not_found("job")
    return JSONResponse(job_json(job))


async def cancel_job(job_id: str, request: Request,
                     deps: Deps = Depends(app_deps)) -> JSONResponse:
    tenant = await authenticate(deps.store, request)
    job_id = check_job_id(job_id)
    job = await asyncio.to_thread(cancel, deps, job_id, tenant.id)
    return JSONResponse(job_json(job))


async def events(job_id: str, request: Request, last_event_id: str | None = Header(None),
                 deps: Deps = Depends(app_deps)) -> EventStream:
    tenant = await authenticate(deps.store, request)
    after = _resume_after(last_event_id, request.query_params.get("last_event_id"))
    job_id = check_job_id(job_id)
    if deps.recent_lanes.owner(job_id) not in (None, tenant.id):
        raise not_found("job")  # another tenant's job, as this process accepted it
    job: JobRecord | JustAccepted | None
    if after < 0 and deps.recent_lanes.fresh(job_id, tenant.id, JUST_ACCEPTED_S):
        # The usual producer: its stream, from the start, right after its submit here.
        # Its row exists, and its end, if it has come, is in its stream: no row read
        # (a store round trip and an admission thread's turn per job).
        job = JustAccepted(job_id, tenant.id)
    else:
        job = await deps.admission.run(stream_rank(deps, job_id, after, tenant),
                                       deps.store.jobs.get_job, job_id, tenant.id)
    if job is None:
        raise not_found("job")
    give_back = deps.streams.take(job.tenant_id)  # 429 when the caps are reached
    return EventStream(job_sse(deps, job, after), give_back)


def _job_page(deps: Deps, tenant_id: int, query: listing.JobQuery) -> JSONObject:
    rows = deps.store.jobs.list_jobs(
        tenant_id, statuses=query.statuses, lane=query.lane, session_id=query.session_id,
        created_after=query.created_after, after=query.after,
        limit=query.limit + 1)  # one more: is there a next page
    page, more = rows[:query.limit], len(rows) > query.limit
    cursor = listing.encode_cursor(page[-1].enqueued_at, page[-1].id) if more else None
    return {"object": "list", "data": [job_json(job) for job in page], "has_more": more,
            "next_cursor": cursor}


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
