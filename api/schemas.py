"""Request and response bodies of the jobs API.

Before a body meets its model, every string in it (values and keys, at any depth) is
checked for what no text field may hold: NUL, which PostgreSQL's text refuses, and UTF-16
surrogates, which JSON lets through as a lone `\\ud800` escape and which cannot be encoded
to UTF-8 (for the tokenizer, the store, or the JSON of an answer). Either is a 400 naming
the field; the text itself is never echoed.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from api.errors import ApiError, malformed
from api.openai_tools import ResponseFormat, Tool, ToolChoice

# NUL, and any surrogate: json.loads joins a valid pair into one character, so what is
# left in a str is a lone one.
UNSAFE_TEXT = re.compile("[\x00\ud800-\udfff]")
MAX_DEPTH = 16  # a job body is 4 levels deep; deeper is refused before it is walked


MAX_N = 16  # choices one request may ask (`n`): each is a sequence in the engine's batch
MAX_LOGPROBS = 20  # alternatives per token: vLLM's default max_logprobs, OpenAI's limit


def finite(v: float | None) -> float | None:
    """A float field's validator (here and api/openai_models.py): JSON as Python reads it
    takes `NaN` and `Infinity`, which no sampling parameter or deadline can be."""
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


class Message(BaseModel):
    """A turn. An assistant turn may hold tool calls and no text (content null); a `tool`
    turn answers one of them by its id. The chat template renders both
    (api/prompts.py)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(None, min_length=1)
    # OpenAI's shape: [{"id", "type": "function", "function": {"name", "arguments"}}].
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # role tool
    name: str | None = Field(None, min_length=1, max_length=64)

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only in an assistant turn with "
                             "tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool turn needs the tool_call_id it answers")
        return self


class JobRequest(BaseModel):
    """POST /v1/jobs. Lane limits are checked after this, against the lanes file."""

    model_config = ConfigDict(extra="forbid")

    lane: str = Field(min_length=1, max_length=64)
    priority: int | None = Field(None, ge=0, le=9)  # 9 is the most urgent; default: the lane's
    session_id: str | None = Field(None, min_length=1, max_length=128)
    messages: list[Message] | None = None
    prompt: str | None = None  # raw prompt, no chat template
    max_tokens: int = Field(128, gt=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    deadline_s: float | None = Field(None, gt=0)  # default and cap: the lane's deadline
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)
    lora: str | None = Field(None, min_length=1, max_length=128)  # a LoRA adapter's name
    # Where the job's end is POSTed, signed (tasks/webhooks.py); default: the tenant's.
    callback_url: str | None = Field(None, min_length=1, max_length=2048)
    # Strings that end the output (left out of it), as OpenAI's `stop`.
    stop: list[str] = Field(default_factory=list, max_length=4)
    # Structured output and tool calling, in OpenAI's shapes (api/openai_tools.py).
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Sampling as vLLM's SamplingParams takes it; None: the engine's neutral default. A
    # field whose engine capability no worker of the lane has is a 400 naming it
    # (tidegate/capabilities.py, api/submit.py `needs`).
    n: int = Field(1, ge=1, le=MAX_N)  # choices, sampled in one engine request
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # vLLM's; 1 is neutral
    top_k: int | None = Field(None, ge=-1)  # vLLM's; 0 and -1 mean every token
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, -100..100
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str]) -> list[str]:
        if any(not 0 < len(s) <= 256 for s in v):
            raise ValueError("each stop string holds 1 to 256 characters")
        return v

    _finite = field_validator("temperature", "top_p", "deadline_s", "presence_penalty",
                              "frequency_penalty", "repetition_penalty", "min_p")(finite)

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.isascii() or not token.isdigit():
                raise ValueError(f"keys are token ids (decimal strings), not {token[:32]!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"token {token}: the bias must lie in -100..100")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if not self.messages and not self.prompt:
            raise ValueError("give `messages` (a non-empty list) or `prompt`")
        if self.messages and self.prompt:
            raise ValueError("give either `messages` or `prompt`, not both")
        return self


def parse_job_request(body: object) -> JobRequest:
    check_text(body)
    try:
        return JobRequest.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc) from None


def check_text(value: object, path: tuple[str, ...] = ()) -> None:
    """400 naming the first string (or key) under `value` that holds NUL or a surrogate."""
    if len(path) > MAX_DEPTH:
        raise malformed("body", f"body: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if UNSAFE_TEXT.search(value):
            field = ".".join(path) or "body"
            raise malformed(field, f"{field}: text may not hold NUL (\\u0000) or a lone "
                            "surrogate (\\ud800-\\udfff)")
    elif isinstance(value, dict):
        for key, item in value.items():
            if UNSAFE_TEXT.search(key):
                field = ".".join((*path, _escaped(key)))
                raise malformed(field, f"{field}: a field name may not hold NUL or a lone "
                                "surrogate")
            check_text(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, (*path, str(i)))


def _escaped(text: str) -> str:
    """`text` as printable ASCII (for naming a field whose name is not)."""
    return text.encode("unicode_escape").decode("ascii")


def _field_error(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    field = ".".join(loc) if loc else "messages"
    msg = err["msg"].removeprefix("Value error, ")
    return ApiError(422, field, f"{field}: {msg}")


class JobAccepted(BaseModel):
    # The x-ratelimit-* headers of the submit's charge (api/limits.py), for the OpenAI
    # routes' answer: never in the body.
    _rate_limits: dict[str, str] = PrivateAttr(default_factory=dict)

    job_id: str
    status: str
    lane: str
    queue: str
    priority: int
    events_url: str
    created: bool  # False when an idempotency key matched an earlier job
