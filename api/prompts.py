"""Prompt rendering and counting with the model's own tokenizer, so a prompt that does not
fit the lane or the model is refused before anything is enqueued."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Required, TypedDict

from api.errors import unavailable
from api.schemas import JobRequest, Message
from api.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("tidegate.api")

TOKENIZER_WAIT_S = 30.0  # a submit waits this long for the tokenizer, then hears a 503
LOAD_POLL_S = 0.05


class Readiness(TypedDict, total=False):
    """One check of GET /readyz: ok, and why not."""

    ok: Required[bool]
    error: str


class PromptRenderer:
    """The tokenizer (api/tokenizer.py) loads on a thread of its own: a large one, or one
    that needs transformers, takes seconds, and an API restarted under load must serve its
    event streams, which need no tokenizer, at once. Submits wait for it on the event loop
    (`loaded`); /readyz says not ready until it is loaded."""

    def __init__(self, model_path: Path | str) -> None:
        self._loaded = threading.Event()
        self._tokenizer: Tokenizer | None = None
        self._error = ""
        threading.Thread(target=self._load, args=(str(model_path),), name="tokenizer-load",
                         daemon=True).start()

    def _load(self, path: str) -> None:
        try:
            self._tokenizer = load_tokenizer(path)
        except Exception as exc:  # any failure: told at each submit and by /readyz
            self._error = f"the model's tokenizer failed to load from {path}: {exc}"
            log.error("%s", self._error)
        finally:
            self._loaded.set()

    def readiness(self) -> Readiness:
        if not self._loaded.is_set():
            return {"ok": False, "error": "loading"}
        check: Readiness = {"ok": not self._error}
        if self._error:
            check["error"] = self._error
        return check

    async def loaded(self) -> None:
        """Waits for the tokenizer without holding a thread: a submit waiting in one of the
        admission threads would hold up the event-stream openings that share them. Raises
        the 503 that `tokenizer` would."""
        deadline = time.monotonic() + TOKENIZER_WAIT_S
        while not self._loaded.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(LOAD_POLL_S)
        self.tokenizer  # noqa: B018 - raises when not loaded

    @property
    def tokenizer(self) -> Tokenizer:
        if not self._loaded.wait(TOKENIZER_WAIT_S):
            raise unavailable("the API is still loading the model's tokenizer")
        if self._error:
            raise unavailable(self._error, retry_after_s=30)
        assert self._tokenizer is not None  # loaded, without an error
        return self._tokenizer

    def render(self, req: JobRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        if getattr(self.tokenizer, "chat_template", None):
            # The template renders the tools (OpenAI's shape, as vLLM's server passes them).
            tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} \
                if req.tools else {}
            return str(self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **tools))
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"

    def render_prefix(self, system: Sequence[Message]) -> str:
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
