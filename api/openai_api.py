"""OpenAI's wire format in front of tidegate's jobs, as plain code (no HTTP here; the
routes are api/openai_routes.py).

A chat or text completion request becomes a JobRequest: the same admission, lane queue,
worker and store as POST /v1/jobs. Its lane comes from, in order: tidegate's own `lane`
(through the SDK's `extra_body`), `service_tier` (mapped by the lanes file's
[service_tiers]), `model` naming a lane, and else the `auto` tier.

Every field OpenAI defines is either carried, or refused by name (400, `param` naming it):
never silently dropped. A refused field sent with its neutral value (`n: 1`,
`logprobs: false`, a penalty of 0, null) changes nothing and is let through.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from api.errors import ApiError
from api.schemas import JobRequest, check_text
from tidegate.lanes import Lane
from tidegate.settings import Settings

# Extensions: tidegate's own fields, which the SDK sends through `extra_body`.
EXTENSIONS = ("lane", "priority", "session_id", "deadline_s", "idempotency_key")
# OpenAI's fields tidegate does not implement -> their neutral values, which change nothing.
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "store": (None, False), "metadata": (None, {}), "web_search_options": (None,),
    "verbosity": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,),
}
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "logprobs": (None, 0),
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "suffix": (None, ""),
}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256
DEFAULT_TIER = "auto"
T = TypeVar("T", bound=BaseModel)
OBJECT_CREATED = 1_767_225_600  # 2026-01-01: the `created` of GET /v1/models' entries


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # `developer` is OpenAI's newer name for the system turn.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64)

    @field_validator("content")
    @classmethod
    def _has_text(cls, v: str | list[TextPart]) -> str | list[TextPart]:
        # A turn without text ("", [], empty parts) is refused here, naming
        # messages.<i>.content: the job's own check (schemas.Message) would raise where no
        # handler names the field (a 500 on the route, a dead batch driver before).
        if isinstance(v, list) and not v:
            raise ValueError("at least one text part is required")
        if not _joined(v):
            raise ValueError("holds no text; a message needs some")
        return v

    def as_message(self) -> dict[str, str]:
        """The job's message (checked by JobRequest's Message, inside `_job`)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": _joined(self.content)}


def _joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: bool | None = None  # no obfuscation padding is ever sent


class _Common(BaseModel):
    """What chat and text completions share: sampling, streaming, tidegate's extensions.
    Every field is strict (the models' `strict=True`): pydantic's lax mode would take
    `false` as 0 or 0.0, 0 as `false`, "1" as 1."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    service_tier: str | None = None
    # tidegate's own (extra_body)
    lane: str | None = Field(None, min_length=1, max_length=64)
    priority: int | None = Field(None, ge=0, le=9)
    session_id: str | None = Field(None, min_length=1, max_length=128)
    deadline_s: float | None = Field(None, gt=0)
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)

    @field_validator("temperature", "top_p", "deadline_s")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported: one job gives one completion")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence holds 1 to {MAX_STOP_CHARS} characters")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt, as text."""

    prompt: str | list[str]
    max_tokens: int | None = Field(16, gt=0)  # OpenAI's default for this endpoint

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("one prompt per request (a list of one string)")
        if not (v if isinstance(v, str) else v[0]):
            raise ValueError("the prompt is empty")
        return v

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def token_limit(self) -> int | None:
        return self.max_tokens


@dataclass(frozen=True)
class Resolved:
    """A request's job, and what its answer echoes."""

    job: JobRequest
    tier: str  # the service_tier the answer reports
    param: str  # the field that chose the lane (a 403 names it)


# -- errors ------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def error_body(exc: ApiError) -> tuple[int, dict[str, Any]]:
    """An ApiError in OpenAI's shape and status codes: a request OpenAI calls bad is a 400
    (tidegate's jobs API answers 422 where the value has the right shape)."""
    status = 400 if exc.status == 422 else exc.status
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = {401: "invalid_api_key"}.get(status, exc.kind)
    return status, {"error": {"message": exc.message, "type": kind, "param": exc.field,
                              "code": code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, param, f"{param}: {message}")


# -- parsing -----------------------------------------------------------------------


def parse_chat(body: object) -> ChatRequest:
    return _parse(ChatRequest, CHAT_REFUSED, body)


def parse_completion(body: object) -> CompletionRequest:
    return _parse(CompletionRequest, COMPLETION_REFUSED, body)


def _parse(model: type[T], refused: dict[str, tuple[Any, ...]], body: object) -> T:
    check_text(body)
    if not isinstance(body, dict):
        raise bad("body", "expected a JSON object")
    body = _drop_neutral(body, refused)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc) from None


def _drop_neutral(body: dict[str, Any], refused: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """The body without refused fields at their neutral values; 400 naming one that would
    change the answer, or a field OpenAI does not define."""
    kept = {}
    for name, value in body.items():
        if name in refused:
            if value not in refused[name]:
                raise bad(name, "not supported by tidegate (the README's compatibility "
                          "table lists what is)")
            continue
        kept[name] = value
    return kept


def _field_error(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    param = ".".join(loc) or "body"
    if err["type"] == "extra_forbidden":
        return bad(param, "unknown field (neither OpenAI's nor one of tidegate's extensions: "
                   f"{', '.join(EXTENSIONS)})")
    return bad(param, err["msg"].removeprefix("Value error, "))


# -- lanes ---------------------------------------------------------------------------


def served_model(settings: Settings) -> str:
    """The model's id in the API: its folder's name."""
    return settings.model_path.name


def model_ids(settings: Settings) -> list[str]:
    """What `model` may name: the served model, and each lane by name (a lane alias)."""
    return [served_model(settings), *sorted(settings.lanes)]


def lane_of(settings: Settings, req: _Common) -> tuple[str, str, str]:
    """(lane, service_tier to report, the field that chose it)."""
    tiers = settings.service_tiers
    if req.model not in model_ids(settings):
        raise ApiError(404, "model", f"model: {req.model!r} does not exist; models are "
                       f"{', '.join(model_ids(settings))} (GET /v1/models)",
                       kind="model_not_found")
    if req.service_tier is not None and req.service_tier not in tiers:
        raise bad("service_tier", f"unknown tier {req.service_tier!r}; tiers are "
                  f"{', '.join(sorted(tiers))}")
    if req.lane is not None:
        return req.lane, tier_of(settings, req.lane), "lane"
    if req.service_tier is not None:
        return tiers[req.service_tier], req.service_tier, "service_tier"
    if req.model in settings.lanes:
        return req.model, tier_of(settings, req.model), "model"
    if DEFAULT_TIER not in tiers:
        raise bad("service_tier", f"required: the lanes file maps no {DEFAULT_TIER!r} tier")
    return tiers[DEFAULT_TIER], "default", "service_tier"


def tier_of(settings: Settings, lane: str) -> str:
    """The tier a lane is sold as (its first in the lanes file); else the lane's name."""
    for tier, name in settings.service_tiers.items():
        if name == lane and tier != DEFAULT_TIER:
            return tier
    return lane


def resolve(settings: Settings, req: ChatRequest | CompletionRequest,
            tenant_lanes: frozenset[str]) -> Resolved:
    """The job a completion request makes (its lane checked against the tenant's)."""
    lane_name, tier, param = lane_of(settings, req)
    lane = settings.lanes.get(lane_name)
    if lane is None:
        known = ", ".join(sorted(settings.lanes))
        raise bad("lane", f"unknown lane {lane_name!r}; lanes are {known}")
    if lane_name not in tenant_lanes:
        raise ApiError(403, param, f"{param}: this API key may not use lane {lane_name!r}"
                       + (f" (service tier {tier!r})" if param == "service_tier" else ""),
                       kind="permission_denied")
    common: dict[str, Any] = dict(
        lane=lane_name, priority=req.priority, session_id=req.session_id,
        max_tokens=_max_tokens(lane, req.token_limit()),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        deadline_s=req.deadline_s, idempotency_key=req.idempotency_key, stop=list(req.stops()))
    if isinstance(req, ChatRequest):
        job = _job(messages=[m.as_message() for m in req.messages], **common)
    else:
        job = _job(prompt=req.text(), **common)
    return Resolved(job=job, tier=tier, param=param)


def _max_tokens(lane: Lane, asked: int | None) -> int:
    """The request's limit; without one, the lane's (a chat completion's default is as long
    as the model allows: here, as the lane allows)."""
    return lane.max_output_tokens if asked is None else asked


def _job(**fields: Any) -> JobRequest:
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise _field_error(exc) from None


# -- answers -------------------------------------------------------------------------


def usage(done: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object from a job's `done` event data."""
    got = done.get("usage") or {}
    prompt, completion = got.get("prompt_tokens") or 0, got.get("completion_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": got.get("cached_tokens") or 0}}


def finish_reason(done: dict[str, Any]) -> str:
    """The engine's reason (stop, length) as OpenAI's; a job cancelled stops."""
    reason = done.get("finish_reason") or "stop"
    return reason if reason in ("stop", "length") else "stop"


@dataclass(frozen=True)
class Answer:
    """What one completion's answers share: its id, model and tier."""

    id: str
    model: str
    tier: str
    chat: bool
    created: int = 0

    @classmethod
    def of(cls, job_id: str, req: ChatRequest | CompletionRequest, tier: str) -> Answer:
        chat = isinstance(req, ChatRequest)
        return cls(id=("chatcmpl-" if chat else "cmpl-") + job_id, model=req.model, tier=tier,
                   chat=chat, created=int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "service_tier": self.tier, "system_fingerprint": None}

    def whole(self, text: str, done: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming answer."""
        reason = finish_reason(done)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "finish_reason": reason, "logprobs": None,
                "message": {"role": "assistant", "content": text, "refusal": None}}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(done)}
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(done)}

    def chunk(self, text: str | None = None, done: dict[str, Any] | None = None,
              first: bool = False) -> dict[str, Any]:
        """A streamed chunk: new text, or the end (done's finish reason, no text)."""
        reason = finish_reason(done) if done is not None else None
        if not self.chat:
            return {**self._head("text_completion"),
                    "choices": [{"index": 0, "text": text or "", "finish_reason": reason,
                                 "logprobs": None}]}
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None or first:
            delta["content"] = text or ""
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                             "logprobs": None}]}

    def usage_chunk(self, done: dict[str, Any]) -> dict[str, Any]:
        """The last chunk under stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(done)}


def models_list(settings: Settings) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": OBJECT_CREATED, "owned_by": "tidegate"}
        for name in model_ids(settings)]}


def job_error(data: dict[str, Any]) -> ApiError:
    """A job that ended in error, as the error of its completion: a deadline is a 504, the
    rest (the engine refused or failed it) a 502; never retried by the SDK into a second
    job without the caller's idempotency key."""
    code = str(data.get("code") or "job_failed")
    status = 504 if code == "deadline_exceeded" else 502
    return ApiError(status, None, str(data.get("message") or "the job failed"), kind=code,
                    headers={"x-should-retry": "false"})  # the openai SDK's own header
