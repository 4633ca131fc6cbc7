"""Prompts whose tokens are exactly a trace's blocks, to replay a trace on a real engine.

Every block id becomes 16 words, each one token of the model's tokenizer (a word with its
leading space, which byte-level BPE keeps as one pre-token), drawn from a generator seeded
by the id. So two prompts share a token prefix exactly where their block ids agree, and a
prompt has exactly `input_length` tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from workers.kvcache.trace import BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:  # transformers loads in seconds: only when a tokenizer is built
    from transformers import PreTrainedTokenizerBase

MIN_WORDS = 64  # fewer and blocks of different ids would start to collide


class BlockText:
    def __init__(self, model_path: Path | str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_path))
        self.words = _one_token_words(self.tokenizer)
        if len(self.words) < MIN_WORDS:
            raise ValueError(f"the tokenizer of {model_path} has only {len(self.words)} "
                             f"one-token words; trace prompts need {MIN_WORDS}")

    def block(self, block_id: int, tokens: int = BLOCK_TOKENS) -> str:
        rng = random.Random(block_id)
        return "".join(rng.choice(self.words) for _ in range(tokens))

    def prompt(self, request: TraceRequest) -> str:
        """The request's input: its full blocks, then as much of its last as it holds."""
        parts, left = [], request.input_length
        for block_id in request.hash_ids:
            take = min(BLOCK_TOKENS, left)
            parts.append(self.block(block_id, take))
            left -= take
        return "".join(parts)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _one_token_words(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    words = []
    for token, token_id in tokenizer.get_vocab().items():
        word = " " + token[1:]
        if not (token.startswith("\u0120") and token[1:].isascii() and token[1:].isalpha()):
            continue
        if tokenizer.encode(word, add_special_tokens=False) == [token_id]:
            words.append(word)
    return sorted(words)
