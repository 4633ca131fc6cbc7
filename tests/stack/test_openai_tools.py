"""Tool calling with the official `openai` SDK, unchanged, against the real stack (vLLM on
CPU): a named tool choice and `required` force a call through structured output, so its
arguments parse and hold to the tool's parameters even on the toy test checkpoint; the
SDK's own stream helper reassembles the streamed `tool_calls` deltas; the call and its
result go back as the next turns; `auto` on a lane with vLLM's `hermes` parser answers
text the parser passed through."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import Stack, make_tenant

MODEL = "tidegate-test"
ASK = [{"role": "user", "content": "Where is my parcel? Order 12 was due last week."}]
LOOKUP_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"order_id": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "urgent": {"type": "boolean"}},
    "required": ["order_id", "urgent"],
    "additionalProperties": False,
}
REFUND_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"reason": {"type": "string", "enum": ["late", "broken", "other"]}},
    "required": ["reason"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "lookup_order", "description": "Find an order",
                                      "parameters": LOOKUP_PARAMS, "strict": True}},
    {"type": "function", "function": {"name": "refund", "description": "Refund an order",
                                      "parameters": REFUND_PARAMS, "strict": True}},
]
PARAMS = {"lookup_order": LOOKUP_PARAMS, "refund": REFUND_PARAMS}
NAMED: Any = {"type": "function", "function": {"name": "lookup_order"}}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    _, api_key = make_tenant(stack.store, "openai-tools", ["finance", "chat"])
    return api_key


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def valid(call: Any) -> dict[str, Any]:
    """The call's arguments, parsed and checked against its tool's parameters."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])
    return dict(arguments)


def test_a_named_tool_choice_calls_that_tool(stack: Stack, key: str) -> None:
    done = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS,
        tool_choice=NAMED)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named call
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "lookup_order"
    valid(call)


def test_required_calls_one_of_the_tools(stack: Stack, key: str) -> None:
    done = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0.8, seed=11,
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1  # parallel_tool_calls=false: one call at most
    valid(calls[0])


def test_the_sdks_stream_helper_reassembles_the_streamed_call(stack: Stack, key: str) -> None:
    with sdk(stack, key).chat.completions.stream(
            model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS,
            tool_choice=NAMED) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events
    assert "tool_calls.function.arguments.done" in events
    [call] = final.choices[0].message.tool_calls or []
    assert call.function.name == "lookup_order"
    assert valid(call) == call.function.parsed_arguments  # strict tools: the SDK parses


def test_required_streamed_to_the_async_client(stack: Stack, key: str) -> None:
    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=key,
                                    max_retries=0, timeout=120)
        async with client, client.chat.completions.stream(
                model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
                tools=TOOLS, tool_choice="required", parallel_tool_calls=False) as stream:
            async for _ in stream:
                pass
            return await stream.get_final_completion()

    final = asyncio.run(run())
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls and all(valid(call) is not None for call in calls)
    assert len({call.id for call in calls}) == len(calls)


def test_the_call_and_its_result_go_back_as_the_next_turns(stack: Stack, key: str) -> None:
    """Three turns, built the usual way: the returned message appended as it came, the
    tool's result after it, then the question again."""
    client = sdk(stack, key)
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS,
                                           tool_choice=NAMED)
    message = first.choices[0].message
    messages.append(message)
    [call] = message.tool_calls or []
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"status": "shipped"})})
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0, tools=TOOLS, tool_choice="none")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # The tools and the call are in the prompt the template rendered: it grew with them.
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_on_a_lane_with_the_hermes_parser_passes_text_through(stack: Stack,
                                                                   key: str) -> None:
    """The toy model writes no <tool_call>: the parser finds none, and the text it passed
    through is the job's whole output."""
    done = sdk(stack, key).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, temperature=0, tools=TOOLS,
        service_tier="priority")  # finance: tool_parser = "hermes" (tests/lanes.toml)
    choice = done.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "length"
    job = httpx.get(f"{stack.base_url}/v1/jobs/{done.id}", timeout=10,
                    headers={"Authorization": f"Bearer {key}"}).json()
    assert choice.message.content == job["output_text"] and job["completion_tokens"] == 12


def test_auto_on_a_lane_without_a_parser_is_a_400(stack: Stack, key: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(stack, key).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                                tools=TOOLS, tool_choice="auto")
    assert caught.value.param == "tool_choice" and "tool_parser" in caught.value.message


def test_a_choice_naming_no_tool_is_a_400(stack: Stack, key: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(stack, key).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "cancel_order"}})
    assert caught.value.param == "tool_choice"
