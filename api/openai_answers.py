"""The OpenAI-compatible routes' answers, as plain code: a completion (whole, or as
streamed chunks) built from a job's events or its row, usage, logprobs, and errors in
OpenAI's shape. HTTP is api/openai_routes.py; the requests, api/openai_models.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict, cast

from api.errors import ApiError
from api.openai_models import ChatRequest, CompletionRequest
from api.openai_tools import Tool, ToolCalls, ToolChoice
from store import JobRecord
from tidegate.events import Event
from tidegate.jsontypes import JSON, JSONObject

# A token's logprobs as a worker writes them in its event: [token, logprob,
# [[alternative, logprob], ...]] (a JSON array of three, read by unpacking).
Logprob = tuple[str, float, list[tuple[str, float]]]


class TokenData(TypedDict, total=False):
    """A `token` event's data (tidegate/events.py), or one choice's part of it (n > 1),
    as an answer reads it."""

    index: int  # the choice (a part's)
    text: str  # a part's text (a whole event's is Event.text)
    logprobs: list[Logprob] | None
    finish_reason: str | None  # a choice that ended before the others
    tool_calls: list[JSONObject] | None  # the worker's parsed deltas
    choices: list[TokenData]  # n > 1: a part per choice


class TokenUsage(TypedDict, total=False):
    """A `done` event's usage."""

    prompt_tokens: int | None
    completion_tokens: int | None  # every choice's
    cached_tokens: int | None


class EndData(TypedDict, total=False):
    """How a job's events ended, as an answer reads it: a `done` event's data (its
    finish_reason and usage), or `error`, an `error` event's data (code, message)."""

    finish_reason: str | None
    usage: TokenUsage
    error: Mapping[str, JSON]


def done_of(row: JobRecord) -> EndData:
    """A `done` event's data, from a job's row."""
    return {"finish_reason": row.finish_reason,
            "usage": {"prompt_tokens": row.prompt_tokens,
                      "completion_tokens": row.completion_tokens or 0,
                      "cached_tokens": row.cached_tokens}}


def token_data(event: Event) -> TokenData:
    """A token event's data as its worker wrote it (Event keeps it a plain dict)."""
    return cast(TokenData, event.data)


def end_data(event: Event) -> EndData:
    """A terminal event's data as its worker wrote it."""
    return cast(EndData, event.data)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def error_body(exc: ApiError) -> tuple[int, JSONObject]:
    """An ApiError in OpenAI's shape and status codes: a request OpenAI calls bad is a 400
    (tidegate's jobs API answers 422 where the value has the right shape)."""
    status = 400 if exc.status == 422 else exc.status
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if exc.kind == "quota_exceeded":
        kind = "insufficient_quota"  # OpenAI's type for a spent budget (429 too)
    code = {401: "invalid_api_key"}.get(status, exc.kind)
    return status, {"error": {"message": exc.message, "type": kind, "param": exc.field,
                              "code": code}}


def usage(done: EndData, default_max_tokens: int | None = None) -> JSONObject:
    """OpenAI's usage object from a job's `done` event data (its completion tokens count
    every choice). `default_max_tokens`: the limit applied because the request set none,
    stated beside (tidegate's field: a `length` finish under it is the default's cut)."""
    got = done.get("usage") or {}
    prompt, completion = got.get("prompt_tokens") or 0, got.get("completion_tokens") or 0
    out: JSONObject = {"prompt_tokens": prompt, "completion_tokens": completion,
                       "total_tokens": prompt + completion,
                       "prompt_tokens_details": {"cached_tokens": got.get("cached_tokens") or 0}}
    if default_max_tokens is not None:
        out["default_max_tokens"] = default_max_tokens
    return out


def finish_reason(done: EndData) -> str:
    """The job's finish reason as OpenAI's."""
    return openai_reason(done.get("finish_reason"))


def openai_reason(reason: str | None) -> str:
    """An engine's reason (stop, length) as OpenAI's; anything else (abort) stops. A
    cancelled job never gets here: it is an error (`job_error`)."""
    return reason if reason in ("stop", "length") else "stop"


@dataclass
class ChoiceOut:
    """One choice of an answer, gathered from the job's events (or its row)."""

    index: int
    text: str = ""
    finish_reason: str | None = None  # the engine's
    logprobs: list[Logprob] | None = None  # the events'
    tool_calls: list[JSONObject] = field(default_factory=list)  # the worker's deltas

    def add(self, text: str, data: TokenData) -> None:
        self.text += text
        logprobs = data.get("logprobs")
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(logprobs)
        if data.get("finish_reason"):
            self.finish_reason = data["finish_reason"]
        self.tool_calls += data.get("tool_calls") or []


def collect(events: list[Event], n: int) -> list[ChoiceOut] | None:
    """The choices a job's events make, or None when the events are not all there (from
    seq 0 to the terminal one, none missing): the answer then comes from the row."""
    if not events or not events[-1].terminal or [e.seq for e in events] != list(
            range(len(events))):
        return None
    choices = [ChoiceOut(index=i) for i in range(n)]
    for event in events:
        if event.kind != "token":
            continue
        for part in event.data.get("choices") or ():
            if 0 <= part["index"] < n:
                choices[part["index"]].add(part["text"], part)
        if "choices" not in event.data:
            choices[0].add(event.text, token_data(event))
    reason = events[-1].data.get("finish_reason")
    for choice in choices:
        choice.finish_reason = choice.finish_reason or reason
    return choices


def chat_logprobs(entries: list[Logprob]) -> JSONObject:
    """The events' logprobs as a chat choice's `logprobs` (OpenAI's shape)."""
    def one(token: str, logprob: float) -> JSONObject:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in alts]}
                        for token, lp, alts in entries], "refusal": None}


def text_logprobs(entries: list[Logprob], offset: int = 0) -> JSONObject:
    """The events' logprobs as a text completion choice's legacy `logprobs`; `offset`: the
    choice's text before these tokens (their `text_offset`s follow it)."""
    offsets: list[int] = []
    for token, _, _ in entries:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [dict((t, v) for t, v in e[2]) for e in entries],
            "text_offset": offsets}


@dataclass(frozen=True)
class Answer:
    """What one completion's answers share: its id, model and tier."""

    id: str
    model: str
    tier: str
    chat: bool
    created: int = 0
    # The request's tools and tool_choice: how its tool calls are read (api/openai_tools.py).
    tooling: tuple[list[Tool] | None, ToolChoice | None] = (None, None)
    n: int = 1  # choices
    default_max_tokens: int | None = None  # Resolved.default_max_tokens

    @classmethod
    def of(cls, job_id: str, req: ChatRequest | CompletionRequest, tier: str,
           default_max_tokens: int | None = None) -> Answer:
        chat = isinstance(req, ChatRequest)
        tooling = (req.tools, req.tool_choice) if isinstance(req, ChatRequest) else (None, None)
        return cls(id=("chatcmpl-" if chat else "cmpl-") + job_id, model=req.model, tier=tier,
                   chat=chat, created=int(time.time()), tooling=tooling, n=req.n or 1,
                   default_max_tokens=default_max_tokens)

    def tool_calls(self) -> ToolCalls:
        """A fresh reader of this answer's tool calls (one per stream)."""
        return ToolCalls.of(*self.tooling)

    def _head(self, obj: str) -> JSONObject:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "service_tier": self.tier, "system_fingerprint": None}

    def usage(self, done: EndData) -> JSONObject:
        return usage(done, self.default_max_tokens)

    def whole(self, choices: list[ChoiceOut] | str, done: EndData) -> JSONObject:
        """The non-streaming answer: one entry per choice (`collect`); a text: choice 0's
        alone, as a job's row keeps it."""
        if isinstance(choices, str):
            choices = [ChoiceOut(index=0, text=choices, finish_reason=done.get("finish_reason"))]
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [self._choice(c) for c in choices],
                "usage": self.usage(done)}

    def _choice(self, c: ChoiceOut) -> JSONObject:
        reason = openai_reason(c.finish_reason)
        if not self.chat:
            return {"index": c.index, "text": c.text, "finish_reason": reason,
                    "logprobs": None if c.logprobs is None else text_logprobs(c.logprobs)}
        calls = self.tool_calls()
        message = calls.message(c.text, c.tool_calls)
        reason = calls.finish_reason(reason, bool(message.get("tool_calls")))
        return {"index": c.index, "finish_reason": reason,
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
                "message": {"role": "assistant", **message, "refusal": None}}

    def chunk(self, text: str | None = None, done: EndData | None = None,
              first: bool = False, tool_calls: list[JSONObject] | None = None,
              reason: str | None = None, *, index: int = 0,
              logprobs: list[Logprob] | None = None, offset: int = 0) -> JSONObject:
        """A streamed chunk of choice `index`: new text, its logprobs and tool-call deltas,
        or the end (done's finish reason, or `reason`, no text). `offset`: the choice's
        text so far (a text completion's logprobs count from it)."""
        reason = reason or (finish_reason(done) if done is not None else None)
        if not self.chat:
            return {**self._head("text_completion"),
                    "choices": [{"index": index, "text": text or "", "finish_reason": reason,
                                 "logprobs": None if logprobs is None
                                 else text_logprobs(logprobs, offset)}]}
        delta: JSONObject = {}
        if first:
            delta["role"] = "assistant"
        if text is not None or first:
            delta["content"] = text or ""
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "finish_reason": reason,
                             "logprobs": None if logprobs is None
                             else chat_logprobs(logprobs)}]}

    def usage_chunk(self, done: EndData) -> JSONObject:
        """The last chunk under stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(done)}


CANCELLED = "job_cancelled"  # the code of a cancelled job's error


def job_error(data: Mapping[str, object]) -> ApiError:
    """A job that ended in error, as the error of its completion: a deadline is a 504, a
    job cancelled (DELETE /v1/jobs/{id}, an admin) a 409 (the job's state conflicts with
    an answer: it will never have one; a client error class, so nothing counts it as the
    server's failure), the rest (the engine refused or failed it) a 502; never retried by
    the SDK into a second job without the caller's idempotency key."""
    code = str(data.get("code") or "job_failed")
    status = {"deadline_exceeded": 504, CANCELLED: 409}.get(code, 502)
    return ApiError(status, None, str(data.get("message") or "the job failed"), kind=code,
                    headers={"x-should-retry": "false"})  # the openai SDK's own header
