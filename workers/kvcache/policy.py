"""Session-priority KV cache retention: which prefix blocks to keep when the cache is full.

Pure and engine-agnostic. The vLLM patch (workers/vllm_patches/kvcache.py), the TensorRT-LLM
adapter (its per-request KvCacheRetentionConfig) and the trace simulator
(workers/kvcache/sim.py, `tidegate kv replay`) all call `retention()` below, and the vLLM
plugin and the simulator share one eviction queue (workers/kvcache/freequeue.py).

Why not LRU. A prefix block is worth keeping when the request that will reuse it comes
soon. LRU assumes the last block touched is the next one needed, which is true of a chat
session's history (its next turn extends it) and false of a one-shot request's unique
context (retrieved documents, a pasted ticket): a burst of one-shot traffic pushes every
live session's history out of an LRU cache, and the next turns pay full prefill.

The classes, on TensorRT-LLM's retention scale (0-100, higher kept longer; lowest first
out, least recently freed first inside a class):

* one-shot request (no session, or its last turn): `one_shot_priority` (10). Its context
  is unlikely to come back; it goes first.
* session turn t <= `short_session_turns`: `session_priority` (80). A short, live session
  is the likeliest to send another turn soon, and its prefix is small.
* later turns decay by `decay_per_turn` (5) a turn down to `long_session_floor` (40): a
  long session holds many blocks for one more turn of uncertain timing, and its pauses
  grow. It decays softly rather
  than dropping, and nothing is pinned: SGLang pinned prefixes and reverted it (pins tie a
  session to a worker and waste memory when the session goes quiet).
* a block hit by a second session or request (a lane's system prompt, a shared document)
  is a shared prefix: it keeps at least `shared_priority` (90) however it is freed. It is
  the most valuable block of all (every conversation of the lane starts with it), so it
  ranks above the sessions; under LRU a flood of one-shot traffic evicts it too.
* warm-up prompts (the lane's hot prefixes) are shared prefixes by definition.
* every class but one-shot lapses: `session_idle_s` (90 s) after a block was last freed
  it falls to EXPIRED_PRIORITY (35, TensorRT-LLM's default) and LRU decides among the
  lapsed. A conversation quiet for that long has most likely ended; set it from the
  lane's measured pauses between turns (a high percentile of them).

The defaults were chosen on `tidegate kv synth` traces (bench/kv.py); the ablations there
show what each part is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.lanes import KvPolicy

EXPIRED_PRIORITY = 35  # a lapsed retention; TensorRT-LLM's default priority
DEFAULT_PRIORITY = EXPIRED_PRIORITY  # requests that carry no session metadata
MAX_PRIORITY = 100


@dataclass(frozen=True)
class SessionMeta:
    """What the policy knows about the request whose blocks are being freed."""

    session_id: str | None  # None: a one-shot request
    turn: int = 0  # the session's turn number, 1-based (counted in the store); 0: one-shot
    lane: str = ""
    live: bool = True  # False: the session ended with this turn
    warm: bool = False  # a warm-up prompt: a lane's hot prefix


@dataclass(frozen=True)
class Retention:
    """How long a request's blocks are kept once it frees them."""

    priority: int  # 0-100, higher kept longer
    duration_s: float | None = None  # then the blocks fall to EXPIRED_PRIORITY; None: never
    shared_priority: int = 0  # the least its blocks keep once another request reused them

    def as_dict(self) -> dict[str, float | int | None]:
        return {"priority": self.priority, "duration_s": self.duration_s,
                "shared_priority": self.shared_priority}

    @classmethod
    def from_dict(cls, body: dict[str, float | int | None]) -> Retention:
        duration = body.get("duration_s")
        return cls(priority=int(body.get("priority") or 0),
                   duration_s=None if duration is None else float(duration),
                   shared_priority=int(body.get("shared_priority") or 0))


DEFAULT_RETENTION = Retention(DEFAULT_PRIORITY)
UNIFORM = Retention(DEFAULT_PRIORITY)  # every block alike: plain LRU


def retention(meta: SessionMeta, params: KvPolicy) -> Retention:
    """The retention class of a request's blocks (see the module docstring)."""
    if meta.warm:
        return Retention(params.shared_priority, params.session_idle_s, params.shared_priority)
    if meta.session_id is None or meta.turn <= 0 or not meta.live:
        return Retention(params.one_shot_priority, None, params.shared_priority)
    return Retention(session_priority(meta.turn, params), params.session_idle_s,
                     params.shared_priority)


def session_priority(turn: int, params: KvPolicy) -> int:
    """`session_priority` for the first turns, then down `decay_per_turn` a turn to the
    floor (never above where it started)."""
    late_turns = max(0, turn - params.short_session_turns)
    decayed = params.session_priority - params.decay_per_turn * late_turns
    return max(min(params.long_session_floor, params.session_priority), decayed)
