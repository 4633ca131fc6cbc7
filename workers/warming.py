"""Warming a worker's engine: prompts (and system prompts, rendered with the model's chat
template) run through it so their prefixes sit in its KV cache, each once while the cache
still holds it (workers/warmed.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypedDict

from tidegate.settings import get_settings
from workers.warmed import Warmed
from workers.worker import current

if TYPE_CHECKING:  # transformers loads in a second: only once a system prompt needs it
    from transformers import PreTrainedTokenizerBase


class WarmReply(TypedDict):
    """What a warm answers (the `tidegate_warm` control command's reply)."""

    ok: bool
    warmed: int  # prompts run through the engine now
    already: int  # prompts it still held from an earlier warm
    ms: float


_warmed = Warmed()  # the prompts this process's engine warmed and still holds
_tokenizers: dict[str, PreTrainedTokenizerBase] = {}


def warm(prompts: list[str], system_prompts: list[str]) -> WarmReply:
    started, me = time.monotonic(), current()
    texts = list(prompts) + [render_system(p) for p in system_prompts]
    kind = me.host.engine.kind
    todo = _warmed.missing(texts, kind, me.engine_stats())  # what is warm is not run again
    if todo:
        me.host.warm(todo)
        _warmed.add(todo, kind, me.engine_stats())
    return {"ok": True, "warmed": len(todo), "already": len(texts) - len(todo),
            "ms": (time.monotonic() - started) * 1000}


def forget() -> None:
    """The engine's prefix cache was reset: nothing it warmed is held any more."""
    _warmed.forget()


def render_system(prompt: str) -> str:
    """The chat-template rendering of a conversation's system turn: the prefix every
    request of that conversation starts with."""
    model = str(get_settings().model_path)
    if model not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[model] = AutoTokenizer.from_pretrained(model)
    tok = _tokenizers[model]
    if not getattr(tok, "chat_template", None):
        return prompt
    return str(tok.apply_chat_template([{"role": "system", "content": prompt}], tokenize=False))
