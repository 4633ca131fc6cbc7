"""OpenAI's Batch API, on tidegate's queue: its batches (api/files.py holds the files,
api/batch_driver.py the driver that runs them).

    POST /v1/batches                a batch of /v1/chat/completions (or /v1/completions)
    GET  /v1/batches/{id}, GET /v1/batches, POST /v1/batches/{id}/cancel

Each input line becomes a job on the lane of the `flex` service tier (shipped: `batch`,
which runs on chat's workers at the lowest priority and so takes only their spare
capacity), through the same submit as POST /v1/jobs.

A line that is not a valid request is reported in the batch's error file, with its
`custom_id` and the error the endpoint would have answered; it never stops the batch.
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import datetime, timedelta

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from api import files, limits
from api.auth import Tenant, authenticate
from api.deps import Deps, RouteOptions, check_headers, json_body
from api.errors import ApiError, not_found
from api.files import request_lines
from api.openai_models import bad
from api.schemas import check_text
from store import utcnow
from store.batches import Batches, BatchRecord
from tidegate.jsontypes import JSONObject
from tidegate.records import BatchStatus

log = logging.getLogger("tidegate.api")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOWS = ("24h",)  # OpenAI's only window; it lasts TIDEGATE_BATCH_COMPLETION_WINDOW_S
MAX_METADATA = 16  # OpenAI's: keys of a batch's metadata
MAX_LIST = 100
BATCH_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata",
                "output_expires_after")
# What a batch id can be (store/batches.py makes `batch_` and 24 hex digits): anything else
# names no batch, and is answered without the store (PostgreSQL refuses NUL in text: a 500).
BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def install(app: FastAPI, deps: Deps, batches: Batches) -> None:
    hidden: RouteOptions = {"dependencies": [Depends(check_headers)],
                              "include_in_schema": False}
    files.install(app, deps, batches, hidden)
    _batch_routes(app, deps, batches, hidden)


def _batch_routes(app: FastAPI, deps: Deps, batches: Batches, hidden: RouteOptions) -> None:
    @app.post("/v1/batches", **hidden)
    async def create(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        body = await json_body(request, deps)
        record = await asyncio.to_thread(_create, deps, batches, tenant, body)
        return JSONResponse(batch_json(record))

    @app.get("/v1/batches/{batch_id}", **hidden)
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        record = await asyncio.to_thread(batches.get_batch, _batch_id(batch_id), tenant.id)
        if record is None:
            raise not_found("batch")
        return JSONResponse(batch_json(record))

    @app.get("/v1/batches", **hidden)
    async def list_batches(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        after, limit = _page(request)
        rows = await asyncio.to_thread(_list, batches, tenant.id, after, limit + 1)
        page = rows[:limit]
        return JSONResponse({"object": "list", "data": [batch_json(b) for b in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(rows) > limit})

    @app.post("/v1/batches/{batch_id}/cancel", **hidden)
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        record = await asyncio.to_thread(_cancel_batch, batches, _batch_id(batch_id),
                                         tenant.id)
        return JSONResponse(batch_json(record))


# -- batches -------------------------------------------------------------------------


def _create(deps: Deps, batches: Batches, tenant: Tenant, body: object) -> BatchRecord:
    if not isinstance(body, dict):
        raise bad("body", "expected a JSON object")
    check_text(body)
    for name in body:
        if name not in BATCH_FIELDS:
            raise bad(name, "unknown field")
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise bad("endpoint", f"must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(window, str) or window not in WINDOWS:
        raise bad("completion_window", f"must be one of {', '.join(WINDOWS)}")
    meta = _metadata(body.get("metadata"))
    output_expires_s = files.output_expiry_s(body.get("output_expires_after"), deps.settings)
    file_id = body.get("input_file_id")
    record = batches.get_file(file_id, tenant.id) if isinstance(file_id, str) else None
    if record is None or record.purpose != "batch":
        raise ApiError(404, "input_file_id", f"input_file_id: no file {file_id!r} with "
                       "purpose 'batch'", kind="not_found")
    files.check_open_batches(batches, tenant.id, deps.settings)  # 429 quota_exceeded
    # A spent monthly budget: refused here too, not line by line (each line's submit checks
    # it as well, for a budget spent while the batch runs).
    limits.check_budget(tenant, deps.month_usage.get)
    total = len(request_lines(batches.file_content(record.id, tenant.id) or ""))
    lasts = timedelta(seconds=deps.settings.batch_completion_window_s)
    return batches.create_batch(tenant.id, endpoint, lasts, window, record.id, total, meta,
                                output_expires_after_s=output_expires_s)


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64
                       and len(v) <= 512 for k, v in value.items())):
        raise bad("metadata", f"at most {MAX_METADATA} string pairs (keys up to 64 "
                  "characters, values up to 512)")
    return value


def _page(request: Request) -> tuple[str | None, int]:
    raw = request.query_params.get("limit", "20")
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= MAX_LIST):
        raise bad("limit", f"an integer from 1 to {MAX_LIST}")
    after = request.query_params.get("after")
    if after is not None and not BATCH_ID.fullmatch(after):
        raise bad("after", "not a batch id")
    return after, int(raw)


def _batch_id(path_id: str) -> str:
    """The batch a path names; an id no batch can have is a 404 before any lookup."""
    if not BATCH_ID.fullmatch(path_id):
        raise not_found("batch")
    return path_id


def _list(batches: Batches, tenant_id: int, after: str | None,
          limit: int) -> list[BatchRecord]:
    """A page of the tenant's batches. `after` must be one of the tenant's own batches:
    another tenant's id is answered as an unknown one (400 naming `after`, as OpenAI
    answers a cursor it does not know), so a page never tells what others hold."""
    if after is not None and batches.get_batch(after, tenant_id) is None:
        raise bad("after", f"no batch {after!r} (a cursor is the id of one of your batches)")
    return batches.list_batches(tenant_id, after, limit)


def _cancel_batch(batches: Batches, batch_id: str, tenant_id: int) -> BatchRecord:
    record = batches.get_batch(batch_id, tenant_id)
    if record is None:
        raise not_found("batch")
    moved = batches.update_batch(batch_id, expect=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
                                 status=BatchStatus.CANCELLING, cancelling_at=utcnow())
    return moved or record  # it had ended, or was ending: as it is


def batch_json(b: BatchRecord) -> JSONObject:
    def at(value: datetime | None) -> int | None:
        return int(value.timestamp()) if value is not None else None

    errors = None
    if b.errors:
        errors = {"object": "list", "data": b.errors}
    return {"id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": errors,
            "input_file_id": b.input_file_id, "completion_window": b.completion_window,
            "status": b.status, "output_file_id": b.output_file_id,
            "error_file_id": b.error_file_id, "created_at": at(b.created_at),
            "in_progress_at": at(b.in_progress_at), "expires_at": at(b.expires_at),
            "finalizing_at": at(b.finalizing_at), "completed_at": at(b.completed_at),
            "failed_at": at(b.failed_at), "expired_at": at(b.expired_at),
            "cancelling_at": at(b.cancelling_at), "cancelled_at": at(b.cancelled_at),
            "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
            "metadata": b.meta, "model": b.model, "usage": b.usage or _NO_USAGE}


_NO_USAGE: JSONObject = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
             "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}
