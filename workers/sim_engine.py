"""A simulated engine: the Engine protocol at a GPU's token rates, with no model.

`tidegate worker --engine sim` runs the whole real path (API, Redis, Celery, store, SSE)
with many workers on a small machine: each engine is one asyncio loop that sleeps the
modelled time of each step, so its CPU cost is the bookkeeping, not the model.

What is modelled (the timing figures are profiles in workers/sim_profiles.toml):

* One scheduler loop per engine, as vLLM's: each step admits waiting requests in order
  while a slot (`EngineConfig.slots`) and KV blocks are free, spends the step's token
  budget on prefill chunks, advances every decoding sequence by one token, and sleeps the
  step's time (`SimProfile.step_s`). A request's first token comes with the step that
  finishes its prefill.
* KV blocks: a request reserves blocks for its whole length (prompt and max tokens) when
  it is admitted, TensorRT-LLM's GUARANTEED_NO_EVICT policy: it waits rather than being
  preempted later (vLLM allocates as it decodes and preempts instead).
* Priority (`EngineRequest.priority`, lower first), as tidegate's vLLM runs it: waiting
  requests are admitted by priority, then arrival; while every slot is taken, a waiting
  request more urgent than the least urgent running one preempts it
  (workers/vllm_patches/priority.py). The preempted request frees its blocks and waits;
  readmitted, it prefills its prompt and the tokens it already made (its own blocks, kept
  in the prefix cache, mostly hit) and goes on with the next token.
* Prefix cache: full blocks are named by a hash chained from the first block, which
  carries the cache salt (and LoRA), as in vLLM: requests of different salts share no
  block. Freed blocks wait in the KV plugin's own queue (workers/kvcache/freequeue.py)
  ordered by `retention()`, the code the vLLM plugin and `tidegate kv replay` run. A hit
  shortens prefill: cached tokens cost no prefill time. The last prompt token is always
  computed, so a prompt that is all cached blocks hits one block less.
* Tokens: ordinary ids of the checkpoint's tokenizer, each a hash of (prompt, LoRA,
  position, and for sampling the seed, or the request id without one). So greedy requests
  with one prompt agree, seeds repeat, and a resumed request (same job id) continues the
  very sequence it was cut from. A tiny top_p leaves one candidate: seeds then agree.

Stop strings end a request as in vLLM (matched in the output text, left out of it).

Not modelled: end-of-sequence (every request runs to its max tokens unless a stop string
ends it, like the test checkpoint), preemption for KV blocks, LoRA or sampling costs, CUDA graph
padding. Not there at all (`capabilities`): n > 1, logprobs, penalties, logit_bias, top_k,
min_p, structured output, tools.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import math
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tidegate import capabilities as cap
from workers.engine import (
    Delta,
    EngineConfig,
    EngineDead,
    EngineError,
    EngineRequest,
    EngineStats,
    check_kv_policy,
    warm_prompts,
)
from workers.kvcache.freequeue import SessionFreeQueue
from workers.kvcache.policy import UNIFORM, Retention, SessionMeta, retention
from workers.kvcache.stats import EWMA_ALPHA

log = logging.getLogger("tidegate.worker")

PROFILES_FILE = Path(__file__).with_name("sim_profiles.toml")
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block: vLLM's default
SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature is greedy decoding
CANDIDATES = 64  # tokens a sampling step chooses among at top_p 1
# A step that overslept by less than this is made up by shorter sleeps after it, so timer
# slack does not slow the modelled rate; a longer stall is not made up in a burst.
CATCH_UP_S = 0.05
_MASK = (1 << 64) - 1


# --- the timing model --------------------------------------------------------------


@dataclass(frozen=True)
class SimProfile:
    """What one step costs; workers/sim_profiles.toml explains each figure."""

    name: str
    prefill_ms_per_token: float = 0.0  # each uncached prompt token
    decode_base_ms: float = 0.0  # one forward pass: the weights read once a step
    decode_ms_per_seq: float = 0.0  # each sequence decoding in the step
    decode_ms_per_1k_kv_tokens: float = 0.0  # attention reading the decoders' KV cache
    max_batched_tokens: int = 0  # tokens one step computes (decodes, prefill); 0: no limit
    kv_capacity_tokens: int = 1_000_000  # with 16-bit entries; an FP8 KV cache holds twice
    # A fresh worker's engine load and warm-up, and a standby worker's activation (warm the
    # lane's prefixes, add_consumer): played only on a replay clock, compressed by its
    # speed-up (`SimEngine(startup_scale=...)`); elsewhere a sim engine starts at once.
    cold_start_s: float = 0.0
    activation_s: float = 0.0

    def step_s(self, decoding: int, kv_tokens: int, prefill_tokens: int) -> float:
        """Seconds of one step that decodes `decoding` sequences holding `kv_tokens`
        tokens of KV cache between them and computes `prefill_tokens` prompt tokens."""
        if not decoding and not prefill_tokens:
            return 0.0
        ms = (self.decode_base_ms + self.decode_ms_per_seq * decoding
              + self.decode_ms_per_1k_kv_tokens * kv_tokens / 1000
              + self.prefill_ms_per_token * prefill_tokens)
        return ms / 1000


def load_profile(name: str, path: Path = PROFILES_FILE) -> SimProfile:
    """A named profile; an unknown name or a bad field is an EngineError naming it."""
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise EngineError(f"sim profiles {path}: {exc}") from None
    body = profiles.get(name)
    if not isinstance(body, dict):
        raise EngineError(f"unknown sim profile {name!r}; known: {', '.join(sorted(profiles))}")
    known = {f.name: f for f in fields(SimProfile) if f.name != "name"}
    values: dict[str, Any] = {}
    for key, value in body.items():
        if key == "description":
            continue
        if key not in known:
            raise EngineError(f"sim profile {name!r}: unknown field {key!r}; "
                              f"fields: {', '.join(known)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise EngineError(f"sim profile {name!r}: {key} must be a number >= 0, "
                              f"not {value!r}")
        values[key] = int(value) if known[key].type == "int" else float(value)
    return SimProfile(name=name, **values)


# --- tokens ------------------------------------------------------------------------


class Vocab:
    """The checkpoint's tokenizer, and the ids the engine emits: ordinary tokens whose text
    stands alone (no special token, no piece of a multi-byte character), so the streamed
    texts join into the text of the ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids) | set(
            getattr(tokenizer, "added_tokens_decoder", {}))
        # Decoded once at start: a token's text is then a list lookup on every step.
        self.text = [tokenizer.decode([i]) for i in range(len(tokenizer))]
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
class _Sampler:
    """Which token a request gets at each output position."""

    stream: int  # the prompt's (and LoRA's) greedy stream
    choice: int  # the seed's stream; unused when candidates == 1
    candidates: int  # tokens each step chooses among: 1 is greedy

    @classmethod
    def of(cls, request: EngineRequest) -> _Sampler:
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


# --- KV blocks and the prefix cache --------------------------------------------------


class _Block:
    __slots__ = ("block_id", "hash", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.hash: int | None = None  # set once the block is full and computed
        self.ref_cnt = 0  # requests using it; 0: in the free queue


@dataclass(eq=False)  # identity: a sequence is a key of the running dict
class _Seq:
    request: EngineRequest
    prompt_ids: list[int]  # the prompt, then resumed tokens: what the engine prefills
    max_new: int
    sampler: _Sampler
    retention: Retention  # of its blocks once freed
    root: int  # the hash chain's start: the cache salt and LoRA
    order: int  # arrival order, the tie-break of equal priorities
    prompt_len: int  # what the deltas report: the prompt and resumed tokens
    moved: int = 0  # output tokens moved into prompt_ids by preemptions (recomputed)
    out: asyncio.Queue[Delta | BaseException] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[_Block] = field(default_factory=list)
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
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.queue = SessionFreeQueue(self.blocks)
        self.cached: dict[int, _Block] = {}  # block hash -> the block holding it
        self.evictions = 0

    @property
    def usage(self) -> float:
        return 1 - self.queue.num_free_blocks / len(self.blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, seq: _Seq) -> bool:
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

    def register(self, seq: _Seq) -> None:
        """Offer the request's full, computed blocks to the prefix cache."""
        full = min(seq.kv_tokens // self.block_size, len(seq.blocks))
        self._hash_upto(seq, full)
        for index in range(seq.registered, full):
            block, block_hash = seq.blocks[index], seq.hashes[index]
            if block.hash is None and block_hash not in self.cached:
                block.hash = block_hash
                self.cached[block_hash] = block
        seq.registered = max(seq.registered, full)

    def free(self, seq: _Seq) -> None:
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

    def _hash_upto(self, seq: _Seq, full_blocks: int) -> None:
        if len(seq.hashes) >= full_blocks:
            return
        size, tokens = self.block_size, seq.tokens()
        while len(seq.hashes) < full_blocks:
            start = len(seq.hashes) * size
            parent = seq.hashes[-1] if seq.hashes else seq.root
            seq.hashes.append(hash((parent, tuple(tokens[start:start + size]))))

    def _match(self, hashes: list[int]) -> list[_Block]:
        hits = []
        for block_hash in hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


# --- the engine --------------------------------------------------------------------


def _rank(seq: _Seq) -> tuple[int, int]:
    """The scheduler's order: priority (lower first), then arrival."""
    return seq.request.priority, seq.order


class SimEngine:
    kind = "sim"
    # Stop strings (matched in its text, as vLLM does) and LoRA adapters by name. It has no
    # logits, so no logprobs, penalties, logit_bias, top_k or min_p; no n (one sequence a
    # request), no structured output, no tools: admission refuses requests that need them
    # on a lane only sim workers serve (tidegate/capabilities.py).
    capabilities = frozenset({cap.STOP, cap.LORA})

    def __init__(self, config: EngineConfig, profile: str | SimProfile = "instant",
                 vocab: Vocab | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 startup_scale: float | None = None) -> None:
        """startup_scale: play the profile's cold start and activation times divided by
        this (a replay clock's speed-up); None: start and warm at once."""
        check_kv_policy(config.kv_policy)
        self.config = config
        self._startup_scale = startup_scale
        self.profile = profile if isinstance(profile, SimProfile) else load_profile(profile)
        self._vocab = vocab  # loaded by start() unless given (tests share one)
        self._sleep, self._clock = sleep, clock  # a fake pair makes the timing testable
        self._kv = KvCache(self._capacity_blocks(), config.kv_block_size or DEFAULT_BLOCK_SIZE)
        self._waiting: list[_Seq] = []  # by priority, then arrival (_rank)
        self._arrivals = 0
        self._running: dict[_Seq, None] = {}  # in admission order
        self._live: dict[str, _Seq] = {}  # request id -> its newest sequence
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._step_end = 0.0  # the modelled end of the last step, on `clock`
        self._counts = {"max_running_seen": 0, "queries": 0, "hits": 0, "aborted": 0,
                        "preempted": 0}
        self._finished: dict[str, int] = {}
        self._alloc_ms: float | None = None

    def _capacity_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_blocks:
            return cfg.kv_cache_blocks
        tokens = self.profile.kv_capacity_tokens
        if cfg.kv_cache_dtype.startswith("fp8"):
            tokens *= 2  # one byte an entry instead of two
        return max(1, tokens // (cfg.kv_block_size or DEFAULT_BLOCK_SIZE))

    async def start(self) -> None:
        if self._vocab is None:
            self._vocab = await asyncio.to_thread(Vocab.load, self.config.model)
        # The start's warm-up (workers/host.py) plays the activation time: the two add up
        # to the profile's cold start.
        await self._startup(self.profile.cold_start_s - self.profile.activation_s)
        self._step_end = self._clock()
        self._task = asyncio.create_task(self._run(), name="sim-engine")
        self._task.add_done_callback(self._on_loop_end)

    # --- requests ----------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        seq = self._new_seq(request)
        bisect.insort(self._waiting, seq, key=_rank)
        self._live[request.request_id] = seq
        self._work.set()
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not seq.done:  # the caller left (cancelled): the engine aborts it, as vLLM's
                self._end(seq, "abort")

    def _new_seq(self, request: EngineRequest) -> _Seq:
        if self._failure is not None:
            raise EngineDead(f"the sim engine's loop died: {self._failure!r}")
        if self._vocab is None or self._task is None:
            raise EngineError("the sim engine is not started")
        lora = request.lora
        if lora is not None and lora not in dict(self.config.lora_adapters):
            raise EngineError(f"unknown LoRA adapter {lora!r}")
        prompt_ids = self._vocab.encode(request.prompt) + list(request.resume_token_ids)
        room = self.config.max_model_len - len(prompt_ids)
        if room <= 0:
            raise EngineError(f"The decoder prompt (length {len(prompt_ids)}) is longer than "
                              f"the maximum model length of {self.config.max_model_len}.")
        if request.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {request.max_tokens}")
        max_new = min(request.max_tokens, room)
        blocks = self._kv.blocks_for(len(prompt_ids) + max_new)
        if blocks > len(self._kv.blocks):
            raise EngineError(f"the request needs {blocks} KV blocks; the cache holds "
                              f"{len(self._kv.blocks)}")
        self._arrivals += 1
        return _Seq(request=request, prompt_ids=prompt_ids, max_new=max_new,
                    sampler=_Sampler.of(request), retention=self._retention(request),
                    root=hash(("root", request.cache_salt, lora)), order=self._arrivals,
                    prompt_len=len(prompt_ids))

    def _retention(self, request: EngineRequest) -> Retention:
        if self.config.kv_policy != "session":
            return UNIFORM  # one class for every block: the queue's order is LRU
        meta = SessionMeta(session_id=request.session_id, turn=request.turn,
                           lane=request.lane, warm=request.warm)
        return retention(meta, self.config.kv_params)

    async def abort(self, request_id: str) -> None:
        seq = self._live.get(request_id)
        if seq is None or seq.done:
            return
        self._end(seq, "abort")
        seq.out.put_nowait(seq.delta((), "", "abort"))

    def _end(self, seq: _Seq, reason: str) -> None:
        """The request leaves the engine: its blocks go back, its outcome is counted."""
        seq.done = True
        if seq in self._running:
            del self._running[seq]
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if seq.blocks:
            self._kv.free(seq)
        if self._live.get(seq.request.request_id) is seq:
            del self._live[seq.request.request_id]
        if reason == "abort":  # vLLM's iteration stats leave client aborts out too
            self._counts["aborted"] += 1
        else:
            self._finished[reason] = self._finished.get(reason, 0) + 1
        self._work.set()  # a slot or blocks came free

    # --- the scheduler loop --------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._running and not self._waiting:
                await self._idle()
                continue
            self._admit()
            decoding, chunks = self._plan()
            if not decoding and not chunks:  # waiting on blocks no step will free
                await self._idle()
                continue
            kv_tokens = sum(s.kv_tokens for s in decoding)
            await self._pace(self.profile.step_s(len(decoding), kv_tokens,
                                                 sum(n for _, n in chunks)))
            self._advance(decoding, chunks)

    async def _idle(self) -> None:
        self._work.clear()
        await self._work.wait()
        self._step_end = self._clock()  # an idle spell is not made up by short steps

    def _admit(self) -> None:
        """Waiting requests in order while a slot and their blocks are free (the first
        that does not fit stops the rest, as in vLLM)."""
        self._make_room()
        if not self._waiting or len(self._running) >= self.config.slots:
            return
        started = time.perf_counter()
        while self._waiting and len(self._running) < self.config.slots:
            seq = self._waiting[0]
            if not self._kv.allocate(seq):
                break
            self._waiting.pop(0)
            self._running[seq] = None
            if not seq.moved:  # a readmission is no new query of the prefix cache
                self._counts["queries"] += len(seq.prompt_ids)
                self._counts["hits"] += seq.cached_tokens
        self._note_alloc_ms((time.perf_counter() - started) * 1000)
        counts = self._counts
        counts["max_running_seen"] = max(counts["max_running_seen"], len(self._running))

    def _make_room(self) -> None:
        """While every slot is taken, the least urgent running request gives its slot to a
        more urgent waiting one (never to an equal one)."""
        while self._waiting and len(self._running) >= self.config.slots:
            victim = max(self._running, key=_rank)
            if self._waiting[0].request.priority >= victim.request.priority:
                return
            self._preempt(victim)

    def _preempt(self, seq: _Seq) -> None:
        """Back to waiting with its blocks freed; what it generated becomes prompt to
        recompute, so its next token follows its last one."""
        del self._running[seq]
        self._kv.free(seq)
        seq.prompt_ids = seq.prompt_ids + seq.output_ids
        seq.moved += len(seq.output_ids)
        seq.output_ids = []
        seq.computed = 0
        bisect.insort(self._waiting, seq, key=_rank)
        self._counts["preempted"] += 1

    def _note_alloc_ms(self, ms: float) -> None:
        """The recent mean, as the vLLM plugin reports it (workers/kvcache/stats.py)."""
        prev = self._alloc_ms
        self._alloc_ms = ms if prev is None else prev + EWMA_ALPHA * (ms - prev)

    def _plan(self) -> tuple[list[_Seq], list[tuple[_Seq, int]]]:
        """This step's decoders, and its prefill chunks within the token budget."""
        budget = self.profile.max_batched_tokens or sys.maxsize
        decoding = [s for s in self._running if s.prefilled]
        budget -= len(decoding)
        chunks = []
        for seq in self._running:
            if budget <= 0:
                break
            if not seq.prefilled:
                n = min(len(seq.prompt_ids) - seq.computed, budget)
                chunks.append((seq, n))
                budget -= n
        return decoding, chunks

    async def _pace(self, step_s: float) -> None:
        """Sleep until the step's modelled end."""
        now = self._clock()
        self._step_end = max(self._step_end, now - CATCH_UP_S) + step_s
        await self._sleep(max(0.0, self._step_end - now))

    def _advance(self, decoding: list[_Seq], chunks: list[tuple[_Seq, int]]) -> None:
        for seq in decoding:
            if not seq.done:  # aborted while the step ran
                self._emit(seq)
        for seq, n in chunks:
            if seq.done:
                continue
            seq.computed += n
            self._kv.register(seq)
            if seq.prefilled:
                self._emit(seq)

    def _emit(self, seq: _Seq) -> None:
        assert self._vocab is not None
        position = len(seq.request.resume_token_ids) + seq.moved + len(seq.output_ids)
        token = seq.sampler.token(self._vocab, position)
        seq.output_ids.append(token)
        made = seq.moved + len(seq.output_ids)
        text, reason = seq.cut(self._vocab.text[token], made >= seq.max_new)
        seq.out.put_nowait(seq.delta((token,), text, reason))
        if reason is not None:
            self._end(seq, reason)

    def _on_loop_end(self, task: asyncio.Task[None]) -> None:
        """The loop only ends cancelled (shutdown) or on a bug: then every live request
        fails, and `stats` says the engine is dead so the worker restarts."""
        if task.cancelled() or task.exception() is None:
            return
        self._failure = task.exception()
        log.error("the sim engine's loop died", exc_info=self._failure)
        for seq in list(self._live.values()):
            seq.out.put_nowait(EngineDead(f"the sim engine's loop died: {self._failure!r}"))

    # --- the rest of the protocol --------------------------------------------------

    async def warm(self, prompts: list[str]) -> None:
        await self._startup(self.profile.activation_s)
        await warm_prompts(self, prompts)

    async def _startup(self, modelled_s: float) -> None:
        if self._startup_scale is not None and modelled_s > 0:
            await self._sleep(modelled_s / self._startup_scale)

    async def reset_prefix_cache(self) -> bool:
        return self._kv.reset()

    def stats(self) -> EngineStats:
        if self._failure is not None:
            raise EngineDead(f"the sim engine's loop died: {self._failure!r}")
        counts = self._counts
        return EngineStats(
            kind=self.kind, running=len(self._running), waiting=len(self._waiting),
            max_running_seen=counts["max_running_seen"], kv_usage=self._kv.usage,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_capacity_tokens=len(self._kv.blocks) * self._kv.block_size,
            prefix_queries_tokens=counts["queries"], prefix_hits_tokens=counts["hits"],
            finished_by_reason=dict(self._finished),
            unfinished=len(self._running) + len(self._waiting), aborted=counts["aborted"],
            kv_policy=self.config.kv_policy,
            avg_cache_allocation_latency_ms=self._alloc_ms, kv_evictions=self._kv.evictions,
        )

    async def shutdown(self) -> None:
        for seq in list(self._live.values()):
            await self.abort(seq.request.request_id)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
