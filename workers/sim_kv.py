"""The simulated engine's KV blocks and prefix cache (workers/sim_engine.py): vLLM's block
pool in miniature over the KV plugin's free queue, and the sequences that hold blocks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from workers.engine import Delta, EngineConfig, EngineRequest
from workers.kvcache.freequeue import SessionFreeQueue
from workers.kvcache.policy import UNIFORM, Retention, SessionMeta, retention
from workers.sim_profile import SimProfile
from workers.sim_tokens import Sampler

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block: vLLM's default


class Block:
    __slots__ = ("block_id", "hash", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.hash: int | None = None  # set once the block is full and computed
        self.ref_cnt = 0  # requests using it; 0: in the free queue


@dataclass(eq=False)  # identity: a sequence is a key of the running dict
class Seq:
    request: EngineRequest
    prompt_ids: list[int]  # the prompt, then resumed tokens: what the engine prefills
    max_new: int
    sampler: Sampler
    retention: Retention  # of its blocks once freed
    root: int  # the hash chain's start: the cache salt and LoRA
    order: int  # arrival order, the tie-break of equal priorities
    prompt_len: int  # what the deltas report: the prompt and resumed tokens
    moved: int = 0  # output tokens moved into prompt_ids by preemptions (recomputed)
    out: asyncio.Queue[Delta | BaseException] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of its full blocks, chained
    registered: int = 0  # leading blocks offered to the prefix cache
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens in the KV cache, hit or prefilled
    done: bool = False
    held: str = ""  # output text held back: it may begin a stop string

    def cut(self, new: str, last: bool) -> tuple[str, str | None]:
        """(text to send, finish reason) after a token whose text is `new`, with the
        request's stop strings matched as vLLM matches them: the output ends before the
        first stop string and leaves it out; text that could begin one is held back until
        the next token tells."""
        stops = self.request.stop
        if not stops:
            return new, "length" if last else None
        self.held += new
        found = [self.held.find(stop) for stop in stops if stop in self.held]
        if found:
            text, self.held = self.held[:min(found)], ""
            return text, "stop"
        if last:
            text, self.held = self.held, ""
            return text, "length"
        keep = max(len(stop) for stop in stops) - 1
        text = self.held[:len(self.held) - keep] if keep else self.held
        self.held = self.held[len(text):]
        return text, None

    @property
    def owner(self) -> str:
        return self.request.session_id or self.request.request_id

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.prompt_ids)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV is computed: the newest output token is not, until the next step."""
        if not self.prefilled:
            return self.computed
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def delta(self, token_ids: tuple[int, ...], text: str, reason: str | None) -> Delta:
        return Delta(text=text, token_ids=token_ids, finished=reason is not None,
                     finish_reason=reason, prompt_tokens=self.prompt_len,
                     cached_tokens=self.cached_tokens)


class KvCache:
    """vLLM's block pool in miniature, shared by running requests (reference counts),
    over the KV plugin's free queue. workers/kvcache/sim.py is the one-request version."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.queue = SessionFreeQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> the block holding it
        self.evictions = 0

    @property
    def usage(self) -> float:
        return 1 - self.queue.num_free_blocks / len(self.blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, seq: Seq) -> bool:
        """Reserve the request's blocks, its cached prefix first; False: not enough free."""
        self._hash_upto(seq, len(seq.prompt_ids) // self.block_size)
        hits = self._match(seq.hashes[:(len(seq.prompt_ids) - 1) // self.block_size])
        need = self.blocks_for(len(seq.prompt_ids) + seq.max_new - seq.moved) - len(hits)
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)  # leave the queue when touched
        if need > self.queue.num_free_blocks - free_hits:
            return False
        self.queue.tag(seq.retention, seq.owner)
        for block in hits:  # BlockPool.touch
            self.queue.note_use(block)
            if block.ref_cnt == 0:
                self.queue.remove(block)
            block.ref_cnt += 1
        new = self.queue.popleft_n(need)
        for block in new:
            if block.hash is not None:  # its cached contents are evicted
                del self.cached[block.hash]
                block.hash = None
                self.evictions += 1
            block.ref_cnt = 1
        seq.blocks = hits + new
        seq.registered = len(hits)
        seq.computed = len(hits) * self.block_size
        if not seq.moved:  # a readmitted request's own blocks are no cache hit to report
            seq.cached_tokens = seq.computed
        return True

    def register(self, seq: Seq) -> None:
        """Offer the request's full, computed blocks to the prefix cache."""
        full = min(seq.kv_tokens // self.block_size, len(seq.blocks))
        self._hash_upto(seq, full)
        for index in range(seq.registered, full):
            block, block_hash = seq.blocks[index], seq.hashes[index]
            if block.hash is None and block_hash not in self.cached:
                block.hash = block_hash
                self.cached[block_hash] = block
        seq.registered = max(seq.registered, full)

    def free(self, seq: Seq) -> None:
        """KVCacheManager.free: tail first; blocks without a hash are reused first."""
        self.register(seq)
        self.queue.tag(seq.retention, seq.owner)
        released = []
        for block in reversed(seq.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.queue.prepend_n([b for b in released if b.hash is None])
        self.queue.append_n([b for b in released if b.hash is not None])
        seq.blocks = []

    def reset(self) -> bool:
        """Forget every cached prefix; refused (False) while a request holds blocks."""
        if any(b.ref_cnt for b in self.blocks):
            return False
        for block in self.blocks:
            block.hash = None
        self.cached.clear()
        self.queue = SessionFreeQueue(self.blocks)
        return True

    def _hash_upto(self, seq: Seq, full_blocks: int) -> None:
        if len(seq.hashes) >= full_blocks:
            return
        size, tokens = self.block_size, seq.tokens()
        while len(seq.hashes) < full_blocks:
            start = len(seq.hashes) * size
            parent = seq.hashes[-1] if seq.hashes else seq.root
            seq.hashes.append(hash((parent, tuple(tokens[start:start + size]))))

    def _match(self, hashes: list[int]) -> list[Block]:
        hits = []
        for block_hash in hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


def capacity_blocks(config: EngineConfig, profile: SimProfile) -> int:
    """The cache's blocks: the configured count, else the profile's capacity in blocks."""
    if config.kv_cache_blocks:
        return config.kv_cache_blocks
    tokens = profile.kv_capacity_tokens
    if config.kv_cache_dtype.startswith("fp8"):
        tokens *= 2  # one byte an entry instead of two
    return max(1, tokens // (config.kv_block_size or DEFAULT_BLOCK_SIZE))


def retention_of(config: EngineConfig, request: EngineRequest) -> Retention:
    """How long the request's blocks are kept once freed, by the KV plugin's policy."""
    if config.kv_policy != "session":
        return UNIFORM  # one class for every block: the queue's order is LRU
    meta = SessionMeta(session_id=request.session_id, turn=request.turn,
                       lane=request.lane, warm=request.warm)
    return retention(meta, config.kv_params)
