"""Synthetic multi-turn traces in the Bailian schema: `tidegate kv synth`.

The traffic of a customer-service deployment, as parameters (SynthParams, every one a
`tidegate kv synth` option):

* `sessions` conversations. A share `long_share` are long (`long_turns`, an inclusive
  range, uniform), the rest short (`short_turns`).
* Every conversation and one-shot request starts with one of `system_prompts` shared
  system prompts (per lane, over `lanes` lanes) of about `system_prompt_tokens` tokens.
* A conversation's first turn adds `first_message_tokens` (the ticket, the order history);
  every later turn's input is the previous turn's input, its answer (`answer_tokens`) and
  a new message (`message_tokens`): contexts grow turn by turn.
* Between a conversation's turns the user thinks for a log-normal time (shape
  `think_sigma`: most replies come quickly, a few much later) of mean `think_time_s`,
  growing by `think_growth` per turn already taken (long conversations slow down:
  lookups, hand-offs, customers who come back later).
* A share `one_shot_share` of all requests are one-shot (type "oneshot"): the system
  prompt and `one_shot_context_tokens` of unique retrieved context, never seen again.
* Requests arrive at `arrival_rate` a second on average: conversations start and one-shot
  requests arrive uniformly over the trace's span.

Every length is drawn uniformly within +-`length_jitter` of its mean. Block ids follow the
Bailian rule: a block's id stands for the whole input up to its end, so two requests share
an id only when they share that whole prefix; a partial last block is unique.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, fields, replace
from typing import Any

from workers.kvcache.trace import BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True)
class SynthParams:
    sessions: int = 400
    short_turns: tuple[int, int] = (2, 4)
    long_turns: tuple[int, int] = (8, 20)
    long_share: float = 0.3
    think_time_s: float = 20.0
    think_sigma: float = 0.7
    think_growth: float = 0.25
    lanes: int = 2
    system_prompts: int = 3
    system_prompt_tokens: int = 1500
    first_message_tokens: int = 500
    message_tokens: int = 60
    answer_tokens: int = 200
    one_shot_share: float = 0.3
    one_shot_context_tokens: int = 5000
    arrival_rate: float = 2.0
    length_jitter: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        for name in ("short_turns", "long_turns"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: needs 1 <= low <= high, got {low}-{high}")
        for name in ("long_share", "one_shot_share", "length_jitter"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: must be in [0, 1)")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{f.name}: must not be negative")
        if self.sessions < 1 or self.arrival_rate <= 0 or self.system_prompts < 1:
            raise ValueError("sessions, arrival_rate and system_prompts must be positive")

    def with_options(self, **options: Any) -> SynthParams:  # dataclasses.replace's
        """These fields replaced, those given None left as they are (a CLI's unset flags)."""
        return replace(self, **{k: v for k, v in options.items() if v is not None})


class _Ids:
    """Fresh block ids; the system prompts' blocks are made once and shared."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


@dataclass
class _Context:
    """A growing input: ids of its full blocks and the length of its partial tail."""

    blocks: list[int]
    tail: int  # tokens in the partial last block (0: none)

    def extend(self, tokens: int, ids: _Ids) -> _Context:
        total = self.tail + tokens
        return _Context(self.blocks + ids.fresh(total // BLOCK_TOKENS), total % BLOCK_TOKENS)

    @property
    def length(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS + self.tail

    def hash_ids(self, ids: _Ids) -> tuple[int, ...]:
        return tuple(self.blocks + (ids.fresh(1) if self.tail else []))


def synthesize(params: SynthParams) -> list[TraceRequest]:
    params.validate()
    rng, ids = random.Random(params.seed), _Ids()
    prompts = [_Context(ids.fresh(n // BLOCK_TOKENS), n % BLOCK_TOKENS)
               for n in (_jitter(rng, params.system_prompt_tokens, params.length_jitter)
                         for _ in range(params.lanes * params.system_prompts))]
    turns = [_turns(rng, params) for _ in range(params.sessions)]
    one_shots = round(sum(turns) * params.one_shot_share / (1 - params.one_shot_share))
    span_s = (sum(turns) + one_shots) / params.arrival_rate
    events: list[tuple[float, int, int, _Context, int]] = []  # time, chat, parent, input, turn
    chat_ids = itertools.count(1)
    for n_turns in turns:
        events += _conversation(rng, params, ids, rng.choice(prompts), n_turns,
                                rng.uniform(0, span_s), chat_ids)
    for _ in range(one_shots):
        context = rng.choice(prompts).extend(
            _jitter(rng, params.one_shot_context_tokens, params.length_jitter), ids)
        events.append((rng.uniform(0, span_s), next(chat_ids), -1, context, 0))
    events.sort(key=lambda e: e[0])
    return [_request(rng, params, ids, *event) for event in events]


def _conversation(rng: random.Random, params: SynthParams, ids: _Ids, prompt: _Context,
                  n_turns: int, start: float, chat_ids: itertools.count[int]
                  ) -> list[tuple[float, int, int, _Context, int]]:
    events = []
    context = prompt.extend(_jitter(rng, params.first_message_tokens, params.length_jitter), ids)
    at, parent = start, -1
    for turn in range(1, n_turns + 1):
        chat_id = next(chat_ids)
        events.append((at, chat_id, parent, context, turn))
        answer = _jitter(rng, params.answer_tokens, params.length_jitter)
        message = _jitter(rng, params.message_tokens, params.length_jitter)
        context = context.extend(answer + message, ids)
        mean_think = params.think_time_s * (1 + params.think_growth * (turn - 1))
        at += _lognormal(rng, mean_think, params.think_sigma)
        parent = chat_id
    return events


def _request(rng: random.Random, params: SynthParams, ids: _Ids, at: float, chat_id: int,
             parent: int, context: _Context, turn: int) -> TraceRequest:
    return TraceRequest(
        chat_id=chat_id, parent_chat_id=parent, timestamp=round(at, 3),
        input_length=context.length,
        output_length=_jitter(rng, params.answer_tokens, params.length_jitter),
        type="text" if turn else "oneshot", turn=max(turn, 1),
        hash_ids=context.hash_ids(ids))


def _turns(rng: random.Random, params: SynthParams) -> int:
    low, high = params.long_turns if rng.random() < params.long_share else params.short_turns
    return rng.randint(low, high)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    if mean <= 0:
        return 0.0
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def _jitter(rng: random.Random, mean: int, jitter: float) -> int:
    return max(1, round(mean * rng.uniform(1 - jitter, 1 + jitter)))
