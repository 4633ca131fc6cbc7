"""Request traces in the JSONL schema of the public Qwen-Bailian usage traces.

One JSON object a line: `chat_id`, `parent_chat_id` (-1 for a first turn), `timestamp`
(seconds), `input_length` and `output_length` (tokens), `type`, `turn` (1-based) and
`hash_ids`, one id per 16-token block of the input: two requests share a block id exactly
when they share the input up to the end of that block, so a shared prefix is a shared
run of leading ids.

A conversation is the chain of requests linked by `parent_chat_id`; its session id is the
chat id of its first turn. Which requests are one-shot (no session, as a tidegate producer
sends them without `session_id`) is a property of the traffic, not of the trace schema: by
default requests of type "oneshot" (what `tidegate kv synth` writes), or any `type` named
in `one_shot_types`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from workers.kvcache.policy import SessionMeta

BLOCK_TOKENS = 16  # the traces' block size, and vLLM's default
ONE_SHOT_TYPES = frozenset({"oneshot"})
_FIELDS = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "type",
           "turn", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    chat_id: int
    parent_chat_id: int  # -1: a first turn
    timestamp: float  # seconds from the trace's start
    input_length: int  # tokens
    output_length: int  # tokens
    type: str
    turn: int  # 1-based
    hash_ids: tuple[int, ...]  # one per 16-token block of the input, the last maybe partial

    def to_json(self) -> str:
        body = asdict(self)
        body["hash_ids"] = list(self.hash_ids)
        return json.dumps(body, separators=(",", ":"))


class TraceError(ValueError):
    """A trace line is not in the schema; the message names the line and the field."""


def read_trace(path: Path) -> list[TraceRequest]:
    """All requests of a trace file, in timestamp order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceError(f"trace {path}: {exc}") from exc
    requests = [_parse(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not requests:
        raise TraceError(f"trace {path}: no requests")
    return sorted(requests, key=lambda r: r.timestamp)


def write_trace(path: Path, requests: Iterable[TraceRequest]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for request in requests:
            out.write(request.to_json() + "\n")
            count += 1
    return count


def _parse(path: Path, n: int, line: str) -> TraceRequest:
    try:
        body = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"trace {path} line {n}: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise TraceError(f"trace {path} line {n}: not a JSON object")
    missing = [f for f in _FIELDS if f not in body]
    if missing:
        raise TraceError(f"trace {path} line {n}: missing field {missing[0]!r}")
    try:
        return TraceRequest(
            chat_id=int(body["chat_id"]), parent_chat_id=int(body["parent_chat_id"]),
            timestamp=float(body["timestamp"]), input_length=int(body["input_length"]),
            output_length=int(body["output_length"]), type=str(body["type"]),
            turn=int(body["turn"]), hash_ids=tuple(int(h) for h in body["hash_ids"]))
    except (TypeError, ValueError) as exc:
        raise TraceError(f"trace {path} line {n}: {exc}") from None


def regroup(request: TraceRequest, block_tokens: int) -> TraceRequest:
    """The request as an engine with `block_tokens`-token blocks (a multiple of 16) sees it:
    a block stands for the input up to its end, so a bigger block takes the id of its last
    16-token block. vLLM's CPU build needs blocks of a multiple of 32 tokens."""
    if block_tokens % BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be a multiple of {BLOCK_TOKENS}, not {block_tokens}")
    factor = block_tokens // BLOCK_TOKENS
    if factor == 1:
        return request
    ids = request.hash_ids
    merged = tuple(ids[min(k + factor, len(ids)) - 1] for k in range(0, len(ids), factor))
    return replace(request, hash_ids=merged)


def session_metas(requests: list[TraceRequest], one_shot_types: Collection[str] = ONE_SHOT_TYPES,
                  lane: str = "chat") -> Iterator[SessionMeta]:
    """What tidegate would know of each request: its session (the chain's first chat id)
    and turn, or that it is one-shot."""
    root: dict[int, int] = {}
    for r in requests:
        root[r.chat_id] = root.get(r.parent_chat_id, r.parent_chat_id) \
            if r.parent_chat_id >= 0 else r.chat_id
        if r.type in one_shot_types and r.parent_chat_id < 0:
            yield SessionMeta(session_id=None, turn=0, lane=lane)
        else:
            yield SessionMeta(session_id=f"s{root[r.chat_id]}", turn=max(1, r.turn), lane=lane)
