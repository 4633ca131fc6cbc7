"""The API's contract: the OpenAPI document /openapi.json serves, and the framework's own
errors answered in the shape that document promises.

FastAPI documents what a route's signature declares. The job routes read their body
themselves (api/app.py: a size cap before parsing, errors in the API's own shape), so
FastAPI alone would describe no request body, no auth and no error. This module writes
that contract over FastAPI's document, from the models the handlers use:

    request body   POST /v1/jobs takes api/schemas.py `JobRequest`, with what the model
                   checks in code written as schema: `messages` or `prompt`, not both; no
                   NUL in text; `lane` one of the lanes file's, `max_tokens` and
                   `deadline_s` at most the largest any lane allows
    auth           an HTTP bearer scheme (the API key) on every /v1/jobs operation
    headers        Idempotency-Key and Last-Event-ID in the shapes api/app.py accepts
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
would be `{"detail": ...}`: `install` answers them in the same error shape, a 405 with
every method of the path in `Allow` (Starlette names only the first route's).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException
from starlette.routing import Match

from api.schemas import JobAccepted, JobRequest
from store import JobRecord
from tidegate.events import Event
from tidegate.lanes import Lane

Json = dict[str, Any]

REF = "#/components/schemas/{model}"
BEARER: list[Json] = [{"bearer": []}]
HIDDEN_JOB_FIELDS = ("tenant_id", "idempotency_key")  # api/app.py `_job_json` drops them
NO_NUL = "^[^\\u0000]*$"  # api/schemas.py `check_text`: NUL in text is a 400
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
    403: "The API key may not use this lane, or the session belongs to another tenant.",
    404: "No such job for this API key.",
    413: "The body is larger than the API's limit.",
    422: "A value of the right shape breaks a rule; `error.field` names it.",
    429: "A bound is reached (`error.type`: rate_limited, queue_full, too_many_in_flight, "
         "too_many_streams); retry after `Retry-After` seconds.",
    503: "Redis, the database or every worker of the lane is unavailable, or the API is "
         "overloaded; retry after `Retry-After` seconds.",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                               "required": True,
                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
# Header and path values as api/app.py checks them (`_check_headers`, `_resume_after`,
# `JOB_ID`): anything else is a 400, or a 404 for a job id. An empty Last-Event-ID is
# no id at all (the SSE spec's reconnection sends none), so the stream starts over.
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
    """Serve `document(app, lanes)` at /openapi.json (built on first request), and
    answer Starlette's own errors in the API's error shape."""

    def openapi() -> Json:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, lanes)
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


def document(app: FastAPI, lanes: Mapping[str, Lane]) -> Json:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    doc["components"] = {
        "schemas": _schemas(lanes),
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "An API key (`tidegate tenant add`)."}},
    }
    for (path, method), contract in _operations().items():
        operation = doc["paths"][path][method]
        operation.update(contract)
        for parameter in operation.get("parameters", []):
            parameter["schema"] = PARAMETERS[parameter["name"]]
    return doc


# -- components --------------------------------------------------------------------------


def _schemas(lanes: Mapping[str, Lane]) -> Json:
    defs: Json = {}  # types nested in these (Message, JobStatus)
    schemas: Json = {
        "Error": ERROR_SCHEMA,
        "JobRequest": _job_request(lanes, defs),
        "JobAccepted": _schema_of(JobAccepted, defs),
        "Job": _schema_of(JobRecord, defs),
        "Event": _schema_of(Event, defs),
        "JobList": {"type": "object", "required": ["object", "data", "has_more", "next_cursor"],
                    "properties": {
                        "object": {"const": "list"},
                        "data": {"type": "array", "items": _ref("Job")},
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
    _refuse_nul(defs["Message"])
    return defs | schemas


def _job_request(lanes: Mapping[str, Lane], defs: Json) -> Json:
    schema = _schema_of(JobRequest, defs)
    fields = schema["properties"]
    fields["lane"]["enum"] = sorted(lanes)
    fields["max_tokens"]["maximum"] = max(lane.max_output_tokens for lane in lanes.values())
    deadline = {"maximum": max(lane.deadline_s for lane in lanes.values())}
    fields["deadline_s"]["anyOf"][0].update(deadline)
    schema["anyOf"] = copy.deepcopy(ONE_INPUT)  # _refuse_nul writes into it
    _refuse_nul(schema)
    return schema


def _refuse_nul(node: Any) -> None:
    """Every free-text string schema under `node` gets the NO_NUL pattern."""
    if isinstance(node, list):
        for item in node:
            _refuse_nul(item)
    elif isinstance(node, dict):
        if node.get("type") == "string" and "enum" not in node:
            node.setdefault("pattern", NO_NUL)
        for value in node.values():
            _refuse_nul(value)


def _schema_of(kind: type, defs: Json) -> Json:
    """The JSON schema of a pydantic model or dataclass, its nested types moved into
    `defs` (the document's components)."""
    schema = TypeAdapter(kind).json_schema(ref_template=REF)
    defs.update(schema.pop("$defs", {}))
    return schema


# -- operations --------------------------------------------------------------------------


def _operations() -> dict[tuple[str, str], Json]:
    job_links = {"GetJob": _link("getJob", "job_id"), "CancelJob": _link("cancelJob", "job_id")}
    return {
        ("/v1/jobs", "post"): _jobs_operation(
            "submitJob", "Submit a job.",
            {"202": _json("Accepted: the job is queued.", "JobAccepted", job_links),
             "200": _json("An earlier job with this idempotency key.", "JobAccepted",
                          job_links)},
            errors=(400, 401, 403, 413, 422, 429, 503),
            requestBody={"required": True,
                         "content": {"application/json": {"schema": _ref("JobRequest")}}}),
        ("/v1/jobs", "get"): _jobs_operation(
            "listJobs", "The key's tenant's jobs in the order they were accepted, filtered, "
            "a page at a time (`next_cursor` -> `after`).",
            {"200": _json("A page of jobs.", "JobList")}, errors=(400, 401, 422, 503),
            parameters=[{"name": name, "in": "query", "required": False}
                        for name in LIST_PARAMETERS]),
        ("/v1/jobs/{job_id}", "get"): _jobs_operation(
            "getJob", "Read a job.", {"200": _json("The job.", "Job")},
            errors=(400, 401, 404, 503)),
        ("/v1/jobs/{job_id}", "delete"): _jobs_operation(
            "cancelJob", "Cancel a job; one that has ended is returned as it is.",
            {"200": _json("The job, `cancelled` unless it had ended.", "Job",
                          {"JobEvents": _link("jobEvents", "id")})},
            errors=(400, 401, 404, 503)),
        ("/v1/jobs/{job_id}/events", "get"): _jobs_operation(
            "jobEvents", "The job's events as server-sent events, resumable with "
            "`Last-Event-ID`; the stream ends with the job's terminal event.",
            {"200": {"description": "The event stream; comments keep a quiet one alive.",
                     "content": {"text/event-stream": {"schema": SSE_EVENT}}}},
            errors=(400, 401, 404, 429, 503)),
        ("/v1/jobs/{job_id}/deliveries", "get"): _jobs_operation(
            "jobDeliveries", "The job's webhook deliveries, each with every attempt.",
            {"200": _json("The deliveries (none until the job ends, or without a "
                          "callback_url).", "DeliveryList")}, errors=(400, 401, 404, 503)),
        ("/v1/webhook-secret", "post"): _jobs_operation(
            "rotateWebhookSecret", "A new webhook signing secret, shown once; the older ones "
            "keep signing beside it for TIDEGATE_WEBHOOK_SECRET_OVERLAP_S.",
            {"200": _json("The new secret.", "WebhookSecret")}, errors=(400, 401, 503)),
        ("/healthz", "get"): {"operationId": "health",
                              "responses": {"200": _json("The process is up.", "Health")}},
        ("/readyz", "get"): {"operationId": "readiness", "responses": {
            "200": _json("This API can serve: Redis, the database and its tokenizer answer "
                         "(workers: /fleetz).", "Readiness"),
            "503": _json("Something is not ready: `checks` says what.", "Readiness")}},
        ("/fleetz", "get"): {"operationId": "fleet", "responses": {
            "200": _json("The fleet: `ready` when every lane has an active worker, and "
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
                    **extra: Any) -> Json:
    responses = ok | {str(status): _error(status) for status in errors}
    return {"operationId": operation_id, "summary": summary, "security": BEARER,
            "responses": responses, **extra}


def _error(status: int) -> Json:
    response = _json(ERRORS[status], "Error")
    if status in (429, 503):
        response["headers"] = RETRY_AFTER
    return response


def _json(description: str, schema: str, links: Json | None = None) -> Json:
    response: Json = {"description": description,
                      "content": {"application/json": {"schema": _ref(schema)}}}
    if links:
        response["links"] = links
    return response


def _link(operation_id: str, field: str) -> Json:
    return {"operationId": operation_id, "parameters": {"job_id": f"$response.body#/{field}"}}


def _ref(name: str) -> Json:
    return {"$ref": REF.format(model=name)}
