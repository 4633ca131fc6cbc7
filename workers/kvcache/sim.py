"""A block-level prefix cache replayed over a trace: `tidegate kv replay`.

The cache works as vLLM's block pool does, driving the very queue the vLLM plugin installs
(SessionFreeQueue) with the very policy (`retention`): a request matches the longest run
of its leading blocks still cached (pulling them off the free queue), takes new blocks
from the front of the free queue (evicting what they held), and frees all its blocks tail
first when it ends. Requests run one at a time in timestamp order and end at once, so the
only blocks in use are the current request's.

* `lru`: one retention for every block: the queue's order is then vLLM's stock LRU.
* `session`: each request's retention from workers/kvcache/policy.py.
* `belady`: offline reference. After each request the cache keeps the blocks whose next
  use (the next request whose input holds the block) is nearest, computed from the whole
  trace: evict the block whose next use is farthest away.
* `infinite`: nothing is ever evicted: the ceiling.

Hit rate is counted in tokens as vLLM counts it: matched prefix tokens over input tokens,
and a request's last input token is always computed, so a prompt that is a whole number of
cached blocks hits one block less.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tidegate.lanes import KvPolicy
from workers.kvcache.freequeue import SessionFreeQueue
from workers.kvcache.policy import UNIFORM, Retention, SessionMeta, retention
from workers.kvcache.trace import BLOCK_TOKENS, TraceRequest, regroup

POLICIES = ("lru", "session", "belady", "infinite")


@dataclass
class SimResult:
    policy: str
    capacity_blocks: int | None  # None: infinite
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    hits_per_request: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def summary(self) -> dict[str, object]:
        return {"policy": self.policy, "capacity_blocks": self.capacity_blocks,
                "requests": self.requests, "input_tokens": self.input_tokens,
                "hit_tokens": self.hit_tokens, "hit_rate": round(self.hit_rate, 4)}


@dataclass(frozen=True)
class _Req:
    """A trace request as the simulated engine sees it (its block size)."""

    hash_ids: tuple[int, ...]
    input_length: int
    timestamp: float
    hittable: int  # the most leading blocks it can hit: its last token is always computed
    full: int  # the blocks it leaves in the cache: its full ones


def _engine_view(requests: Sequence[TraceRequest], block_tokens: int) -> list[_Req]:
    views = []
    for request in requests:
        r = regroup(request, block_tokens)
        views.append(_Req(r.hash_ids, r.input_length, r.timestamp,
                          max(0, r.input_length - 1) // block_tokens,
                          min(len(r.hash_ids), r.input_length // block_tokens)))
    return views


class _Block:
    __slots__ = ("block_id", "hash_id", "in_use")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.hash_id: int | None = None
        self.in_use = False


class BlockCache:
    """vLLM's block pool in miniature, over the plugin's free queue."""

    def __init__(self, capacity_blocks: int) -> None:
        self.now = 0.0
        self.blocks = [_Block(i) for i in range(capacity_blocks)]
        self.queue = SessionFreeQueue(self.blocks, clock=lambda: self.now)
        self.cached: dict[int, _Block] = {}  # hash id -> block

    def serve(self, request: _Req, tag: Retention, owner: str) -> int:
        """Run one request; returns its hit blocks."""
        self.now = request.timestamp
        self.queue.tag(tag, owner)
        hits = self._match(request)
        for block in hits:  # BlockPool.touch
            self.queue.note_use(block)
            self.queue.remove(block)
            block.in_use = True
        need = len(request.hash_ids) - len(hits)
        if need > self.queue.num_free_blocks:  # bigger than the cache: computed, not kept
            self._free(hits)
            return len(hits)
        new = self.queue.popleft_n(need)  # BlockPool.get_new_blocks
        for offset, block in enumerate(new, start=len(hits)):
            self._fill(block, request.hash_ids[offset] if offset < request.full else None)
        self._free(hits + new)
        return len(hits)

    def _match(self, request: _Req) -> list[_Block]:
        hits = []
        for hash_id in request.hash_ids[:request.hittable]:
            block = self.cached.get(hash_id)
            if block is None or block.in_use:
                break
            hits.append(block)
        return hits

    def _fill(self, block: _Block, hash_id: int | None) -> None:
        if block.hash_id is not None:  # evicted: its old contents are gone
            self.cached.pop(block.hash_id, None)
        block.hash_id, block.in_use = None, True
        if hash_id is not None and hash_id not in self.cached:
            block.hash_id = hash_id
            self.cached[hash_id] = block

    def _free(self, blocks: list[_Block]) -> None:
        """KVCacheManager.free: tail first; blocks without a hash go to the front."""
        ordered = list(reversed(blocks))
        for block in ordered:
            block.in_use = False
        self.queue.prepend_n([b for b in ordered if b.hash_id is None])
        self.queue.append_n([b for b in ordered if b.hash_id is not None])


def replay(requests: Sequence[TraceRequest], metas: Sequence[SessionMeta], policy: str,
           capacity_blocks: int | None, params: KvPolicy | None = None,
           block_tokens: int = BLOCK_TOKENS) -> SimResult:
    """Hit rate of one policy at one capacity (in blocks of `block_tokens` tokens)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
    views = _engine_view(requests, block_tokens)
    if policy == "infinite" or capacity_blocks is None:
        return _replay_infinite(views, block_tokens)
    if capacity_blocks <= 0:
        raise ValueError("capacity_blocks must be positive")
    if policy == "belady":
        return _replay_belady(views, capacity_blocks, block_tokens)
    params = params or KvPolicy()
    cache = BlockCache(capacity_blocks)
    tag: Callable[[SessionMeta], Retention] = (
        (lambda meta: retention(meta, params)) if policy == "session" else (lambda _: UNIFORM))
    result = SimResult(policy, capacity_blocks)
    for n, (request, meta) in enumerate(zip(views, metas, strict=True)):
        owner = meta.session_id or f"one-shot-{n}"
        _count(result, request, cache.serve(request, tag(meta), owner) * block_tokens)
    return result


def _count(result: SimResult, request: _Req, hit_tokens: int) -> None:
    result.requests += 1
    result.input_tokens += request.input_length
    result.hit_tokens += hit_tokens
    result.hits_per_request.append(hit_tokens)


def _leading_hits(request: _Req, cached: Callable[[int], bool]) -> int:
    hits = 0
    for hash_id in request.hash_ids[:request.hittable]:
        if not cached(hash_id):
            break
        hits += 1
    return hits


def _replay_infinite(requests: Sequence[_Req], block_tokens: int) -> SimResult:
    seen: set[int] = set()
    result = SimResult("infinite", None)
    for request in requests:
        _count(result, request, _leading_hits(request, seen.__contains__) * block_tokens)
        seen.update(request.hash_ids[:request.full])
    return result


def _replay_belady(requests: Sequence[_Req], capacity: int, block_tokens: int) -> SimResult:
    uses: dict[int, list[int]] = defaultdict(list)  # hash id -> indexes of requests holding it
    for i, request in enumerate(requests):
        for hash_id in request.hash_ids[:request.full]:
            uses[hash_id].append(i)
    never = len(requests)
    next_use: dict[int, int] = {}  # cached hash id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, hash id), stale entries skipped
    result = SimResult("belady", capacity)
    for i, request in enumerate(requests):
        hits = _leading_hits(request, next_use.__contains__)
        _count(result, request, hits * block_tokens)
        for hash_id in request.hash_ids[:request.full]:
            positions = uses[hash_id]
            k = bisect.bisect_right(positions, i)
            nxt = positions[k] if k < len(positions) else never
            next_use[hash_id] = nxt
            heapq.heappush(heap, (-nxt, hash_id))
        while len(next_use) > capacity:
            neg, hash_id = heapq.heappop(heap)
            if next_use.get(hash_id) == -neg:
                del next_use[hash_id]
    return result
