"""The simulated engine's tokens (workers/sim_engine.py): ordinary ids of the checkpoint's
tokenizer, each a hash of (prompt, LoRA, position, and for sampling the seed, or the
request id without one), so greedy requests of one prompt agree, seeds repeat, and a
resumed request continues the very sequence it was cut from."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine import EngineError, EngineRequest

if TYPE_CHECKING:  # transformers loads in seconds: at the engine's start only
    from transformers import PreTrainedTokenizerBase

SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature is greedy decoding
CANDIDATES = 64  # tokens a sampling step chooses among at top_p 1
_MASK = (1 << 64) - 1


class Vocab:
    """The checkpoint's tokenizer, and the ids the engine emits: ordinary tokens whose text
    stands alone (no special token, no piece of a multi-byte character), so the streamed
    texts join into the text of the ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids) | set(
            getattr(tokenizer, "added_tokens_decoder", {}))
        # Decoded once at start: a token's text is then a list lookup on every step.
        self.text = [str(tokenizer.decode([i])) for i in range(len(tokenizer))]
        self.ids = [i for i, text in enumerate(self.text)
                    if i not in special and text and text.isprintable() and "\ufffd" not in text]
        if not self.ids:
            raise EngineError("the tokenizer has no ordinary token to simulate output with")

    @classmethod
    def load(cls, model: str) -> Vocab:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model))

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])


def _key(*parts: object) -> int:
    """A 64-bit key stable across processes (Python's own str hash is salted per process):
    a resumed request may run on another worker."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    """splitmix64's finaliser: the token at any position in O(1), no generator state to
    carry (or to replay on resume)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Sampler:
    """Which token a request gets at each output position."""

    stream: int  # the prompt's (and LoRA's) greedy stream
    choice: int  # the seed's stream; unused when candidates == 1
    candidates: int  # tokens each step chooses among: 1 is greedy

    @classmethod
    def of(cls, request: EngineRequest) -> Sampler:
        stream = _key("stream", request.prompt, request.lora)
        if request.temperature < SAMPLING_EPS:
            return cls(stream, 0, 1)
        seed = request.seed if request.seed is not None else request.request_id
        candidates = max(1, math.ceil(request.top_p * CANDIDATES))
        return cls(stream, _key("seed", request.prompt, request.lora, seed), candidates)

    def token(self, vocab: Vocab, position: int) -> int:
        pick = 0
        if self.candidates > 1:
            pick = _mix((self.choice + position) & _MASK) % self.candidates
        return vocab.ids[_mix((self.stream + position * CANDIDATES + pick) & _MASK)
                         % len(vocab.ids)]
