"""TensorRT-LLM adapter over its LLM API: `LLM.generate_async(..., streaming=True)`.

GPU only. `tensorrt_llm` is imported inside methods, never at module import: its bindings
need libcuda, and this module must import on machines without a GPU (tests, the API).

Which backend runs the model:

* a directory holding a built TensorRT engine (its config.json has `build_config`) runs
  on the TensorRT backend (`tensorrt_llm._tensorrt_engine.LLM`): precision was fixed
  when the engine was built, so start() only checks that it is what the lane asks for;
* anything else (a Hugging Face checkpoint) runs on the default PyTorch backend
  (`tensorrt_llm.LLM`), unless the engine is made with `backend="tensorrt"`, which
  builds an engine from the checkpoint at start.

Precision (EngineConfig -> LLM arguments), as the two backends accept it:

| EngineConfig         | PyTorch backend                   | TensorRT backend (build)             |
|----------------------|-----------------------------------|--------------------------------------|
| dtype                | LLM(dtype=...)                    | LLM(dtype=...)                       |
| kv_cache_dtype "fp8" | KvCacheConfig(dtype="fp8")        | QuantConfig(kv_cache_quant_algo=FP8) |
| quantization "fp8"   | an FP8 checkpoint (ModelOpt) only | QuantConfig(quant_algo=FP8)          |

The PyTorch backend rejects `quant_config` (a TensorRT-backend argument) and quantizes
weights only as the checkpoint says; the TensorRT backend rejects `KvCacheConfig.dtype`.
A checkpoint or engine whose precision differs from the lane's is refused at start,
because a finance lane must never serve FP8 without anyone noticing.

The pure helpers (backend choice, the argument mapping, folding iteration stats, the KV
retention plan) import nothing from TensorRT-LLM, so tests/test_trtllm_mapping.py checks
them on any machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tidegate import capabilities as cap
from workers.engine import (
    Delta,
    EngineConfig,
    EngineError,
    EngineRequest,
    EngineStats,
    check_kv_policy,
    warm_prompts,
)
from workers.kvcache.policy import MAX_PRIORITY, SessionMeta, retention

if TYPE_CHECKING:  # TensorRT-LLM's types (where it is installed: a GPU node)
    from tensorrt_llm.executor import GenerationResult
    from tensorrt_llm.llmapi import GuidedDecodingParams, KvCacheRetentionConfig, RequestOutput
    from tensorrt_llm.llmapi.llm import BaseLLM

log = logging.getLogger("tidegate.trtllm")

UNAVAILABLE = "TensorRT-LLM is not installed / needs an NVIDIA GPU"
PYTORCH, TENSORRT = "pytorch", "tensorrt"
FP8 = "FP8"  # QuantAlgo member name, for both weights and KV cache
STATS_TIMEOUT_S = 1.0  # how long one get_stats call waits for iteration stats
STATS_IDLE_S = 0.2  # pause between polls when the engine reported nothing
# TensorRT-LLM reports its finish reasons in its own words; the protocol's are these.
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}
Precision = tuple[str | None, str | None]  # (weights, KV cache) as QuantAlgo names; None: 16-bit


# --- pure helpers: no tensorrt_llm import below until TrtllmEngine ---------------------


def unavailable_reason() -> str | None:
    """Why TensorRT-LLM cannot run in this process, or None when it can."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return UNAVAILABLE
    try:
        import torch

        if not torch.cuda.is_available():
            return f"{UNAVAILABLE} (no CUDA device visible)"
        import tensorrt_llm  # noqa: F401  # its bindings load libcuda: a real check
    except Exception as exc:  # ImportError, OSError for a missing libcuda, ...
        return f"{UNAVAILABLE} ({type(exc).__name__}: {exc})"
    return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def detect_backend(model: str) -> str:
    """A built TensorRT engine directory runs on the TensorRT backend, the rest on PyTorch."""
    config = read_json(Path(model) / "config.json")
    return TENSORRT if "build_config" in config and "pretrained_config" in config else PYTORCH


def is_fp8(value: str | None) -> bool:
    if value in ("fp8_e5m2",):  # vLLM knows it; TensorRT-LLM's FP8 is E4M3 only
        raise EngineError("TensorRT-LLM's FP8 is E4M3: use 'fp8' or 'fp8_e4m3'")
    return value in ("fp8", "fp8_e4m3")


def wanted_precision(config: EngineConfig) -> Precision:
    """(weight quant algo, KV cache quant algo) the lane asks for, as QuantAlgo names."""
    return (FP8 if is_fp8(config.quantization) else None,
            FP8 if is_fp8(config.kv_cache_dtype) else None)


def checkpoint_precision(model: str) -> Precision:
    """(weights, KV cache) quant algos a Hugging Face checkpoint carries: NVIDIA ModelOpt
    writes hf_quant_config.json; other FP8 checkpoints put `quantization_config` in
    config.json (`quant_method: fp8`)."""
    modelopt = read_json(Path(model) / "hf_quant_config.json").get("quantization") or {}
    if modelopt:
        return _algo(modelopt.get("quant_algo")), _algo(modelopt.get("kv_cache_quant_algo"))
    hf = read_json(Path(model) / "config.json").get("quantization_config") or {}
    return _algo(hf.get("quant_algo") or hf.get("quant_method")), _algo(
        hf.get("kv_cache_quant_algo"))


def engine_precision(model: str) -> Precision:
    """(weights, KV cache) quant algos a built TensorRT engine was built with."""
    pretrained = read_json(Path(model) / "config.json").get("pretrained_config") or {}
    quant = pretrained.get("quantization") or {}
    return _algo(quant.get("quant_algo")), _algo(quant.get("kv_cache_quant_algo"))


def _algo(value: object) -> str | None:
    return str(value).upper() if value else None  # files write "FP8", "fp8" or null


def precision_problem(wanted: Precision, found: Precision, backend: str,
                      built: bool) -> str | None:
    """Why the model directory cannot serve the lane's precision, or None.
    `found` is what the checkpoint or built engine already fixes."""
    if built and backend != TENSORRT:
        return "a built TensorRT engine runs only on TensorRT-LLM's TensorRT backend"
    if built and found != wanted:  # precision was fixed when the engine was built
        return f"the TensorRT engine has {_show(found)}; the lane asks for {_show(wanted)}"
    for have, want in zip(found, wanted, strict=True):
        if have is not None and have != want:  # the checkpoint would override the lane
            return f"the checkpoint has {_show(found)}; the lane asks for {_show(wanted)}"
    if backend == PYTORCH and wanted[0] != found[0]:
        return ("quantization 'fp8' on TensorRT-LLM's PyTorch backend needs an FP8 "
                "checkpoint (NVIDIA ModelOpt); this one has 16-bit weights")
    return None


def _show(precision: Precision) -> str:
    return f"weights {precision[0] or '16-bit'}, KV cache {precision[1] or '16-bit'}"


def llm_kwargs(config: EngineConfig, backend: str, found: Precision = (None, None),
               built: bool = False) -> dict[str, Any]:
    """Keyword arguments for LLM(...), nested configs as plain dicts (`_make_llm` turns
    them into KvCacheConfig / QuantConfig). Raises EngineError when the model directory
    cannot serve the lane's precision on that backend."""
    wanted = wanted_precision(config)
    if (problem := precision_problem(wanted, found, backend, built)) is not None:
        raise EngineError(problem)
    kv: dict[str, Any] = {"enable_block_reuse": config.enable_prefix_caching}
    kwargs: dict[str, Any] = {"model": config.model, "dtype": config.dtype,
                              "max_batch_size": config.slots,
                              "max_seq_len": config.max_model_len, "kv_cache_config": kv,
                              # structured output (response_format): TensorRT-LLM's guided
                              # decoding needs its grammar backend chosen at start
                              "guided_decoding_backend": GUIDED_BACKEND}
    if backend == PYTORCH:
        kv["dtype"] = "fp8" if wanted[1] else "auto"
        kwargs["enable_iter_perf_stats"] = True  # off by default there; stats() needs it
    elif not built:  # the TensorRT backend quantizes while it builds the engine
        kwargs["quant_config"] = {"quant_algo": wanted[0], "kv_cache_quant_algo": wanted[1]}
    return kwargs


GUIDED_BACKEND = "llguidance"  # as the vLLM adapter's: the widest JSON Schema coverage


def guided_decoding(guided: dict[str, Any] | None) -> dict[str, GuidedDecodingParams]:
    """SamplingParams' `guided_decoding` for a job's structured output ({"json": schema}
    or {"json_object": True}: api/openai_tools.py), as TensorRT-LLM's GuidedDecodingParams
    takes it (the same field names); {} for none."""
    if not guided:
        return {}
    from tensorrt_llm.llmapi import GuidedDecodingParams

    fields = {name: guided[name] for name in ("json", "json_object") if name in guided}
    return {"guided_decoding": GuidedDecodingParams(**fields)}


def clamp_max_tokens(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> int:
    """What vLLM does at its context limit: refuse a prompt that leaves no room, and stop
    a generation at the limit with finish reason "length" instead of failing it."""
    if prompt_tokens >= max_seq_len:
        raise EngineError(
            f"This model's maximum context length is {max_seq_len} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for output.")
    return max(1, min(max_tokens, max_seq_len - prompt_tokens))


def sampling_seed(request: EngineRequest) -> int:
    """TensorRT-LLM samples every unseeded request with the same default seed (0), so equal
    prompts would get equal "random" answers; vLLM draws a fresh one. Do as vLLM does."""
    return request.seed if request.seed is not None else random.getrandbits(63)


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(str(reason), str(reason))


def fold_iteration(stats: EngineStats, iteration: dict[str, Any] | str) -> None:
    """Fold one iteration's stats (a dict, or its JSON as some versions return it) into
    `stats`. KV block counters are cumulative since start; hits are counted per block."""
    it = json.loads(iteration) if isinstance(iteration, str) else iteration
    stats.running = int(it.get("numActiveRequests", stats.running))
    stats.waiting = int(it.get("numQueuedRequests", stats.waiting))
    stats.max_running_seen = max(stats.max_running_seen, stats.running)
    kv = it.get("kvCacheStats") or {}
    if not kv:
        return
    per_block = int(kv.get("tokensPerBlock", 0))
    total = int(kv.get("maxNumBlocks", 0))
    if total:
        stats.kv_usage = int(kv.get("usedNumBlocks", 0)) / total
        stats.kv_capacity_tokens = total * per_block
    reused, missed = int(kv.get("reusedBlocks", 0)), int(kv.get("missedBlocks", 0))
    stats.prefix_hits_tokens = max(stats.prefix_hits_tokens, reused * per_block)
    stats.prefix_queries_tokens = max(stats.prefix_queries_tokens, (reused + missed) * per_block)


# --- KV cache retention: the session policy as a per-request KvCacheRetentionConfig ------
#
# TensorRT-LLM evicts free blocks lowest priority first (0-100, default 35), LRU inside a
# priority, and drops a block back to 35 `duration_ms` after it was last freed (re-armed
# at every release); a request sets the priority of the blocks it allocates *or reuses*.
# That is workers/kvcache/policy.py's order, so the policy maps onto it request by request
# (no plugin, unlike vLLM).
#
# `Retention.shared_priority` has no per-request equivalent. Reuse is decided inside the
# KV cache manager when a request is admitted, so the request cannot say which of its
# blocks another request already holds; and a block does not keep the highest priority any
# request gave it: LRUEvictionPolicy::claimBlock overwrites priority and duration with
# those of the request that reuses it ("New priority values always override the previous
# value", cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp). So every request states the
# class of the prefix it knows to be shared, its system turn (`shared_prefix_tokens`,
# counted by the API): that range gets shared_priority whoever reuses it, and a one-shot
# request cannot demote a lane's system prompt. Other shared prefixes (a document two
# requests both quote) take the class of their last user.


class TokenRange(NamedTuple):
    """One TokenRangeRetentionConfig, as plain data."""

    start: int  # first prompt token
    end: int | None  # one past the last; None: to the end of the prompt
    priority: int  # 0-100
    duration_ms: int | None  # then the blocks fall to 35; None: never


@dataclass(frozen=True)
class RetentionPlan:
    """A KvCacheRetentionConfig as plain data, so tests check it without TensorRT-LLM."""

    ranges: tuple[TokenRange, ...]  # prompt tokens (TokenRangeRetentionConfig)
    decode_priority: int  # generated tokens' blocks
    decode_duration_ms: int | None


def retention_ranges(request: EngineRequest, config: EngineConfig) -> RetentionPlan | None:
    """The request's retention under the lane's KV policy; None: TensorRT-LLM's default
    (every block at 35, plain LRU), which is what "lru" asks for."""
    check_kv_policy(config.kv_policy)
    if config.kv_policy == "lru":
        return None
    meta = SessionMeta(session_id=request.session_id, turn=request.turn, lane=request.lane,
                       warm=request.warm)
    kept = retention(meta, config.kv_params)
    priority = clamp_priority(kept.priority)
    duration_ms = None if kept.duration_s is None else round(kept.duration_s * 1000)
    ranges: tuple[TokenRange, ...] = (TokenRange(0, None, priority, duration_ms),)
    shared = request.shared_prefix_tokens
    if shared > 0:  # the system turn is every request's: it keeps the shared class
        top = clamp_priority(max(priority, kept.shared_priority))
        ranges = (TokenRange(0, shared, top, duration_ms),
                  TokenRange(shared, None, priority, duration_ms))
    # Decode blocks get the same class: the next turn's prompt is this one, the answer
    # and a new message, so the answer's blocks are part of the prefix it reuses.
    return RetentionPlan(ranges, priority, duration_ms)


def clamp_priority(priority: int) -> int:
    """TensorRT-LLM refuses a priority outside 0-100 (the request fails), so clamp."""
    return max(0, min(MAX_PRIORITY, int(priority)))


def as_timedelta(duration_ms: int | None) -> timedelta | None:
    """The bindings take durations as std::chrono::milliseconds, which converts from a
    timedelta (a bare number would be rejected, or read as seconds)."""
    return None if duration_ms is None else timedelta(milliseconds=duration_ms)


# --- the adapter ------------------------------------------------------------------------


class TrtllmEngine:
    kind = "trtllm"
    # What this adapter carries to TensorRT-LLM today: stop strings, and structured output
    # (its guided decoding: `guided_decoding`). Its SamplingParams has n, penalties and
    # logprobs too; until the adapter passes them, admission sends requests that need them
    # to the lane's vLLM pool, or refuses them (a 400). Tools: no tool parser here.
    capabilities = frozenset({cap.STOP, cap.STRUCTURED_OUTPUT})

    def __init__(self, config: EngineConfig, backend: str | None = None) -> None:
        self.config = config
        self.backend = backend  # None: chosen from the model directory at start
        self._llm: Any = None
        self._results: dict[str, GenerationResult] = {}  # request id -> its result, while it runs
        self._lock = threading.Lock()  # stats() is called from heartbeat threads
        self._stats = EngineStats(kind=self.kind, kv_cache_dtype=config.kv_cache_dtype,
                                  kv_policy=config.kv_policy)
        self._poller: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        check_kv_policy(self.config.kv_policy)  # a lane misconfiguration, on any machine
        if (reason := unavailable_reason()) is not None:
            raise EngineError(reason)
        model = self.config.model
        built = detect_backend(model) == TENSORRT
        found = engine_precision(model) if built else checkpoint_precision(model)
        backend = self.backend or (TENSORRT if built else PYTORCH)
        kwargs = llm_kwargs(self.config, backend, found, built)
        # Built in the loop thread on purpose: results bind to the loop they are made in.
        self._llm = _make_llm(kwargs, backend)
        await self._probe()
        self._poller = asyncio.get_running_loop().create_task(self._poll_stats())

    async def _probe(self) -> None:
        """One 1-token request: its iteration stats carry the KV pool size, so stats()
        reports the capacity right after start, as the vLLM adapter does."""
        async for _ in self.generate(EngineRequest(f"probe-{os.getpid()}", "warm up", 1)):
            pass
        await self._drain_stats()

    def retention_for(self, request: EngineRequest) -> KvCacheRetentionConfig | None:
        """The request's KvCacheRetentionConfig (session priority instead of LRU), built
        from `retention_ranges`; None leaves TensorRT-LLM's default."""
        plan = retention_ranges(request, self.config)
        if plan is None:
            return None
        from tensorrt_llm.llmapi import KvCacheRetentionConfig

        ranges = [KvCacheRetentionConfig.TokenRangeRetentionConfig(
            r.start, r.end, r.priority, as_timedelta(r.duration_ms)) for r in plan.ranges]
        return KvCacheRetentionConfig(
            token_range_retention_configs=ranges,
            decode_retention_priority=plan.decode_priority,
            decode_duration_ms=as_timedelta(plan.decode_duration_ms))

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        if request.lora is not None:  # the router sends LoRA traffic to vLLM workers
            raise EngineError(f"this engine serves no LoRA adapters ({request.lora!r})")
        from tensorrt_llm.executor import RequestError

        reason: str | None = None
        result = None
        try:
            result = self._submit(request)
            async for out in result:
                delta = _delta(out)
                reason = delta.finish_reason if delta.finished else None
                yield delta
        except (ValueError, RequestError) as exc:  # validation and per-request failures
            reason = "error"
            raise EngineError(str(exc)) from exc
        finally:
            self._results.pop(request.request_id, None)
            self._settle(result, reason)

    def _submit(self, request: EngineRequest) -> GenerationResult:
        from tensorrt_llm import SamplingParams

        ids = self._prompt_ids(request)
        params = SamplingParams(
            max_tokens=clamp_max_tokens(len(ids), request.max_tokens, self.config.max_model_len),
            temperature=request.temperature, top_p=request.top_p, seed=sampling_seed(request),
            stop=list(request.stop) or None, **guided_decoding(request.guided))
        result = self._llm.generate_async(
            ids, params, streaming=True,
            kv_cache_retention_config=self.retention_for(request))
        self._results[request.request_id] = result
        return result

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        # Tokenized here, not by TensorRT-LLM: the length check needs the count, and a
        # resumed job continues after the tokens an earlier attempt already published.
        ids = list(self._llm.tokenizer.encode(request.prompt))
        return ids + list(request.resume_token_ids)

    def _settle(self, result: GenerationResult | None, reason: str | None) -> None:
        """Count how a request ended. No finish reason means the caller stopped reading
        (cancel, deadline): abort it inside the engine, which would otherwise run on."""
        if result is not None and reason is None and not result.finished:
            result.abort()
        with self._lock:
            if result is not None and reason in (None, "abort"):
                self._stats.aborted += 1
            elif reason not in (None, "error"):
                done = self._stats.finished_by_reason
                done[reason] = done.get(reason, 0) + 1

    async def abort(self, request_id: str) -> None:
        result = self._results.get(request_id)
        if result is not None and not result.finished:
            result.abort()

    async def warm(self, prompts: list[str]) -> None:
        await warm_prompts(self, prompts)

    async def reset_prefix_cache(self) -> bool:
        """The LLM API has no call to drop reusable blocks; the health check then goes
        on to a rolling restart."""
        return False

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            snap = EngineStats(**{**s.__dict__, "finished_by_reason": dict(s.finished_by_reason)})
        snap.unfinished = len(self._results)
        return snap

    async def _poll_stats(self) -> None:
        while not self._stopping:
            if not await self._drain_stats():
                await asyncio.sleep(STATS_IDLE_S)

    async def _drain_stats(self) -> int:
        """Fold the iteration stats the engine queued since the last call. get_stats
        blocks up to its timeout (a queue wait or an RPC), so it runs off the loop."""
        try:
            items = await asyncio.to_thread(self._llm.get_stats, STATS_TIMEOUT_S)
        except Exception:  # stats are best effort; generation must not depend on them
            log.debug("TensorRT-LLM get_stats failed", exc_info=True)
            return 0
        with self._lock:
            for item in items or ():
                fold_iteration(self._stats, item)
        return len(items or ())

    async def shutdown(self) -> None:
        self._stopping = True
        if self._poller is not None:
            await self._poller  # ends within one get_stats timeout
            self._poller = None
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)  # joins worker processes: off the loop


def _make_llm(kwargs: dict[str, Any], backend: str) -> BaseLLM:
    from tensorrt_llm.llmapi import KvCacheConfig, QuantAlgo, QuantConfig

    args = dict(kwargs)
    args["kv_cache_config"] = KvCacheConfig(**args["kv_cache_config"])
    if (quant := args.get("quant_config")) is not None:
        args["quant_config"] = QuantConfig(**{key: None if name is None else QuantAlgo[name]
                                              for key, name in quant.items()})
    if backend == TENSORRT:
        from tensorrt_llm._tensorrt_engine import LLM as TrtLLM

        return TrtLLM(**args)
    from tensorrt_llm import LLM

    return LLM(**args)


def _delta(out: RequestOutput) -> Delta:
    comp = out.outputs[0]
    finished = bool(out.finished)
    return Delta(
        text=comp.text_diff,
        token_ids=tuple(comp.token_ids_diff),
        finished=finished,
        finish_reason=finish_reason(comp.finish_reason) if finished else None,
        prompt_tokens=len(out.prompt_token_ids or ()),
    )
