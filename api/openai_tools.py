"""Structured output and tool calling, OpenAI's way, as plain code (no HTTP, no vLLM).

What a request asks:

    response_format  {"type": "json_object"} or {"type": "json_schema", "json_schema":
                     {name, schema, strict}}: the engine's structured output (guided
                     decoding) holds the answer to any JSON object, or to the schema
                     (strict or not: the engine applies the schema either way, as vLLM does).
    tools            function definitions, rendered into the prompt by the chat template.
    tool_choice      none: tools rendered, the answer is text. auto (the default with
                     tools): the lane's `tool_parser` (one of vLLM's) finds the calls in the
                     model's text, on the worker. required / a named function: structured
                     output forces the call (an array of {name, parameters} over the tools;
                     the named function's parameters), so the call always parses, on any
                     model; the API reads the calls from the JSON. vLLM's server does the
                     same (vllm/tool_parsers/utils.py `get_json_schema_from_tools`).

The worker gets `guided` ({"json": schema} | {"json_object": True}) and, for `auto`,
`tool_parse` ({"parser": name}); the answers are built here (`ToolCalls`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.errors import ApiError
from tidegate import capabilities as cap
from tidegate.jsontypes import JSONObject

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
MAX_TOOLS = 128  # OpenAI's limit


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: held as schema_, named schema on the wire.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, param, f"{param}: {message}")


# -- checks (admission) -------------------------------------------------------------


def check(response_format: ResponseFormat | None, tools: list[Tool] | None,
          tool_choice: ToolChoice | None, tool_parser: str | None) -> None:
    """400 naming the field for what the models alone cannot see: schemas that are no
    JSON Schema, a choice naming no tool, `auto` on a lane without a tool parser."""
    if response_format is not None:
        _check_format(response_format)
    if tools:  # [] is no tools, as the clients that always send the field mean it
        _check_tools(tools)
    mode = tool_mode(tools, tool_choice)
    if not tools and tool_choice not in (None, "none"):
        raise _bad("tool_choice", "needs `tools`")
    if isinstance(tool_choice, NamedToolChoice) and tools and \
            tool_choice.function.name not in {t.function.name for t in tools}:
        raise _bad("tool_choice", f"names {tool_choice.function.name!r}, which is not in `tools`")
    if mode == "auto" and tool_parser is None:
        # Named as the field the caller sent: tools alone ask "auto" by default.
        raise _bad("tool_choice" if tool_choice is not None else "tools",
                   "tool_choice \"auto\" (the default with tools) needs the lane's "
                   "tool_parser, and this lane has none; ask tool_choice \"required\", a "
                   "named function or \"none\"")
    if mode in ("required", "named") and response_format is not None and \
            response_format.type != "text":
        raise _bad("response_format", f"cannot be combined with tool_choice {mode!r}, which "
                   "sets the output's format itself")


def _check_tools(tools: list[Tool]) -> None:
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools", "two tools have the same function name")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            _check_schema(f"tools.{i}.function.parameters", tool.function.parameters)


def needs(response_format: ResponseFormat | None, tools: list[Tool] | None,
          tool_choice: ToolChoice | None) -> dict[str, str]:
    """The engine capabilities these fields need, each to the field that needs it
    (api/submit.py `needs`): an engine without them refuses at admission, never later.
    `auto` needs the engine's tool parser; `required` and a named function only its
    structured output (the API reads the calls)."""
    out: dict[str, str] = {}
    mode = tool_mode(tools, tool_choice)
    if mode == "auto":
        out[cap.TOOLS] = "tools"
    if mode in ("required", "named"):
        out[cap.STRUCTURED_OUTPUT] = "tool_choice"
    elif response_format is not None and response_format.type != "text":
        out[cap.STRUCTURED_OUTPUT] = "response_format"
    return out


def _check_format(fmt: ResponseFormat) -> None:
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise _bad("response_format.json_schema", "required with type \"json_schema\"")
        _check_schema("response_format.json_schema.schema",
                      fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {})
    elif fmt.json_schema is not None:
        raise _bad("response_format.json_schema", f"only with type \"json_schema\", not "
                   f"{fmt.type!r}")


def _check_schema(param: str, schema: Mapping[str, object]) -> None:
    """A JSON Schema, by its metaschema: a schema the engine's grammar compiler refused
    later would fail the job on the worker (a 502 after the wait), not the request."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise _bad(param, f"not a valid JSON Schema ({exc.message}"
                   f"{' at ' + where if where else ''})") from None


# -- what the engine gets -------------------------------------------------------------

Mode = Literal["", "auto", "required", "named"]


def tool_mode(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> Mode:
    """"" (no tool calls are read), auto, required or named."""
    if not tools or tool_choice == "none":
        return ""
    if isinstance(tool_choice, NamedToolChoice):
        return "named"
    return "required" if tool_choice == "required" else "auto"


def guided(response_format: ResponseFormat | None, tools: list[Tool] | None,
           tool_choice: ToolChoice | None,
           parallel_tool_calls: bool | None) -> JSONObject | None:
    """The structured-output constraint the engine runs (vLLM's StructuredOutputsParams
    fields), or None."""
    mode = tool_mode(tools, tool_choice)
    if mode == "named" and tools is not None and isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return {"json": _params(tool)}
    if mode == "required" and tools is not None:
        return {"json": _calls_schema(tools, parallel_tool_calls)}
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    spec = response_format.json_schema
    return {"json": spec.schema_ if spec is not None and spec.schema_ is not None else {}}


def _params(tool: Tool) -> JSONObject:
    # No parameters still means a JSON object of arguments (vLLM: _params_or_empty_object).
    return tool.function.parameters or {"type": "object", "properties": {}}


def _calls_schema(tools: list[Tool], parallel: bool | None) -> JSONObject:
    """An array of {name, parameters}, one of the tools each (vLLM's schema for
    `required`); one call at most when parallel_tool_calls is false. Unlike vLLM's, a
    call holds no other key: a model may not wander off into one after the parameters
    and spend its max_tokens there."""
    schema: JSONObject = {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "anyOf": [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                  "parameters": _params(t)},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for t in tools]}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def tool_parse(tools: list[Tool] | None, tool_choice: ToolChoice | None,
               tool_parser: str | None) -> JSONObject | None:
    """What the worker needs to find `auto` calls in the text: its parser and the tools."""
    if tool_mode(tools, tool_choice) != "auto" or tool_parser is None or tools is None:
        return None
    return {"parser": tool_parser, "tools": [t.model_dump(exclude_none=True) for t in tools]}


# -- answers ---------------------------------------------------------------------------


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCalls:
    """One answer's tool calls, from the engine's text (required, named) or the worker's
    parsed deltas (auto), whole or as OpenAI's streamed `tool_calls` deltas."""

    mode: Mode
    name: str = ""  # the named function
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole, in OpenAI's shape
    _text: list[str] = field(default_factory=list)
    _named_open: bool = False

    @classmethod
    def of(cls, tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolCalls:
        mode = tool_mode(tools, tool_choice)
        name = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else ""
        return cls(mode=mode, name=name)

    @property
    def active(self) -> bool:
        return self.mode != ""

    # whole answers

    def message(self, text: str, worker_calls: list[JSONObject]) -> JSONObject:
        """The assistant message's content and tool_calls for the whole text."""
        if self.mode == "named":
            return {"content": None, "tool_calls": [self._call(self.name, text)]}
        if self.mode == "required":
            calls = self._required_calls(text)
            if calls is None:  # cut short (length): the text as it is
                return {"content": text}
            return {"content": None, "tool_calls": calls}
        if self.mode == "auto" and worker_calls:
            return {"content": text or None, "tool_calls": _merged(worker_calls)}
        return {"content": text}

    def finish_reason(self, engine_reason: str, called: bool) -> str:
        """OpenAI's: "tool_calls" for auto or required calls, "stop" for a named one."""
        if engine_reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    def _call(self, name: str, arguments: str) -> JSONObject:
        return {"id": call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _required_calls(self, text: str) -> list[dict[str, Any]] | None:
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list):
            return None
        return [self._call(str(item.get("name")),
                           json.dumps(item.get("parameters", {}), ensure_ascii=False))
                for item in items if isinstance(item, dict)]

    # streamed answers

    def stream(self, text: str, worker_deltas: list[dict[str, Any]]) -> tuple[str | None,
                                                                              list[dict]]:
        """(content to send, tool-call deltas to send) for one token event."""
        if self.mode == "named":
            deltas = []
            if not self._named_open:  # OpenAI's first delta: id, type, name, no arguments
                self._named_open = True
                deltas.append({"index": 0, **self._call(self.name, "")})
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return None, deltas
        if self.mode == "required":  # the array is read whole at the end
            self._text.append(text)
            return None, []
        if self.mode == "auto":
            self.calls.extend(worker_deltas)
            return (text or None), worker_deltas
        return text, []

    def stream_end(self) -> list[dict[str, Any]]:
        """The deltas held back to the end: a required answer's calls."""
        if self.mode != "required":
            return []
        calls = self._required_calls("".join(self._text)) or []
        self.calls = calls
        out = []
        for i, call in enumerate(calls):
            args = call["function"]["arguments"]
            out.append({"index": i, "id": call["id"], "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""}})
            out.append({"index": i, "function": {"arguments": args}})
        return out

    def streamed_any(self) -> bool:
        return self._named_open or bool(self.calls)

    def unsent_text(self) -> str:
        """A required answer that did not parse: its text, sent as content at the end."""
        if self.mode == "required" and not self.calls:
            return "".join(self._text)
        return ""


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole tool calls from streamed deltas (each: index, and id/type/name first, then
    argument fragments)."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(int(delta.get("index", 0)), {
            "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            call["id"] = delta["id"]
        fn = delta.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [{**c, "id": c["id"] or call_id()} for _, c in sorted(calls.items())]
