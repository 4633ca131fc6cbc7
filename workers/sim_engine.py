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

The engine and its scheduler loop are here; the timing model is workers/sim_profile.py,
the tokens workers/sim_tokens.py, the KV blocks and prefix cache workers/sim_kv.py.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection

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
from workers.kvcache.stats import EWMA_ALPHA
from workers.sim_kv import DEFAULT_BLOCK_SIZE, KvCache, Seq, capacity_blocks, retention_of
from workers.sim_profile import SimProfile, load_profile
from workers.sim_tokens import Sampler, Vocab

log = logging.getLogger("tidegate.worker")

# A step that overslept by less than this is made up by shorter sleeps after it, so timer
# slack does not slow the modelled rate; a longer stall is not made up in a burst.
CATCH_UP_S = 0.05


def _plan(running: Collection[Seq],
          max_batched_tokens: int) -> tuple[list[Seq], list[tuple[Seq, int]]]:
    """This step's decoders, and its prefill chunks within the token budget (0: none)."""
    budget = max_batched_tokens or sys.maxsize
    decoding = [s for s in running if s.prefilled]
    budget -= len(decoding)
    chunks = []
    for seq in running:
        if budget <= 0:
            break
        if not seq.prefilled:
            n = min(len(seq.prompt_ids) - seq.computed, budget)
            chunks.append((seq, n))
            budget -= n
    return decoding, chunks


def _mean(prev: float | None, ms: float) -> float:
    """The recent mean allocation time, as the vLLM plugin reports it
    (workers/kvcache/stats.py)."""
    return ms if prev is None else prev + EWMA_ALPHA * (ms - prev)


def _rank(seq: Seq) -> tuple[int, int]:
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
        self._kv = KvCache(capacity_blocks(config, self.profile),
                           config.kv_block_size or DEFAULT_BLOCK_SIZE)
        self._waiting: list[Seq] = []  # by priority, then arrival (_rank)
        self._arrivals = 0
        self._running: dict[Seq, None] = {}  # in admission order
        self._live: dict[str, Seq] = {}  # request id -> its newest sequence
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._step_end = 0.0  # the modelled end of the last step, on `clock`
        self._counts = {"max_running_seen": 0, "queries": 0, "hits": 0, "aborted": 0,
                        "preempted": 0}
        self._finished: dict[str, int] = {}
        self._alloc_ms: float | None = None

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

    def _new_seq(self, request: EngineRequest) -> Seq:
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
        return Seq(request=request, prompt_ids=prompt_ids, max_new=max_new,
                    sampler=Sampler.of(request), retention=retention_of(self.config, request),
                    root=hash(("root", request.cache_salt, lora)), order=self._arrivals,
                    prompt_len=len(prompt_ids))

    async def abort(self, request_id: str) -> None:
        seq = self._live.get(request_id)
        if seq is None or seq.done:
            return
        self._end(seq, "abort")
        seq.out.put_nowait(seq.delta((), "", "abort"))

    def _end(self, seq: Seq, reason: str) -> None:
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
            decoding, chunks = _plan(self._running, self.profile.max_batched_tokens)
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
        self._alloc_ms = _mean(self._alloc_ms, (time.perf_counter() - started) * 1000)
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

    def _preempt(self, seq: Seq) -> None:
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

    async def _pace(self, step_s: float) -> None:
        """Sleep until the step's modelled end."""
        now = self._clock()
        self._step_end = max(self._step_end, now - CATCH_UP_S) + step_s
        await self._sleep(max(0.0, self._step_end - now))

    def _advance(self, decoding: list[Seq], chunks: list[tuple[Seq, int]]) -> None:
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

    def _emit(self, seq: Seq) -> None:
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
