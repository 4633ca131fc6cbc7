"""The OpenAI-compatible routes' request bodies as pydantic models (POST
/v1/chat/completions, /v1/completions; a Batch's lines too). Parsing them is
api/openai_api.py; the answers, api/openai_answers.py.

Every field OpenAI defines is either carried, or refused by name (400, `param` naming it):
never silently dropped. A refused field sent with its neutral value (`n: 1`,
`logprobs: false`, a penalty of 0, null) changes nothing and is let through.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.errors import ApiError
from api.openai_tools import ResponseFormat, Tool, ToolChoice
from api.schemas import MAX_LOGPROBS, MAX_N, finite
from tidegate import capabilities as cap
from tidegate.jsontypes import JSON, JSONObject

# Extensions: tidegate's own fields, which the SDK sends through `extra_body`.
EXTENSIONS = ("lane", "priority", "session_id", "deadline_s", "idempotency_key")
# OpenAI's fields tidegate does not implement -> their neutral values, which change nothing.
CHAT_REFUSED: dict[str, tuple[JSON, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "store": (None, False), "metadata": (None, {}), "web_search_options": (None,),
    "verbosity": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,),
}
COMPLETION_REFUSED: dict[str, tuple[JSON, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256


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

    def as_message(self) -> JSONObject:
        """The job's message (checked by JobRequest's Message, inside `_job`)."""
        role = "system" if self.role == "developer" else self.role
        message: JSONObject = {"role": role, "content": _joined(self.content) or None}
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


class CommonRequest(BaseModel):
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

    _finite = field_validator("temperature", "top_p", "deadline_s")(finite)

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

    def sampling(self) -> JSONObject:
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


class ChatRequest(CommonRequest):
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


class CompletionRequest(CommonRequest):
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


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, param, f"{param}: {message}")

