"""Prompt rendering and counting with the model's own tokenizer, so a prompt that does not
fit the lane or the model is refused before anything is enqueued."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from api.schemas import JobRequest


class PromptRenderer:
    def __init__(self, model_path: Path | str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(model_path))

    def render(self, req: JobRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        messages = [m.model_dump() for m in req.messages or []]
        if getattr(self.tokenizer, "chat_template", None):
            return str(self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True))
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"

    def render_prefix(self, system: list[Any]) -> str:
        """The rendered system turn: the prefix every request of such a chat starts with."""
        messages = [m.model_dump() for m in system]
        if getattr(self.tokenizer, "chat_template", None):
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n"

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one renderer per API process
    def count_prefix(self, prefix: str) -> int:
        """Tokens of a system turn; a lane has a few, sent again with every request."""
        return self.count(prefix) if prefix else 0
