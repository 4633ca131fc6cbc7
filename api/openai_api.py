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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from api.errors import ApiError
from api.openai_tools import ResponseFormat, Tool, ToolCalls, ToolChoice
from api.schemas import MAX_LOGPROBS, MAX_N, JobRequest, check_text
from tidegate import capabilities as cap
from tidegate.events import Event
from tidegate.lanes import Lane
from tidegate.router import WorkerView
from tidegate.settings import Settings

# Extensions: tidegate's own fields, which the SDK sends through `extra_body`.
EXTENSIONS = ("lane", "priority", "session_id", "deadline_s", "idempotency_key")
# OpenAI's fields tidegate does not implement -> their neutral values, which change nothing.
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "store": (None, False), "metadata": (None, {}), "web_search_options": (None,),
    "verbosity": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,),
}
COMPLETION_REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256
DEFAULT_TIER = "auto"
T = TypeVar("T", bound=BaseModel)
OBJECT_CREATED = 1_767_225_600  # 2026-01-01: the `created` of GET /v1/models' entries


# Content parts that need an engine capability no lane of tidegate's has: the part's type
# -> the capability (tidegate/capabilities.py) named in the 400.
MEDIA_PARTS = {"image_url": cap.VISION, "input_image": cap.VISION, "input_audio": cap.AUDIO,
               "file": cap.VISION}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    # `refusal`: an assistant turn's refusal, sent back as a part (its text, as text).
    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def value(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class ChatMessage(BaseModel):
    """A turn as the official client sends it, including an assistant message sent back
    as the answer gave it (`messages.append(resp.choices[0].message)`): its `refusal`,
    `annotations`, `audio` and `function_call` (null, or nothing tidegate reads) are
    accepted; `tool_calls` are carried to the chat template, as a `tool` turn's
    `tool_call_id`."""

    model_config = ConfigDict(extra="allow", strict=True)

    # `developer` is OpenAI's newer name for the system turn.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    annotations: list[Any] | None = None  # url citations of a search model's answer
    audio: dict[str, Any] | None = None  # an audio answer's id; no engine here makes one
    function_call: dict[str, Any] | None = None  # deprecated; answers never hold one

    def check(self, at: str) -> None:
        """400 naming `<at>.content` for a turn without text ("", [], empty parts): the
        job's own check (schemas.Message) would raise where no handler names the field (a
        500 on the route, a dead batch driver before). An assistant turn of tool calls
        alone has none."""
        if self.role == "tool" and self.tool_call_id is None:
            raise bad(f"{at}.tool_call_id", "required in a tool turn (the call it answers)")
        if self.role == "assistant" and self.tool_calls:
            return
        if isinstance(self.content, list) and not self.content:
            raise bad(f"{at}.content", "at least one text part is required")
        if not _joined(self.content):
            raise bad(f"{at}.content", "holds no text; a message needs some")

    def as_message(self) -> dict[str, Any]:
        """The job's message (checked by JobRequest's Message, inside `_job`)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": _joined(self.content) or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _joined(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.value for part in content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: bool | None = None  # no obfuscation padding is ever sent


class _Common(BaseModel):
    """What chat and text completions share: sampling, streaming, tidegate's extensions.
    Every field is strict (the models' `strict=True`): pydantic's lax mode would take
    `false` as 0 or 0.0, 0 as `false`, "1" as 1."""

    # Unknown fields are kept aside (`ignored`), not refused: as vLLM's server does.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float | int] | None = None  # checked by JobRequest
    # vLLM's extras, in the body as vLLM's server takes them (the SDK's extra_body).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
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

    def sampling(self) -> dict[str, Any]:
        """The job's sampling beyond the plain fields (JobRequest checks the values)."""
        bias = None if self.logit_bias is None else {
            k: float(v) for k, v in self.logit_bias.items()}
        return {"n": self.n or 1, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "logit_bias": bias,
                "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "logprobs": self.logprobs_asked()}

    def logprobs_asked(self) -> int | None:
        return None

    def ignored(self) -> list[str]:
        """Fields neither OpenAI's, vLLM's nor tidegate's: ignored as vLLM's server ignores
        them (their names in a header and a log line; a lane may refuse them)."""
        return sorted(self.model_extra or {})


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    # Structured output and tool calling (api/openai_tools.py).
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    # logprobs: of each output token; top_logprobs: that many alternatives too (0-20).
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "requires logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def ignored(self) -> list[str]:
        inner = [f"messages.{i}.{name}" for i, m in enumerate(self.messages)
                 for name in sorted(m.model_extra or {})]
        inner += [f"messages.{i}.content.{j}.{name}" for i, m in enumerate(self.messages)
                  if isinstance(m.content, list) for j, part in enumerate(m.content)
                  for name in sorted(part.model_extra or {})]
        return super().ignored() + inner


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt, as text."""

    prompt: str | list[str]
    max_tokens: int | None = Field(16, gt=0)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token

    def logprobs_asked(self) -> int | None:
        return self.logprobs

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
    # The max_tokens applied because the request set none (the lane's, or OpenAI's 16 for
    # text completions): stated in the answer's usage and a header. None: the request's.
    default_max_tokens: int | None = None
    ignored: tuple[str, ...] = ()  # unknown fields, ignored (ChatRequest.ignored)


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
    if exc.kind == "quota_exceeded":
        kind = "insufficient_quota"  # OpenAI's type for a spent budget (429 too)
    code = {401: "invalid_api_key"}.get(status, exc.kind)
    return status, {"error": {"message": exc.message, "type": kind, "param": exc.field,
                              "code": code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, param, f"{param}: {message}")


# -- parsing -----------------------------------------------------------------------


def parse_chat(body: object) -> ChatRequest:
    _refuse_media(body)
    req = _parse(ChatRequest, CHAT_REFUSED, body)
    for i, message in enumerate(req.messages):
        message.check(f"messages.{i}")
    return req


def _refuse_media(body: object) -> None:
    """Image, audio and file parts: a 400 naming the part and the capability it needs
    (no engine of tidegate's has one yet), before the model would call them malformed."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in MEDIA_PARTS:  # `type` may be any JSON
                raise bad(f"messages.{i}.content.{j}", f"a {kind!r} part needs an engine "
                          f"with the {MEDIA_PARTS[kind]!r} capability, which no lane of "
                          "this server has; send text parts")


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
                raise bad(name, "not supported by tidegate (docs/openai.md lists what "
                          "is)")
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


def model_ids(settings: Settings, adapters: Iterable[str] = ()) -> list[str]:
    """What `model` may name: the served model, each lane by name (a lane alias), and
    each LoRA adapter served (`adapter_names`)."""
    base = [served_model(settings), *sorted(settings.lanes)]
    return [*base, *sorted(set(adapters) - set(base))]


def adapter_names(settings: Settings, fleet: Iterable[WorkerView]) -> frozenset[str]:
    """The LoRA adapters `model` may name: those of this process's TIDEGATE_LORA_ADAPTERS
    and those the live workers' heartbeats advertise (a worker-side setting)."""
    names = {name for name, _ in settings.lora}
    for worker in fleet:
        names |= worker.lora
    return frozenset(names)


def model_not_found(settings: Settings, model: str, adapters: Iterable[str]) -> ApiError:
    known = ", ".join(model_ids(settings, adapters))
    return ApiError(404, "model", f"model: {model!r} does not exist; models are {known} "
                    "(GET /v1/models)", kind="model_not_found")


def lane_of(settings: Settings, req: _Common,
            adapters: frozenset[str] = frozenset()) -> tuple[str, str, str]:
    """(lane, service_tier to report, the field that chose it)."""
    tiers = settings.service_tiers
    if req.model not in model_ids(settings, adapters):
        raise model_not_found(settings, req.model, adapters)
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
            tenant_lanes: frozenset[str], adapters: frozenset[str] = frozenset()) -> Resolved:
    """The job a completion request makes (its lane checked against the tenant's). A
    `model` naming a LoRA adapter (one of `adapters`) is the job's `lora`, on the lane the
    other fields choose, as for the base model; the router sends it to a worker serving
    the adapter."""
    lane_name, tier, param = lane_of(settings, req, adapters)
    lane = settings.lanes.get(lane_name)
    if lane is None:
        known = ", ".join(sorted(settings.lanes))
        raise bad("lane", f"unknown lane {lane_name!r}; lanes are {known}")
    if lane_name not in tenant_lanes:
        raise ApiError(403, param, f"{param}: this API key may not use lane {lane_name!r}"
                       + (f" (service tier {tier!r})" if param == "service_tier" else ""),
                       kind="permission_denied")
    ignored = req.ignored()
    if ignored and lane.strict_fields:
        raise bad(ignored[0], f"unknown field (neither OpenAI's, vLLM's nor one of tidegate's "
                  f"extensions: {', '.join(EXTENSIONS)}); lane {lane_name!r} refuses unknown "
                  "fields (strict_fields)")
    common: dict[str, Any] = dict(
        lane=lane_name, priority=req.priority, session_id=req.session_id,
        max_tokens=_max_tokens(lane, req.token_limit()),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        deadline_s=req.deadline_s, idempotency_key=req.idempotency_key, stop=list(req.stops()),
        lora=_lora_of(settings, req.model, adapters), **req.sampling())
    if isinstance(req, ChatRequest):
        job = _job(messages=[m.as_message() for m in req.messages],
                   response_format=req.response_format, tools=req.tools,
                   tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                   **common)
    else:
        job = _job(prompt=req.text(), **common)
    return Resolved(job=job, tier=tier, param=param,
                    default_max_tokens=_defaulted(req, job.max_tokens), ignored=tuple(ignored))


def _defaulted(req: ChatRequest | CompletionRequest, applied: int) -> int | None:
    """The limit applied when the request set none (else None)."""
    named = {"max_tokens", "max_completion_tokens"} & req.model_fields_set
    return None if named and req.token_limit() is not None else applied


def _lora_of(settings: Settings, model: str, adapters: frozenset[str]) -> str | None:
    """The adapter `model` names; None for the base model or a lane alias (they win a
    clash: an adapter named like a lane is reached through the jobs API's `lora`)."""
    base = {served_model(settings), *settings.lanes}
    return model if model in adapters and model not in base else None


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


def usage(done: dict[str, Any], default_max_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object from a job's `done` event data (its completion tokens count
    every choice). `default_max_tokens`: the limit applied because the request set none,
    stated beside (tidegate's field: a `length` finish under it is the default's cut)."""
    got = done.get("usage") or {}
    prompt, completion = got.get("prompt_tokens") or 0, got.get("completion_tokens") or 0
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": got.get("cached_tokens") or 0}}
    if default_max_tokens is not None:
        out["default_max_tokens"] = default_max_tokens
    return out


def finish_reason(done: dict[str, Any]) -> str:
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
    logprobs: list[Any] | None = None  # the events' [token, logprob, [[alt, logprob]...]]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the worker's deltas

    def add(self, text: str, data: dict[str, Any]) -> None:
        self.text += text
        if data.get("logprobs") is not None:
            self.logprobs = (self.logprobs or []) + list(data["logprobs"])
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
            choices[0].add(event.text, event.data)
    reason = events[-1].data.get("finish_reason")
    for choice in choices:
        choice.finish_reason = choice.finish_reason or reason
    return choices


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    """The events' logprobs as a chat choice's `logprobs` (OpenAI's shape)."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**one(token, lp), "top_logprobs": [one(t, v) for t, v in alts]}
                        for token, lp, alts in entries], "refusal": None}


def text_logprobs(entries: list[Any], offset: int = 0) -> dict[str, Any]:
    """The events' logprobs as a text completion choice's legacy `logprobs`; `offset`: the
    choice's text before these tokens (their `text_offset`s follow it)."""
    offsets = []
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
    tooling: tuple[Any, Any] = (None, None)
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

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "service_tier": self.tier, "system_fingerprint": None}

    def usage(self, done: dict[str, Any]) -> dict[str, Any]:
        return usage(done, self.default_max_tokens)

    def whole(self, choices: list[ChoiceOut] | str, done: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming answer: one entry per choice (`collect`); a text: choice 0's
        alone, as a job's row keeps it."""
        if isinstance(choices, str):
            choices = [ChoiceOut(index=0, text=choices, finish_reason=done.get("finish_reason"))]
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [self._choice(c) for c in choices],
                "usage": self.usage(done)}

    def _choice(self, c: ChoiceOut) -> dict[str, Any]:
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

    def chunk(self, text: str | None = None, done: dict[str, Any] | None = None,
              first: bool = False, tool_calls: list[dict[str, Any]] | None = None,
              reason: str | None = None, *, index: int = 0,
              logprobs: list[Any] | None = None, offset: int = 0) -> dict[str, Any]:
        """A streamed chunk of choice `index`: new text, its logprobs and tool-call deltas,
        or the end (done's finish reason, or `reason`, no text). `offset`: the choice's
        text so far (a text completion's logprobs count from it)."""
        reason = reason or (finish_reason(done) if done is not None else None)
        if not self.chat:
            return {**self._head("text_completion"),
                    "choices": [{"index": index, "text": text or "", "finish_reason": reason,
                                 "logprobs": None if logprobs is None
                                 else text_logprobs(logprobs, offset)}]}
        delta: dict[str, Any] = {}
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

    def usage_chunk(self, done: dict[str, Any]) -> dict[str, Any]:
        """The last chunk under stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(done)}


def models_list(settings: Settings, adapters: Iterable[str] = ()) -> dict[str, Any]:
    """GET /v1/models: the served model, the lanes as its aliases, the LoRA adapters (as
    vLLM's server lists them: `parent` the base model)."""
    return {"object": "list", "data": [model_card(settings, name, adapters)
                                       for name in model_ids(settings, adapters)]}


def model_card(settings: Settings, model_id: str, adapters: Iterable[str] = ()) -> dict[str, Any]:
    """One model's entry (GET /v1/models/{id}); 404 `model_not_found` for an unknown id.
    `root` is the base model for every entry (vLLM's is a path: not shown here); `parent`
    is the base model for an adapter, null for the base model and its lane aliases."""
    if model_id not in model_ids(settings, adapters):
        raise model_not_found(settings, model_id, adapters)
    base = served_model(settings)
    adapter = model_id != base and model_id not in settings.lanes
    return {"id": model_id, "object": "model", "created": OBJECT_CREATED,
            "owned_by": "tidegate", "root": base, "parent": base if adapter else None,
            "max_model_len": settings.max_model_len}


CANCELLED = "job_cancelled"  # the code of a cancelled job's error


def job_error(data: dict[str, Any]) -> ApiError:
    """A job that ended in error, as the error of its completion: a deadline is a 504, a
    job cancelled (DELETE /v1/jobs/{id}, an admin) a 409 (the job's state conflicts with
    an answer: it will never have one; a client error class, so nothing counts it as the
    server's failure), the rest (the engine refused or failed it) a 502; never retried by
    the SDK into a second job without the caller's idempotency key."""
    code = str(data.get("code") or "job_failed")
    status = {"deadline_exceeded": 504, CANCELLED: 409}.get(code, 502)
    return ApiError(status, None, str(data.get("message") or "the job failed"), kind=code,
                    headers={"x-should-retry": "false"})  # the openai SDK's own header
