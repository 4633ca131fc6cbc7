"""api/openai_tools.py without a process: what a request's response_format, tools and
tool_choice ask of the engine, the checks that refuse bad ones naming the field, and the
answers built from the engine's text (whole, and as OpenAI's streamed deltas)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import TypeAdapter

from api.errors import ApiError
from api.openai_tools import (
    ResponseFormat,
    Tool,
    ToolCalls,
    ToolChoice,
    check,
    guided,
    needs,
    tool_parse,
)
from tidegate import capabilities as cap

PARAMS = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "lookup",
                                                               "parameters": PARAMS}}),
         Tool.model_validate({"type": "function", "function": {"name": "ping"}})]
CHOICE: TypeAdapter[ToolChoice] = TypeAdapter(ToolChoice)  # type: ignore[arg-type]
NAMED = CHOICE.validate_python({"type": "function", "function": {"name": "lookup"}})


def fmt(body: dict[str, Any]) -> ResponseFormat:
    return ResponseFormat.model_validate(body)


def test_response_formats_become_the_engines_constraint() -> None:
    assert guided(fmt({"type": "text"}), None, None, None) is None
    assert guided(fmt({"type": "json_object"}), None, None, None) == {"json_object": True}
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    got = guided(fmt({"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                             "strict": True}}), None, None, None)
    assert got == {"json": schema}


def test_tool_choices_become_schemas_as_vllm_makes_them() -> None:
    assert guided(None, TOOLS, NAMED, None) == {"json": PARAMS}
    required = guided(None, TOOLS, "required", False)
    assert required is not None
    schema = required["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["lookup"], ["ping"]]
    # A tool without parameters takes a JSON object of arguments all the same.
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}}
    assert guided(None, TOOLS, "auto", None) is None
    assert guided(None, TOOLS, "none", None) is None


def test_auto_goes_to_the_lanes_parser() -> None:
    spec = tool_parse(TOOLS, None, "hermes")
    assert spec is not None and spec["parser"] == "hermes" and len(spec["tools"]) == 2
    assert tool_parse(TOOLS, "required", "hermes") is None


@pytest.mark.parametrize(("args", "param"), [
    ((fmt({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
      None, None, None), "response_format.json_schema.schema"),
    ((fmt({"type": "json_schema"}), None, None, None), "response_format.json_schema"),
    ((None, None, "required", None), "tool_choice"),
    ((None, TOOLS, CHOICE.validate_python({"type": "function", "function": {"name": "no"}}),
      None), "tool_choice"),
    ((None, TOOLS, "auto", None), "tool_choice"),
    ((None, TOOLS, None, None), "tools"),  # tools alone ask auto
    ((None, TOOLS * 2, "required", None), "tools"),
    ((None, [Tool.model_validate({"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}})], "required", None),
     "tools.0.function.parameters"),
    ((fmt({"type": "json_object"}), TOOLS, NAMED, None), "response_format"),
])
def test_bad_combinations_are_refused_naming_the_field(args: tuple[Any, ...],
                                                       param: str) -> None:
    with pytest.raises(ApiError) as caught:
        check(*args)
    assert caught.value.status == 400 and caught.value.field == param


def test_an_empty_tools_list_is_no_tools() -> None:
    check(None, [], None, None)
    check(None, [], "none", None)
    assert guided(None, [], None, None) is None and needs(None, [], None) == {}


def test_what_each_needs_of_the_engine() -> None:
    assert needs(fmt({"type": "json_object"}), None, None) == {
        cap.STRUCTURED_OUTPUT: "response_format"}
    assert needs(None, TOOLS, "required") == {cap.STRUCTURED_OUTPUT: "tool_choice"}
    assert needs(None, TOOLS, NAMED) == {cap.STRUCTURED_OUTPUT: "tool_choice"}
    assert needs(None, TOOLS, "auto") == {cap.TOOLS: "tools"}
    assert needs(None, TOOLS, "none") == {}
    assert needs(fmt({"type": "text"}), None, None) == {}


def test_a_named_call_is_the_whole_text_as_arguments() -> None:
    calls = ToolCalls.of(TOOLS, NAMED)
    message = calls.message('{"id":7}', [])
    [call] = message["tool_calls"]
    assert message["content"] is None and call["function"] == {"name": "lookup",
                                                                "arguments": '{"id":7}'}
    assert calls.finish_reason("stop", True) == "stop"  # OpenAI's for a named call


def test_a_named_call_streams_its_name_then_the_arguments() -> None:
    calls = ToolCalls.of(TOOLS, NAMED)
    content, first = calls.stream('{"id"', [])
    _, rest = calls.stream(":7}", [])
    assert content is None
    assert first[0]["id"].startswith("call_") and first[0]["function"] == {
        "name": "lookup", "arguments": ""}
    assert [d["function"]["arguments"] for d in first[1:] + rest] == ['{"id"', ":7}"]


def test_required_calls_are_read_from_the_array() -> None:
    text = json.dumps([{"name": "lookup", "parameters": {"id": 3}},
                       {"name": "ping", "parameters": {}}])
    calls = ToolCalls.of(TOOLS, "required")
    message = calls.message(text, [])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["lookup", "ping"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"id": 3}
    assert calls.finish_reason("stop", True) == "tool_calls"
    # Cut short by max_tokens: no calls, the text as it came, and the engine's reason.
    cut = ToolCalls.of(TOOLS, "required")
    assert cut.message(text[:10], []) == {"content": text[:10]}
    assert cut.finish_reason("length", False) == "length"


def test_streamed_required_calls_come_at_the_end() -> None:
    calls = ToolCalls.of(TOOLS, "required")
    text = json.dumps([{"name": "ping", "parameters": {}}])
    assert calls.stream(text[:5], []) == (None, [])
    calls.stream(text[5:], [])
    first, args = calls.stream_end()
    assert first["index"] == 0 and first["function"]["name"] == "ping"
    assert args == {"index": 0, "function": {"arguments": "{}"}}
    assert calls.streamed_any() and calls.unsent_text() == ""


def test_auto_calls_are_the_workers_deltas_merged() -> None:
    deltas = [{"index": 0, "id": "call_a", "type": "function",
               "function": {"name": "lookup"}},
              {"index": 0, "function": {"arguments": '{"id": '}},
              {"index": 0, "function": {"arguments": "5}"}}]
    calls = ToolCalls.of(TOOLS, None)
    message = calls.message("Let me look.", deltas)
    assert message["content"] == "Let me look."
    assert message["tool_calls"] == [{"id": "call_a", "type": "function", "function": {
        "name": "lookup", "arguments": '{"id": 5}'}}]
    assert calls.finish_reason("stop", True) == "tool_calls"
    assert ToolCalls.of(TOOLS, None).message("No call.", []) == {"content": "No call."}


def test_tensorrt_llm_gets_the_constraint_as_its_guided_decoding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT-LLM cannot run here: its GuidedDecodingParams is faked (a module holding a
    class of that name that keeps its keyword arguments), to see what the adapter passes."""
    import sys
    import types

    from workers.trtllm_engine import guided_decoding

    class FakeGuidedDecodingParams:
        def __init__(self, **fields: Any) -> None:
            self.fields = fields

    fake = types.ModuleType("tensorrt_llm.llmapi")
    fake.GuidedDecodingParams = FakeGuidedDecodingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.ModuleType("tensorrt_llm"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", fake)
    assert guided_decoding(None) == {}
    schema = {"type": "object"}
    assert guided_decoding({"json": schema})["guided_decoding"].fields == {"json": schema}
    assert guided_decoding({"json_object": True})["guided_decoding"].fields == {
        "json_object": True}
