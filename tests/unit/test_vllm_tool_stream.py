"""The vLLM adapter's `auto` tool calls: vLLM's own `hermes` parser over a request's deltas
(workers/vllm_engine.py `_ToolStream`), fed text in the format the test checkpoint's chat
template teaches (tidegate_tools/testmodel.py). No engine runs: the toy model never writes
a call by itself, so the deltas are made here from a known answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.openai_tools import Tool, ToolCalls
from workers.engine import Delta, EngineError

TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "integer"}}}}}]
ANSWER = ('Let me check.\n<tool_call>\n{"name": "lookup_order", "arguments": '
          '{"order_id": 42}}\n</tool_call>')


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def run(tokenizer: Any, text: str, step: int = 3) -> list[Delta]:
    from workers.vllm_engine import _ToolStream

    stream = _ToolStream({"parser": "hermes", "tools": TOOLS}, tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for start in range(0, len(ids), step):
        chunk = ids[start:start + step]
        last = start + step >= len(ids)
        delta = Delta(text=tokenizer.decode(chunk), token_ids=tuple(chunk), finished=last,
                      finish_reason="stop" if last else None)
        out.append(stream.step(delta))
    return out


def test_a_call_is_taken_out_of_the_text_as_openais_deltas(tokenizer: Any) -> None:
    deltas = run(tokenizer, ANSWER)
    content = "".join(d.text for d in deltas)
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0]["function"]["name"] == "lookup_order" and calls[0]["id"]
    # The API merges them into the whole call, as the SDK would.
    message = ToolCalls.of([Tool.model_validate(t) for t in TOOLS], None).message(
        content, calls)
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "lookup_order", "arguments": '{"order_id": 42}'}
    assert all(d.token_ids for d in deltas)  # every token still counted and resumable


def test_text_without_a_call_passes_through_whole(tokenizer: Any) -> None:
    text = "Your parcel left the depot <tool"  # ends like the start of a tag: held, then sent
    deltas = run(tokenizer, text)
    assert "".join(d.text for d in deltas) == text
    assert not any(d.tool_calls for d in deltas)


def test_an_unknown_parser_is_an_engine_error(tokenizer: Any) -> None:
    from workers.vllm_engine import _ToolStream

    with pytest.raises(EngineError, match="tool parser"):
        _ToolStream({"parser": "no-such-parser", "tools": TOOLS}, tokenizer)


def test_a_lane_naming_no_parser_of_vllms_fails_the_engine_start() -> None:
    from workers.vllm_engine import _check_tool_parsers

    _check_tool_parsers(("hermes",))
    with pytest.raises(EngineError, match="'hermes2'"):
        _check_tool_parsers(("hermes", "hermes2"))


def test_the_apis_renderer_and_transformers_agree_on_tool_turns(tokenizer: Any,
                                                                model_path: Path) -> None:
    """The API renders the prompt (api/tokenizer.py), vLLM's server would render it with
    transformers: the tools, a call and its result come out the same."""
    from api.tokenizer import FastTokenizer

    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "You help with orders."},
        {"role": "user", "content": "Where is order 42?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id": 42}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
    ]
    ours = FastTokenizer(model_path).apply_chat_template(
        chat, add_generation_prompt=True, tools=TOOLS)
    theirs = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                           tools=TOOLS)
    assert ours == theirs
    assert '<tools>\n{"type": "function"' in ours and "<tool_response>" in ours
    assert '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": 42}}' in ours
