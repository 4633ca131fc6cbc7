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
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse

from api.auth import Tenant, authenticate, bearer_key
from api.deps import Deps, EventStream, admit, cancel, check_headers, json_body, lane_rank
from api.openai_api import (
    CANCELLED,
    Answer,
    ChatRequest,
    ChoiceOut,
    CompletionRequest,
    Resolved,
    adapter_names,
    collect,
    finish_reason,
    job_error,
    model_card,
    model_ids,
    models_list,
    openai_reason,
    parse_chat,
    parse_completion,
    resolve,
)
from api.openai_tools import ToolCalls
from api.schemas import JobAccepted
from tidegate import keys
from tidegate.events import Event
from tidegate.records import JobStatus

log = logging.getLogger("tidegate.api")

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files",
                "/v1/batches")
POLL_S = 1.0  # a non-streaming wait looks for its client's disconnect this often
IGNORED_HEADER = "x-tidegate-ignored-fields"  # unknown request fields, ignored (names)
MAX_NAMES, MAX_NAME_CHARS = 16, 64  # of the header's list: a body may hold thousands
# The max_tokens applied because the request set none (also usage.default_max_tokens).
DEFAULT_MAX_TOKENS_HEADER = "x-tidegate-default-max-tokens"


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
        adapters = await asyncio.to_thread(_adapters, deps)
        return JSONResponse(models_list(deps.settings, adapters))

    @app.get("/v1/models/{model:path}", dependencies=checked, include_in_schema=False)
    async def retrieve_model(model: str, request: Request) -> JSONResponse:
        # `:path`: a model id may hold a slash (vLLM serves "org/name").
        await authenticate(deps.store, request)
        adapters = await asyncio.to_thread(_adapters, deps)
        return JSONResponse(model_card(deps.settings, model, adapters))


def _adapters(deps: Deps) -> frozenset[str]:
    """The LoRA adapters a `model` may name (the fleet's heartbeats: a cached read)."""
    return adapter_names(deps.settings, deps.fleet())


async def _complete(deps: Deps, request: Request, tenant: Tenant,
                    req: ChatRequest | CompletionRequest, header_key: str | None) -> Any:
    # The fleet is read only for a `model` that is neither the base model nor a lane.
    adapters = (frozenset() if req.model in model_ids(deps.settings)
                else await asyncio.to_thread(_adapters, deps))
    resolved = resolve(deps.settings, req, tenant.lanes, adapters=adapters)
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
    answer = Answer.of(accepted.job_id, req, resolved.tier, resolved.default_max_tokens)
    headers = {**_headers(accepted.job_id, resolved), **accepted._rate_limits}
    keep = deps.settings.lanes[accepted.lane].keep_on_disconnect
    watch = _Watch(deps, accepted.job_id, tenant.id, keep)
    if give_back is not None:
        return EventStream(_chunks(watch, answer, req.include_usage), give_back, headers,
                           openai=True)
    return JSONResponse(await _whole(watch, request, answer), headers=headers)


def _headers(job_id: str, resolved: Resolved) -> dict[str, str]:
    """The answer's headers: its job, the unknown fields ignored (named in a log line too,
    never their values), the max_tokens applied because the request set none."""
    headers = {"x-request-id": job_id}
    if resolved.ignored:
        names = ignored_names(resolved.ignored)
        headers[IGNORED_HEADER] = names
        log.warning("job %s: ignored unknown request fields: %s", job_id, names,
                    extra={"job_id": job_id})
    if resolved.default_max_tokens is not None:
        headers[DEFAULT_MAX_TOKENS_HEADER] = str(resolved.default_max_tokens)
    return headers


def ignored_names(names: Sequence[str]) -> str:
    """The names as a header value can carry them: a field name is any JSON string (lone
    surrogates and control characters included, which no header may hold), so each is
    percent-encoded and cut at MAX_NAME_CHARS, and at most MAX_NAMES are listed."""
    shown = [quote(name[:MAX_NAME_CHARS].encode("utf-8", "backslashreplace"), safe="._-")
             for name in names[:MAX_NAMES]]
    more = len(names) - len(shown)
    return ",".join(shown) + (f",(+{more} more)" if more > 0 else "")


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
        job = await asyncio.to_thread(self.deps.store.jobs.get_job, self.job_id)
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
    seen: list[Event] = []  # every event, to answer from (choices, logprobs, tool calls)
    try:
        while True:
            events = await watch.events(POLL_S)
            seen += events
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
    row = await asyncio.to_thread(watch.deps.store.jobs.get_job, watch.job_id)
    return _answer(answer, row, seen)


def _answer(answer: Answer, row: Any, events: list[Event]) -> dict[str, Any]:
    """The answer from the job's events (every choice, logprobs, tool calls) when they are
    all there, else from its row (choice 0's text alone)."""
    failed = _row_error(row) or _event_error(events)
    if failed is not None:
        raise job_error(failed)
    choices = collect(events, answer.n)
    if choices is None:
        if answer.n > 1:  # the row keeps choice 0 alone: no answer that drops the others
            raise job_error({"code": "events_lost", "message": "the job's events were lost "
                             "before its choices were read; retry it"})
        choices = [ChoiceOut(index=0, text=row.output_text or "",
                             finish_reason=row.finish_reason)]
    return answer.whole(choices, _done_of(row))


def _row_error(row: Any) -> dict[str, Any] | None:
    """An ended job's error as its event's data: expired, failed or cancelled (None: done)."""
    if row.status == JobStatus.CANCELLED:
        return {"code": CANCELLED, "message": "the job was cancelled before it ended "
                "(DELETE /v1/jobs/{id})"}
    if row.status in (JobStatus.ERROR, JobStatus.EXPIRED):
        code = "deadline_exceeded" if row.status == JobStatus.EXPIRED else "job_failed"
        return {"code": code, "message": row.error or "the job failed"}
    return None


def _event_error(events: list[Event]) -> dict[str, Any] | None:
    """A cancelled job's end as its terminal event tells it, as the streamed answer reads
    it (`_ending`): the row read just after may not show the cancel yet."""
    end = next((e for e in reversed(events) if e.terminal), None)
    if end is not None and end.kind == "done" and end.data.get("finish_reason") == "cancelled":
        return {"code": CANCELLED, "message": "the job was cancelled before it ended "
                "(DELETE /v1/jobs/{id})"}
    return None


def _done_of(row: Any) -> dict[str, Any]:
    """A `done` event's data, from a job's row."""
    return {"finish_reason": row.finish_reason,
            "usage": {"prompt_tokens": row.prompt_tokens,
                      "completion_tokens": row.completion_tokens or 0,
                      "cached_tokens": row.cached_tokens}}


async def _chunks(watch: _Watch, answer: Answer, include_usage: bool) -> AsyncIterator[bytes]:
    """OpenAI's chunks from the job's events; an error as a chunk holding `error` (the SDK
    raises it); `[DONE]` after the end."""
    if answer.chat:  # OpenAI's first chunk of each choice: the role, no text yet
        for index in range(answer.n):
            yield _frame(answer.chunk(first=True, index=index))
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
    calls = answer.tool_calls()
    fan = _Fanout(answer)
    while True:
        events = await watch.events(keepalive_s)
        if not events:
            row = await watch.ended_row()
            if row is None:
                yield b": keep-alive\n\n", None
                continue
            yield _row_ending(answer, row, "".join(streamed), calls)
            return
        out = bytearray()
        for event in events:
            if event.kind == "token":
                streamed.append(event.text)
                out += _token_frames(answer, calls, fan, event)
                continue
            ending = _ending(answer, calls, fan, event)
            if ending is not None:
                yield bytes(out) + ending[0], ending[1]
                return
        if out:
            yield bytes(out), None


def _token_frames(answer: Answer, calls: ToolCalls, fan: _Fanout, event: Event) -> bytes:
    if "choices" in event.data:  # n > 1
        return fan.frames(event.data["choices"])
    return _token_frame(answer, calls, event.text, event.data.get("tool_calls"),
                        fan.logprobs(0, event.text, event.data.get("logprobs")))


def _ending(answer: Answer, calls: ToolCalls, fan: _Fanout,
            event: Event) -> tuple[bytes, dict[str, Any]] | None:
    """A terminal event's frames and the end's data (None for another event). A cancelled
    job ends in an error chunk: its answer is not whole, and says so."""
    if event.kind == "done" and event.data.get("finish_reason") == "cancelled":
        data = {"code": CANCELLED, "message": "the job was cancelled before it ended"}
        return _error_frame(data), {"error": data}
    if event.kind == "done":
        frames = fan.ends(event.data) if answer.n > 1 else _end_frames(answer, calls,
                                                                       event.data)
        return frames, event.data
    if event.kind == "error":
        return _error_frame(event.data), {"error": event.data}
    return None


def _row_ending(answer: Answer, row: Any, streamed: str,
                calls: ToolCalls) -> tuple[bytes, dict[str, Any]]:
    """The end of a stream whose events are gone, from the job's row: the text not streamed
    yet, then the end."""
    data = _row_error(row)
    if data is None and answer.n > 1:  # the row keeps choice 0 alone
        data = {"code": "events_lost", "message": "the job's events were lost before its "
                "choices were streamed"}
    if data is not None:
        return _error_frame(data), {"error": data}
    done = _done_of(row)
    rest = (row.output_text or "")[len(streamed):]
    out = _token_frame(answer, calls, rest, None) if rest else b""
    return out + _end_frames(answer, calls, done), done


def _token_frame(answer: Answer, calls: ToolCalls, text: str,
                 worker_calls: list[dict[str, Any]] | None,
                 logprobs: dict[str, Any] | None = None) -> bytes:
    """A token event's chunk: its text (and its tokens' logprobs: `_Fanout.logprobs`), or,
    where the request reads tool calls, the content and tool-call deltas it makes
    (api/openai_tools.py); b"" for nothing to send."""
    if not calls.active:
        return _frame(answer.chunk(text, **(logprobs or {}))) if text or logprobs else b""
    content, deltas = calls.stream(text, worker_calls or [])
    if not content and not deltas:
        return b""
    return _frame(answer.chunk(content or None, tool_calls=deltas))


def _end_frames(answer: Answer, calls: ToolCalls, done: dict[str, Any]) -> bytes:
    """The end's chunks: tool calls held to the end (required), then the finish reason
    (tool_calls where calls were made, as OpenAI says it)."""
    if not calls.active:
        return _frame(answer.chunk(done=done))
    out = b""
    held = calls.stream_end()
    if held:
        out += _frame(answer.chunk(tool_calls=held))
    unsent = calls.unsent_text()
    if unsent:
        out += _frame(answer.chunk(unsent))
    reason = calls.finish_reason(finish_reason(done), calls.streamed_any())
    return out + _frame(answer.chunk(done=done, reason=reason))


class _Fanout:
    """A stream's choices (n > 1: a chunk per choice's new text, its end when it ends, as
    OpenAI streams them), and each choice's text so far (a text completion's logprobs
    count their offsets from it)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.offsets = [0] * answer.n
        self.ended: set[int] = set()

    def logprobs(self, index: int, text: str, entries: list[Any] | None) -> dict[str, Any]:
        """The chunk's logprobs arguments for `text`, and the choice's offset moved on."""
        offset = self.offsets[index]
        self.offsets[index] += len(text)
        return {} if entries is None else {"logprobs": entries, "offset": offset}

    def frames(self, parts: list[dict[str, Any]]) -> bytes:
        out = b""
        for part in parts:
            index = part["index"]
            if not 0 <= index < self.answer.n:
                continue
            if part["text"] or part.get("logprobs"):
                extra = self.logprobs(index, part["text"], part.get("logprobs"))
                out += _frame(self.answer.chunk(part["text"], index=index, **extra))
            if part.get("finish_reason") and index not in self.ended:
                self.ended.add(index)
                out += _frame(self.answer.chunk(reason=openai_reason(part["finish_reason"]),
                                                index=index))
        return out

    def ends(self, done: dict[str, Any]) -> bytes:
        """The end of every choice not ended yet (done's finish reason)."""
        return b"".join(_frame(self.answer.chunk(done=done, index=i))
                        for i in range(self.answer.n) if i not in self.ended)


def _frame(body: dict[str, Any]) -> bytes:
    return b"data: %s\n\n" % json.dumps(body, ensure_ascii=False,
                                          separators=(",", ":")).encode()


def _error_frame(data: dict[str, Any]) -> bytes:
    error = job_error(data)
    return _frame({"error": {"message": error.message, "type": "server_error", "param": None,
                             "code": error.kind}})

