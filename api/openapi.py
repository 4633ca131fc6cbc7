"""The API's contract: the OpenAPI document /openapi.json serves, and the framework's own
errors answered in the shape that document promises.

FastAPI documents what a route's signature declares. Every route reads its body itself
(api/app.py: a size cap before parsing, errors in the API's own shape), so FastAPI alone
would describe no request body, no auth and no error; the OpenAI, Files, Batches and admin
routes are even left out of FastAPI's document (`include_in_schema=False`). This module
documents every route, those included, writing the contract over FastAPI's document from
the models the handlers use: the jobs API here, the OpenAI-compatible routes (chat and
text completions, models, files, batches) in api/openapi_openai.py, the admin API in
api/openapi_admin.py. For the jobs API:

    request body   POST /v1/jobs takes api/schemas.py `JobRequest`, with what the model
                   checks in code written as schema: `messages` or `prompt`, not both; no
                   NUL in text; `lane` one of the lanes file's, `max_tokens` and
                   `deadline_s` at most the largest any lane allows
    auth           an HTTP bearer scheme (the API key) on every /v1/jobs operation
    headers        Idempotency-Key and Last-Event-ID in the shapes the routes accept
    responses      every status a route answers; each error as api/errors.py writes it,
                   {"error": {"type", "field", "message"}}, 429 and 503 with Retry-After;
                   the event stream's events and their JSON
    links          a submit's `job_id` to reading and cancelling that job; a cancel's
                   `id` to its event stream. The stream is linked from the cancel, not
                   from the submit: a queued job's stream stays open until the job ends,
                   a cancelled one's ends at once (the cancel writes its terminal event),
                   so a client that follows the links never waits on a job that may
                   never run.

Errors raised by Starlette itself (an unknown path, a method the path does not have)
would be `{"detail": ...}`: `install` answers them in the path's error shape (OpenAI's on
the OpenAI paths, the API's own elsewhere), a 405 with every method of the path in
`Allow` (Starlette names only the first route's).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from api import openapi_admin, openapi_openai, openapi_usage
from api.errors import ApiError
from api.openai_answers import error_body
from api.openai_routes import is_openai_path
from api.openapi_parts import (
    BEARER,
    REF,
    SECURITY_SCHEMES,
    Json,
    error_response,
    json_response,
    link,
    ref,
    refuse_nul,
    schema_of,
)
from api.schemas import JobAccepted, JobRequest
from store import JobRecord
from tidegate.events import Event
from tidegate.lanes import Lane
from tidegate.settings import Settings

HIDDEN_JOB_FIELDS = ("tenant_id", "idempotency_key")  # api/deps.py `job_json` drops them
# JobRequest's `_one_input`: a non-empty `messages` or a non-empty `prompt`, not both.
ONE_INPUT = [
    {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1},
                                               "prompt": {"type": "null"}}},
    {"required": ["prompt"], "properties": {"prompt": {"type": "string", "minLength": 1},
                                             "messages": {"type": "null"}}},
]

# What each error status means on this API; every one has the body of api/errors.py.
ERRORS = {
    400: "Bytes the API does not carry: a body that is not JSON, a header of the wrong "
         "shape, NUL or a lone surrogate in text; `error.field` names where.",
    401: "No `Authorization: Bearer <API key>` header, or an unknown or revoked key.",
    403: "The API key may not use this lane.",
    404: "No such job for this API key.",
    413: "The body is larger than the API's limit.",
    422: "A value of the right shape breaks a rule; `error.field` names it.",
    429: "A bound is reached (`error.type`: rate_limited, queue_full, too_many_in_flight, "
         "too_many_streams), or the caller's address earned too many 401s lately; retry "
         "after `Retry-After` seconds.",
    503: "Redis, the database or every worker of the lane is unavailable, or the API is "
         "overloaded; retry after `Retry-After` seconds.",
}
# Header and path values as the routes check them (api/deps.py `check_headers`, `JOB_ID`;
# api/job_routes.py `_resume_after`): anything else is a 400, or a 404 for a job id. An
# empty Last-Event-ID is no id at all (the SSE spec's reconnection sends none), so the
# stream starts over.
PARAMETERS = {
    "idempotency-key": {"type": "string", "pattern": "^[!-~]{1,255}$"},
    "last-event-id": {"type": "string", "pattern": "^(-1|[0-9]{1,18})?$"},
    "job_id": {"type": "string", "pattern": "^[0-9A-Za-z_.:-]{1,64}$"},
    # GET /v1/jobs, as api/listing.py reads them.
    "status": {"type": "string", "pattern": "^(queued|running|done|error|cancelled|expired)"
               "(,(queued|running|done|error|cancelled|expired))*$"},
    "lane": {"type": "string", "pattern": "^[!-~]{1,64}$"},
    "session_id": {"type": "string", "pattern": "^[!-~]{1,255}$"},
    "created_after": {"type": "string", "description": "ISO 8601 with a timezone, or Unix "
                      "seconds."},
    "after": {"type": "string", "description": "A page's `next_cursor`, as it is."},
    "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
    **openapi_openai.PARAMETERS,
    **openapi_admin.PARAMETERS,
    **openapi_usage.PARAMETERS,
}
LIST_PARAMETERS = ("status", "lane", "session_id", "created_after", "after", "limit")

ERROR_SCHEMA: Json = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["type", "field", "message"],
        "properties": {
            "type": {"type": "string", "description": "invalid_request, unauthorized, "
                     "forbidden, not_found, rate_limited, unavailable, ..."},
            "field": {"type": ["string", "null"],
                      "description": "The request field at fault; null when none is."},
            "message": {"type": "string"},
        },
    }},
}
SSE_EVENT: Json = {
    "description": "One server-sent event: a job event (its `id` the event's `seq`), or an "
                   "`error` event with no id that ends the stream without the job's end "
                   "(data `{\"code\", \"message\"}`: past_end, stream_gone, reconnect, "
                   "unavailable).",
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"enum": ["started", "token", "done", "error"]},
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [
                     {"$ref": REF.format(model="Event")},
                     {"type": "object", "required": ["code", "message"],
                      "properties": {"code": {"type": "string"},
                                     "message": {"type": "string"}}}]}},
    },
}


def install(app: FastAPI, lanes: Mapping[str, Lane]) -> None:
    """Serve `document(app, lanes, settings)` at /openapi.json (built on first request),
    and answer Starlette's own errors in the API's error shape."""

    def openapi() -> Json:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, lanes, app.state.deps.settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_exception_handler(HTTPException, framework_error)


async def framework_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
        headers["Allow"] = ", ".join(sorted(_methods_of_path(request)))
    kind = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    request.app.state.deps.metrics.refused(kind, exc.status_code)
    if is_openai_path(request.url.path):
        status, body = error_body(ApiError(exc.status_code, None, str(exc.detail), kind=kind))
        return JSONResponse(body, status_code=status, headers=headers)
    body = {"error": {"type": kind, "field": None, "message": str(exc.detail)}}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def _methods_of_path(request: Request) -> set[str]:
    """Every method some route serves at the request's path (a partial match: the path
    matches, the method does not)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return methods


def document(app: FastAPI, lanes: Mapping[str, Lane], settings: Settings) -> Json:
    """Every route of `app`, with its contract. A route with none is shown as FastAPI
    sees it, marked `x-undocumented` (tests/stack/test_fuzz.py fails on one)."""
    doc = get_openapi(title=app.title, version=app.version, routes=every_route(app.routes))
    doc["components"] = {
        "schemas": (_schemas(lanes) | openapi_openai.schemas(settings, lanes)
                    | openapi_admin.schemas(settings) | openapi_usage.schemas()),
        "securitySchemes": SECURITY_SCHEMES,
    }
    contracts = (_operations() | openapi_openai.operations() | openapi_admin.operations()
                 | openapi_usage.operations())
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            if (path, method) not in contracts:
                operation["x-undocumented"] = True
                continue
            operation.update(contracts[path, method])
            for parameter in operation.get("parameters", []):
                own = f"{operation['operationId']}.{parameter['name']}"
                parameter["schema"] = (PARAMETERS.get(own) or PARAMETERS.get(parameter["name"])
                                       or parameter["schema"])
    return doc


def every_route(routes: Iterable[BaseRoute]) -> list[BaseRoute]:
    """The app's routes, those FastAPI leaves out of its document included (a copy of
    each, shown): this module documents them all."""
    shown: list[BaseRoute] = []
    for route in routes:
        if isinstance(route, APIRoute) and not route.include_in_schema:
            route = copy.copy(route)
            route.include_in_schema = True
        shown.append(route)
    return shown


# -- components --------------------------------------------------------------------------


def _schemas(lanes: Mapping[str, Lane]) -> Json:
    defs: Json = {}  # types nested in these (Message, JobStatus)
    schemas: Json = {
        "Error": ERROR_SCHEMA,
        "JobRequest": _job_request(lanes, defs),
        "JobAccepted": schema_of(JobAccepted, defs),
        "Job": schema_of(JobRecord, defs),
        "Event": schema_of(Event, defs),
        "JobList": {"type": "object", "required": ["object", "data", "has_more", "next_cursor"],
                    "properties": {
                        "object": {"const": "list"},
                        "data": {"type": "array", "items": ref("Job")},
                        "has_more": {"type": "boolean"},
                        "next_cursor": {"type": ["string", "null"],
                                        "description": "Pass as `after` for the next page; "
                                                       "null on the last."}}},
        "DeliveryList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": DELIVERY}}},
        "WebhookSecret": {"type": "object", "required": ["secret", "previous_valid_for_s"],
                          "properties": {
                              "secret": {"type": "string", "pattern": "^whsec_"},
                              "previous_valid_for_s": {"type": "number"}}},
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"type": "string"}}},
        "Readiness": {"type": "object", "required": ["ready", "checks"], "properties": {
            "ready": {"type": "boolean"},
            "checks": {"type": "object", "additionalProperties": {
                "type": "object", "required": ["ok"],
                "properties": {"ok": {"type": "boolean"}}}}}},
        "Fleet": {"type": "object", "required": ["ready", "workers", "lanes"], "properties": {
            "ready": {"type": "boolean"},
            "workers": {"type": "object", "description": "Workers heartbeating, by state.",
                        "additionalProperties": {"type": "integer"}},
            "lanes": {"type": "object", "description": "Each lane's workers: by state, "
                      "then by engine pool, their names.",
                      "additionalProperties": {"type": "object", "required": ["ready"]}}}},
    }
    for name in HIDDEN_JOB_FIELDS:  # a job as GET and DELETE return it
        schemas["Job"]["properties"].pop(name)
        schemas["Job"]["required"].remove(name)
    refuse_nul(defs["Message"])
    return defs | schemas


def _job_request(lanes: Mapping[str, Lane], defs: Json) -> Json:
    schema = schema_of(JobRequest, defs)
    fields = schema["properties"]
    fields["lane"]["enum"] = sorted(lanes)
    fields["max_tokens"]["maximum"] = max(lane.max_output_tokens for lane in lanes.values())
    deadline = {"maximum": max(lane.deadline_s for lane in lanes.values())}
    fields["deadline_s"]["anyOf"][0].update(deadline)
    schema["anyOf"] = copy.deepcopy(ONE_INPUT)  # refuse_nul writes into it
    refuse_nul(schema)
    return schema


# -- operations --------------------------------------------------------------------------


# A producer's first submit, answered 202 (and the fuzzing run's sure 2xx among the
# schema's many optional fields, tests/stack/test_fuzz.py).
EXAMPLE_JOB = {"lane": "chat", "max_tokens": 4,
               "messages": [{"role": "user", "content": "Where is my parcel?"}]}


def _operations() -> dict[tuple[str, str], Json]:
    job_links = {"GetJob": link("getJob", job_id="$response.body#/job_id"),
                 "CancelJob": link("cancelJob", job_id="$response.body#/job_id")}
    return {
        ("/v1/jobs", "post"): _jobs_operation(
            "submitJob", "Submit a job.",
            {"202": json_response("Accepted: the job is queued.", "JobAccepted", job_links),
             "200": json_response("An earlier job with this idempotency key.", "JobAccepted",
                          job_links)},
            errors=(400, 401, 403, 413, 422, 429, 503),
            requestBody={"required": True, "content": {"application/json": {
                "schema": ref("JobRequest"), "example": EXAMPLE_JOB}}}),
        ("/v1/jobs", "get"): _jobs_operation(
            "listJobs", "The key's tenant's jobs in the order they were accepted, filtered, "
            "a page at a time (`next_cursor` -> `after`).",
            {"200": json_response("A page of jobs.", "JobList")}, errors=(400, 401, 422, 429, 503),
            parameters=[{"name": name, "in": "query", "required": False}
                        for name in LIST_PARAMETERS]),
        ("/v1/jobs/{job_id}", "get"): _jobs_operation(
            "getJob", "Read a job.", {"200": json_response("The job.", "Job")},
            errors=(400, 401, 404, 429, 503)),
        ("/v1/jobs/{job_id}", "delete"): _jobs_operation(
            "cancelJob", "Cancel a job; one that has ended is returned as it is.",
            {"200": json_response("The job, `cancelled` unless it had ended.", "Job",
                          {"JobEvents": link("jobEvents", job_id="$response.body#/id")})},
            errors=(400, 401, 404, 429, 503)),
        ("/v1/jobs/{job_id}/events", "get"): _jobs_operation(
            "jobEvents", "The job's events as server-sent events, resumable with "
            "`Last-Event-ID`; the stream ends with the job's terminal event.",
            {"200": {"description": "The event stream; comments keep a quiet one alive.",
                     "content": {"text/event-stream": {"schema": SSE_EVENT}}}},
            errors=(400, 401, 404, 429, 503)),
        ("/v1/jobs/{job_id}/deliveries", "get"): _jobs_operation(
            "jobDeliveries", "The job's webhook deliveries, each with every attempt.",
            {"200": json_response("The deliveries (none until the job ends, or without a "
                          "callback_url).", "DeliveryList")}, errors=(400, 401, 404, 429, 503)),
        ("/v1/webhook-secret", "post"): _jobs_operation(
            "rotateWebhookSecret", "A new webhook signing secret, shown once; the older ones "
            "keep signing beside it for TIDEGATE_WEBHOOK_SECRET_OVERLAP_S.",
            {"200": json_response("The new secret.", "WebhookSecret")},
            errors=(400, 401, 429, 503)),
        ("/healthz", "get"): {"operationId": "health",
                              "responses": {"200": json_response("The process is up.", "Health")}},
        ("/readyz", "get"): {"operationId": "readiness", "responses": {
            "200": json_response("This API can serve: Redis, the database and its tokenizer answer "
                         "(workers: /fleetz).", "Readiness"),
            "503": json_response("Something is not ready: `checks` says what.", "Readiness")}},
        ("/fleetz", "get"): {"operationId": "fleet", "responses": {
            "200": json_response("The fleet: `ready` when every lane has an active worker, and "
                         "`lanes` says which lack one.", "Fleet"),
            "503": _error(503)}},
        ("/metrics", "get"): {"operationId": "metrics", "responses": {"200": {
            "description": "Prometheus metrics.",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}}},
    }


_AT = {"type": ["string", "null"], "format": "date-time"}
DELIVERY: Json = {"type": "object", "required": ["id", "url", "status", "attempts", "log"],
                  "properties": {
                      "id": {"type": "string", "description": "The `webhook-id` header."},
                      "url": {"type": "string"},
                      "status": {"enum": ["pending", "sending", "delivered", "failed"]},
                      "attempts": {"type": "integer"}, "created_at": _AT,
                      "delivered_at": _AT, "next_attempt_at": _AT,
                      "last_error": {"type": ["string", "null"]},
                      "log": {"type": "array", "items": {
                          "type": "object",
                          "required": ["attempt", "at", "status_code", "error", "duration_ms"],
                          "properties": {"attempt": {"type": "integer"}, "at": _AT,
                                         "status_code": {"type": ["integer", "null"]},
                                         "error": {"type": ["string", "null"]},
                                         "duration_ms": {"type": "number"}}}}}}


def _jobs_operation(operation_id: str, summary: str, ok: Json, errors: tuple[int, ...],
                    **extra: object) -> Json:
    responses = ok | {str(status): _error(status) for status in errors}
    return {"operationId": operation_id, "summary": summary, "security": BEARER,
            "responses": responses, **extra}


def _error(status: int) -> Json:
    return error_response(ERRORS[status], status, "Error")
