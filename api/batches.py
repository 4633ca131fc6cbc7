"""OpenAI's Batch API, on tidegate's queue: files, batches, and the driver that runs them.

    POST /v1/files                  a JSONL input file (multipart, purpose `batch`)
    GET  /v1/files/{id}             its record;  GET /v1/files/{id}/content  its text
    POST /v1/batches                a batch of /v1/chat/completions (or /v1/completions)
    GET  /v1/batches/{id}, GET /v1/batches, POST /v1/batches/{id}/cancel

Each input line becomes a job on the lane of the `flex` service tier (shipped: `batch`,
which runs on chat's workers at the lowest priority and so takes only their spare
capacity), through the same submit as POST /v1/jobs. A batch's state is its row in the
store (store/batches.py); the driver, a task in every API process, advances each open
batch under a Redis lock, so one process at a time does, and any process picks it up
after a restart. It keeps at most `TIDEGATE_BATCH_IN_FLIGHT` of a batch's jobs queued or
running, and backs off when the lane's bounds answer 429 or 503: a batch waits in the
store, never in Redis.

A line that is not a valid request is reported in the batch's error file, with its
`custom_id` and the error the endpoint would have answered; it never stops the batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from api.auth import Tenant, authenticate
from api.deps import Deps, cancel, check_headers, json_body
from api.errors import ApiError, not_found
from api.openai_api import (
    Answer,
    bad,
    error_body,
    job_error,
    parse_chat,
    parse_completion,
    resolve,
)
from api.schemas import check_text
from api.submit import submit
from store import JobRecord, utcnow
from store.batches import Batches, BatchRecord, FileRecord
from tidegate import keys
from tidegate.records import JobStatus

log = logging.getLogger("tidegate.api")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOWS = {"24h": timedelta(hours=24)}
MAX_METADATA = 16  # OpenAI's: keys of a batch's metadata
MAX_LIST = 100
BATCH_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata",
                "output_expires_after")


def install(app: FastAPI, deps: Deps, batches: Batches) -> None:
    hidden: dict[str, Any] = {"dependencies": [Depends(check_headers)],
                              "include_in_schema": False}
    _file_routes(app, deps, batches, hidden)
    _batch_routes(app, deps, batches, hidden)


def _file_routes(app: FastAPI, deps: Deps, batches: Batches, hidden: dict[str, Any]) -> None:
    @app.post("/v1/files", **hidden)
    async def upload(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        purpose, filename, text = await _upload(request, deps)
        record = await asyncio.to_thread(batches.create_file, tenant.id, purpose, filename, text)
        return JSONResponse(file_json(record))

    @app.get("/v1/files/{file_id}", **hidden)
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        record = await asyncio.to_thread(batches.get_file, file_id, tenant.id)
        if record is None:
            raise not_found("file")
        return JSONResponse(file_json(record))

    @app.get("/v1/files/{file_id}/content", **hidden)
    async def file_content(file_id: str, request: Request) -> Response:
        tenant = await authenticate(deps.store, request)
        text = await asyncio.to_thread(batches.file_content, file_id, tenant.id)
        if text is None:
            raise not_found("file")
        return Response(text.encode(), media_type="application/jsonl")


def _batch_routes(app: FastAPI, deps: Deps, batches: Batches, hidden: dict[str, Any]) -> None:
    @app.post("/v1/batches", **hidden)
    async def create(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        body = await json_body(request, deps)
        record = await asyncio.to_thread(_create, deps, batches, tenant, body)
        return JSONResponse(batch_json(record))

    @app.get("/v1/batches/{batch_id}", **hidden)
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        record = await asyncio.to_thread(batches.get_batch, batch_id, tenant.id)
        if record is None:
            raise not_found("batch")
        return JSONResponse(batch_json(record))

    @app.get("/v1/batches", **hidden)
    async def list_batches(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        after, limit = _page(request)
        rows = await asyncio.to_thread(batches.list_batches, tenant.id, after, limit + 1)
        page = rows[:limit]
        return JSONResponse({"object": "list", "data": [batch_json(b) for b in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(rows) > limit})

    @app.post("/v1/batches/{batch_id}/cancel", **hidden)
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        record = await asyncio.to_thread(_cancel_batch, batches, batch_id, tenant.id)
        return JSONResponse(batch_json(record))


# -- files ---------------------------------------------------------------------------


async def _upload(request: Request, deps: Deps) -> tuple[str, str, str]:
    """(purpose, filename, text) of a multipart upload, checked: 400 naming the field."""
    limit = deps.settings.batch_max_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit + 64 * 1024:
        raise ApiError(413, "file", f"file: larger than the limit of {limit} bytes")
    try:
        form = await request.form(max_files=1, max_fields=4)
    except Exception as exc:  # Starlette's multipart errors: the body is not a form
        raise bad("file", f"expected a multipart/form-data body ({type(exc).__name__})") from None
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise bad("purpose", "must be 'batch' (the files API here serves the Batch API)")
    if upload is None or isinstance(upload, str):
        raise bad("file", "a file part is required")
    raw = await upload.read(limit + 1)
    if len(raw) > limit:
        raise ApiError(413, "file", f"file: larger than the limit of {limit} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("file", "not UTF-8 text") from None
    check_text(text, ("file",))
    lines = len(_lines(text))
    if lines == 0:
        raise bad("file", "holds no request lines")
    if lines > deps.settings.batch_max_lines:
        raise bad("file", f"holds {lines} lines; a batch takes at most "
                  f"{deps.settings.batch_max_lines}")
    return purpose, (upload.filename or "batch.jsonl")[:255], text


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def file_json(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes,
            "created_at": int(record.created_at.timestamp()), "filename": record.filename,
            "purpose": record.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


# -- batches -------------------------------------------------------------------------


def _create(deps: Deps, batches: Batches, tenant: Tenant, body: Any) -> BatchRecord:
    if not isinstance(body, dict):
        raise bad("body", "expected a JSON object")
    check_text(body)
    for name in body:
        if name not in BATCH_FIELDS:
            raise bad(name, "unknown field")
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in ENDPOINTS:
        raise bad("endpoint", f"must be one of {', '.join(ENDPOINTS)}")
    if window not in WINDOWS:
        raise bad("completion_window", f"must be one of {', '.join(WINDOWS)}")
    meta = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    record = batches.get_file(file_id, tenant.id) if isinstance(file_id, str) else None
    if record is None or record.purpose != "batch":
        raise ApiError(404, "input_file_id", f"input_file_id: no file {file_id!r} with "
                       "purpose 'batch'", kind="not_found")
    total = len(_lines(batches.file_content(record.id, tenant.id) or ""))
    return batches.create_batch(tenant.id, endpoint, WINDOWS[window], window, record.id,
                                total, meta)


def _metadata(value: Any) -> dict[str, str] | None:
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
    return request.query_params.get("after"), int(raw)


def _cancel_batch(batches: Batches, batch_id: str, tenant_id: int) -> BatchRecord:
    record = batches.get_batch(batch_id, tenant_id)
    if record is None:
        raise not_found("batch")
    moved = batches.update_batch(batch_id, expect=("validating", "in_progress"),
                                 status="cancelling", cancelling_at=utcnow())
    return moved or record  # it had ended, or was ending: as it is


def batch_json(b: BatchRecord) -> dict[str, Any]:
    def at(value: Any) -> int | None:
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
            "metadata": b.meta}


# -- the driver ------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One input line: its custom_id, its request's body, or why it is no request."""

    custom_id: str | None
    body: dict[str, Any] | None
    error: str | None = None


class Driver:
    """Advances every open batch, one pass every `batch_poll_s`, in each API process; a
    Redis lock per batch lets one process at a time take a batch's step."""

    def __init__(self, deps: Deps, batches: Batches) -> None:
        self.deps, self.batches = deps, batches
        self._lines: dict[str, list[Line]] = {}  # parsed input files, by batch
        self.owner = secrets.token_hex(8)

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.pass_once)
            except Exception as exc:  # an outage: the next pass tries again
                log.warning("batch driver: pass failed (%s)", type(exc).__name__)
            await asyncio.sleep(self.deps.settings.batch_poll_s)

    def pass_once(self) -> None:
        for batch in self.batches.open_batches():
            lock = keys.batch_lock(self.deps.settings.namespace, batch.id)
            if not self.deps.sync_redis.set(lock, self.owner, nx=True, ex=keys.BATCH_LOCK_S):
                continue
            try:
                self.step(batch)
            finally:
                if self.deps.sync_redis.get(lock) == self.owner.encode():
                    self.deps.sync_redis.delete(lock)

    def step(self, b: BatchRecord) -> None:
        tenant = self._tenant(b)
        if tenant is None:
            self._end(b, "failed", failed_at=utcnow(), errors=[
                {"code": "tenant_revoked", "message": "the batch's API key was revoked",
                 "param": None, "line": None}])
            return
        if b.status == "validating":
            b = self.batches.update_batch(b.id, expect=("validating",), status="in_progress",
                                          in_progress_at=utcnow()) or b
        if b.status == "in_progress" and utcnow() >= b.expires_at:
            b = self.batches.update_batch(b.id, expect=("in_progress",), status="cancelling",
                                          cancelling_at=utcnow(), expired_at=utcnow()) or b
        lines = self.lines(b)
        jobs = self.batches.line_jobs(b.tenant_id, b.id, b.submitted)
        if b.status == "in_progress":
            b = self._submit_more(b, tenant, lines, jobs)
            jobs = self.batches.line_jobs(b.tenant_id, b.id, b.submitted)
        elif b.status == "cancelling":
            self._cancel_jobs(b, jobs)
        self._progress(b, lines, jobs)

    def _tenant(self, b: BatchRecord) -> Tenant | None:
        record = self.batches.tenant(b.tenant_id)
        if record is None:
            return None
        return Tenant(id=record.id, name=record.name, lanes=frozenset(record.lanes),
                      requests_per_minute=record.requests_per_minute,
                      tokens_per_minute=record.tokens_per_minute,
                      webhook_url=record.webhook_url)

    def lines(self, b: BatchRecord) -> list[Line]:
        if b.id not in self._lines:
            text = self.batches.file_content(b.input_file_id, b.tenant_id) or ""
            self._lines[b.id] = parse_lines(_lines(text), b.endpoint)
        return self._lines[b.id]

    def _submit_more(self, b: BatchRecord, tenant: Tenant, lines: list[Line],
                     jobs: dict[int, JobRecord]) -> BatchRecord:
        """Submit the next lines while the batch has room; stop at the lane's bounds."""
        errors = list(b.line_errors)
        refused = {e["line"] for e in errors}
        running = sum(1 for i, job in jobs.items() if not job.terminal and i not in refused)
        room = self.deps.settings.batch_in_flight - running
        line_no = b.submitted
        while room > 0 and line_no < len(lines):
            try:
                self._submit_line(b, tenant, line_no, lines[line_no])
                room -= 1
            except ApiError as exc:
                if exc.status in (429, 503):  # the lane is full or down: later
                    break
                errors.append(_line_error(line_no, lines[line_no], exc))
            line_no += 1
        if line_no == b.submitted:
            return b
        return self.batches.update_batch(b.id, submitted=line_no, line_errors=errors) or b

    def _submit_line(self, b: BatchRecord, tenant: Tenant, line_no: int, line: Line) -> None:
        if line.error is not None or line.body is None:
            raise bad("line", line.error or "not a request")
        parse = parse_chat if b.endpoint == "/v1/chat/completions" else parse_completion
        req = parse(line.body)
        if req.stream:
            raise bad("stream", "a batch's requests do not stream")
        if req.service_tier not in (None, "flex", "auto"):
            raise bad("service_tier", "a batch's requests run on the 'flex' tier")
        tiers = self.deps.settings.service_tiers
        req = req.model_copy(update={"service_tier": "flex" if "flex" in tiers else None,
                                     "idempotency_key": f"{b.id}:{line_no}"})
        submit(self.deps, tenant, resolve(self.deps.settings, req, tenant.lanes).job, None)

    def _cancel_jobs(self, b: BatchRecord, jobs: dict[int, JobRecord]) -> None:
        for job in jobs.values():
            if not job.terminal:
                cancel(self.deps, job.id, b.tenant_id)

    def _progress(self, b: BatchRecord, lines: list[Line], jobs: dict[int, JobRecord]) -> None:
        refused = {e["line"] for e in b.line_errors}
        done = sum(1 for job in jobs.values() if job.status == JobStatus.DONE)
        failed = len(refused) + sum(1 for i, job in jobs.items()
                                    if job.terminal and job.status != JobStatus.DONE
                                    and i not in refused)
        ended = done + failed == b.submitted and (
            b.status == "cancelling" or b.submitted == len(lines))
        if not ended:
            if (done, failed) != (b.completed, b.failed):
                self.batches.update_batch(b.id, completed=done, failed=failed)
            return
        self._finish(b, lines, jobs, done, failed)

    def _finish(self, b: BatchRecord, lines: list[Line], jobs: dict[int, JobRecord],
                done: int, failed: int) -> None:
        b = self.batches.update_batch(b.id, finalizing_at=utcnow(), completed=done,
                                      failed=failed) or b
        output, errors = build_files(b, lines, jobs)
        out_file = self.batches.create_file(b.tenant_id, "batch_output", f"{b.id}_output.jsonl",
                                            output) if output else None
        err_file = self.batches.create_file(b.tenant_id, "batch_output", f"{b.id}_errors.jsonl",
                                            errors) if errors else None
        if b.status == "cancelling":
            final = ("expired", "expired_at") if b.expired_at else ("cancelled", "cancelled_at")
        else:
            final = ("completed", "completed_at")
        self._end(b, final[0], **{final[1]: utcnow()},
                  output_file_id=out_file.id if out_file else None,
                  error_file_id=err_file.id if err_file else None)

    def _end(self, b: BatchRecord, status: str, **values: Any) -> None:
        self.batches.update_batch(b.id, status=status, **values)
        self._lines.pop(b.id, None)
        log.info("batch %s: %s (%d lines)", b.id, status, b.total)


def parse_lines(raw: list[str], endpoint: str) -> list[Line]:
    """Each line's custom_id and body, or what is wrong with it (checked before any job)."""
    seen: set[str] = set()
    lines = []
    for text in raw:
        try:
            item = json.loads(text)
        except ValueError:
            lines.append(Line(None, None, "not valid JSON"))
            continue
        lines.append(_line(item, endpoint, seen))
    return lines


def _line(item: Any, endpoint: str, seen: set[str]) -> Line:
    if not isinstance(item, dict):
        return Line(None, None, "not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(None, None, "custom_id: a non-empty string is required")
    if custom_id in seen:
        return Line(custom_id, None, f"custom_id: {custom_id!r} is used by an earlier line")
    seen.add(custom_id)
    if item.get("method") != "POST":
        return Line(custom_id, None, "method: must be 'POST'")
    if item.get("url") != endpoint:
        return Line(custom_id, None, f"url: must be the batch's endpoint, {endpoint}")
    body = item.get("body")
    if not isinstance(body, dict):
        return Line(custom_id, None, "body: a JSON object is required")
    return Line(custom_id, body)


def _line_error(line_no: int, line: Line, exc: ApiError) -> dict[str, Any]:
    status, body = error_body(exc)
    return {"line": line_no, "custom_id": line.custom_id, "status_code": status, "body": body}


def build_files(b: BatchRecord, lines: list[Line],
                jobs: dict[int, JobRecord]) -> tuple[str, str]:
    """The output file (a line per request answered) and the error file (a line per
    request refused or failed), in OpenAI's line format."""
    output: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    refused = {e["line"]: e for e in b.line_errors}
    for i in range(b.submitted):
        line = lines[i]
        if i in refused:
            e = refused[i]
            errors.append({"id": f"batch_req_{b.id}_{i}", "custom_id": line.custom_id,
                           "response": {"status_code": e["status_code"], "request_id": None,
                                        "body": e["body"]}, "error": None})
            continue
        job = jobs.get(i)
        if job is None:
            continue
        entry = _job_line(b, line, job)
        (output if job.status == JobStatus.DONE else errors).append(entry)
    return _jsonl(output), _jsonl(errors)


def _job_line(b: BatchRecord, line: Line, job: JobRecord) -> dict[str, Any]:
    model = str((line.body or {}).get("model", ""))
    chat = b.endpoint == "/v1/chat/completions"
    head = {"id": f"batch_req_{job.id}", "custom_id": line.custom_id, "error": None}
    if job.status == JobStatus.DONE:
        answer = Answer(id=("chatcmpl-" if chat else "cmpl-") + job.id, model=model,
                        tier="flex", chat=chat, created=int(job.enqueued_at.timestamp()))
        done = {"finish_reason": job.finish_reason,
                "usage": {"prompt_tokens": job.prompt_tokens,
                          "completion_tokens": job.completion_tokens or 0,
                          "cached_tokens": job.cached_tokens}}
        body = answer.whole(job.output_text or "", done)
        return {**head, "response": {"status_code": 200, "request_id": job.id, "body": body}}
    if job.status == JobStatus.CANCELLED:
        error = ApiError(499, None, "the batch was cancelled before this request ended",
                         kind="batch_cancelled")
    else:
        error = job_error({"code": "deadline_exceeded" if job.status == JobStatus.EXPIRED
                           else "job_failed", "message": job.error})
    status, body = error_body(error)
    return {**head, "response": {"status_code": status, "request_id": job.id, "body": body}}


def _jsonl(items: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
