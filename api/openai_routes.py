"""The OpenAI-compatible front door: POST /v1/chat/completions, POST /v1/completions,
GET /v1/models (the Batch API is api/batches.py). The translation is api/openai_api.py;
here is HTTP: a request is admitted as a job like POST /v1/jobs, then its answer is read
from the job's event stream.

Streaming sends OpenAI's chunks as the job's token events arrive, then `data: [DONE]`. A
client that goes away before the end cancels its job, unless its lane keeps jobs running
(`keep_on_disconnect`). Without streaming, the answer waits for the job's end and is
built from its row. Either way a quiet job is checked against the store once per
keep-alive period, so a job whose events Redis lost still gets its answer.

These routes answer errors in OpenAI's shape (api/app.py `handle_api_error`) and are not
in /openapi.json: OpenAI's own specification describes them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse

from api.auth import Tenant, authenticate, bearer_key
from api.deps import Deps, EventStream, admit, cancel, check_headers, json_body, lane_rank
from api.openai_api import (
    Answer,
    ChatRequest,
    CompletionRequest,
    job_error,
    models_list,
    parse_chat,
    parse_completion,
    resolve,
)
from api.schemas import JobAccepted
from tidegate import keys
from tidegate.events import Event
from tidegate.records import JobStatus

log = logging.getLogger("tidegate.api")

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files",
                "/v1/batches")
POLL_S = 1.0  # a non-streaming wait looks for its client's disconnect this often


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


def install(app: FastAPI, deps: Deps) -> None:
    checked = [Depends(check_headers)]

    @app.post("/v1/chat/completions", dependencies=checked, include_in_schema=False)
    async def chat(request: Request, idempotency_key: str | None = Header(None)) -> Any:
        tenant = await authenticate(deps.store, request)
        return await _complete(deps, request, tenant,
                               parse_chat(await json_body(request, deps)), idempotency_key)

    @app.post("/v1/completions", dependencies=checked, include_in_schema=False)
    async def completions(request: Request, idempotency_key: str | None = Header(None)) -> Any:
        tenant = await authenticate(deps.store, request)
        return await _complete(deps, request, tenant,
                               parse_completion(await json_body(request, deps)),
                               idempotency_key)

    @app.get("/v1/models", dependencies=checked, include_in_schema=False)
    async def models(request: Request) -> JSONResponse:
        await authenticate(deps.store, request)
        return JSONResponse(models_list(deps.settings))


async def _complete(deps: Deps, request: Request, tenant: Tenant,
                    req: ChatRequest | CompletionRequest, header_key: str | None) -> Any:
    resolved = resolve(deps.settings, req, tenant.lanes)
    job = resolved.job
    # A stream's slot first: a stream the caps refuse must leave no job behind.
    give_back = deps.streams.take(tenant.id) if req.stream else None
    try:
        await deps.prompts.loaded()
        accepted: JobAccepted = await deps.admission.run(
            lane_rank(deps, job.lane, job.priority, tenant), admit, deps, bearer_key(request), job,
            header_key)
    except BaseException:
        if give_back is not None:
            give_back()
        raise
    answer = Answer.of(accepted.job_id, req, resolved.tier)
    headers = {"x-request-id": accepted.job_id}
    keep = deps.settings.lanes[accepted.lane].keep_on_disconnect
    watch = _Watch(deps, accepted.job_id, tenant.id, keep)
    if give_back is not None:
        return EventStream(_chunks(watch, answer, req.include_usage), give_back, headers,
                           openai=True)
    return JSONResponse(await _whole(watch, request, answer), headers=headers)


class _Watch:
    """One completion's job: its events as they come, its row when they are quiet, and
    the cancel when its client leaves."""

    def __init__(self, deps: Deps, job_id: str, tenant_id: int, keep: bool) -> None:
        self.deps, self.job_id, self.tenant_id, self.keep = deps, job_id, tenant_id, keep
        self.key = keys.job_events(deps.settings.namespace, job_id)
        self.cursor = "0-0"

    async def events(self, wait_s: float) -> list[Event]:
        """The job's next events, waiting up to `wait_s` for one ([] if none came)."""
        entries = await self.deps.stream_hub.read(self.key, self.cursor, wait_s)
        if not entries:
            return []
        self.cursor = entries[-1][0]
        return [Event.from_json(fields[b"e"]) for _, fields in entries]

    async def ended_row(self) -> Any:
        """The job's row once it has ended (else None)."""
        job = await asyncio.to_thread(self.deps.store.get_job, self.job_id)
        return job if job is not None and job.terminal else None

    def left(self) -> None:
        """The client went away before the end: cancel the job unless its lane keeps it.
        From a `finally` of a task being cancelled: handed to a thread, not awaited."""
        if self.keep:
            return
        log.info("job %s: its client left; cancelling", self.job_id)
        asyncio.get_running_loop().run_in_executor(None, self._cancel)

    def _cancel(self) -> None:
        try:
            cancel(self.deps, self.job_id, self.tenant_id)
        except Exception as exc:  # the reconciler ends it by its deadline
            log.warning("job %s: cancel after disconnect failed (%s)", self.job_id,
                        type(exc).__name__)


async def _whole(watch: _Watch, request: Request, answer: Answer) -> dict[str, Any]:
    """The non-streaming answer: wait for the job's end (its terminal event, or its row
    when the events are quiet), then answer from the row."""
    keepalive_s = watch.deps.settings.sse_keepalive_s
    quiet_since = time.monotonic()
    try:
        while True:
            events = await watch.events(POLL_S)
            if any(e.terminal for e in events):
                break
            if events:
                quiet_since = time.monotonic()
            if await request.is_disconnected():
                watch.left()
                raise asyncio.CancelledError
            if time.monotonic() - quiet_since >= keepalive_s:
                quiet_since = time.monotonic()
                if await watch.ended_row() is not None:
                    break
    except asyncio.CancelledError:
        watch.left()
        raise
    row = await asyncio.to_thread(watch.deps.store.get_job, watch.job_id)
    return _answer_from_row(answer, row)


def _answer_from_row(answer: Answer, row: Any) -> dict[str, Any]:
    if row.status in (JobStatus.ERROR, JobStatus.EXPIRED):
        code = "deadline_exceeded" if row.status == JobStatus.EXPIRED else "job_failed"
        raise job_error({"code": code, "message": row.error})
    return answer.whole(row.output_text or "", _done_of(row))


def _done_of(row: Any) -> dict[str, Any]:
    """A `done` event's data, from a job's row."""
    return {"finish_reason": row.finish_reason,
            "usage": {"prompt_tokens": row.prompt_tokens,
                      "completion_tokens": row.completion_tokens or 0,
                      "cached_tokens": row.cached_tokens}}


async def _chunks(watch: _Watch, answer: Answer, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunks from the job's events; an error as a chunk holding `error` (the SDK
    raises it); `[DONE]` after the end."""
    if answer.chat:  # OpenAI's first chunk: the role, no text yet
        yield _frame(answer.chunk(first=True))
    streamed: list[str] = []
    ended = False
    try:
        async for frames, done in _frames(watch, answer, streamed):
            yield frames
            if done is not None:
                ended = True
                if include_usage and "error" not in done:
                    yield _frame(answer.usage_chunk(done))
                yield b"data: [DONE]\n\n"
                return
    finally:
        if not ended:
            watch.left()


async def _frames(watch: _Watch, answer: Answer,
                  streamed: list[str]) -> AsyncIterator[tuple[bytes, dict[str, Any] | None]]:
    """(frames, the end's data or None) as events come; a keep-alive when they are quiet,
    and the row's ending when the job ended without its events."""
    keepalive_s = watch.deps.settings.sse_keepalive_s
    while True:
        events = await watch.events(keepalive_s)
        if not events:
            row = await watch.ended_row()
            if row is None:
                yield b": keep-alive\n\n", None
                continue
            yield _row_ending(answer, row, "".join(streamed))
            return
        out = bytearray()
        for event in events:
            if event.kind == "token" and event.text:
                streamed.append(event.text)
                out += _frame(answer.chunk(event.text))
            elif event.kind == "done":
                out += _frame(answer.chunk(done=event.data))
                yield bytes(out), event.data
                return
            elif event.kind == "error":
                out += _error_frame(event.data)
                yield bytes(out), {"error": event.data}
                return
        if out:
            yield bytes(out), None


def _row_ending(answer: Answer, row: Any, streamed: str) -> tuple[bytes, dict[str, Any]]:
    """The end of a stream whose events are gone, from the job's row: the text not streamed
    yet, then the end."""
    if row.status in (JobStatus.ERROR, JobStatus.EXPIRED):
        code = "deadline_exceeded" if row.status == JobStatus.EXPIRED else "job_failed"
        data = {"code": code, "message": row.error or "the job failed"}
        return _error_frame(data), {"error": data}
    done = _done_of(row)
    rest = (row.output_text or "")[len(streamed):]
    out = _frame(answer.chunk(rest)) if rest else b""
    return out + _frame(answer.chunk(done=done)), done


def _frame(body: dict[str, Any]) -> bytes:
    return b"data: %s\n\n" % json.dumps(body, ensure_ascii=False,
                                          separators=(",", ":")).encode()


def _error_frame(data: dict[str, Any]) -> bytes:
    error = job_error(data)
    return _frame({"error": {"message": error.message, "type": "server_error", "param": None,
                             "code": error.kind}})

