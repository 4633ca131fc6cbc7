"""vLLM adapter over `AsyncLLM` (the CPU build runs the same code on machines without a GPU).

`AsyncLLM` binds to the asyncio loop it first runs in: the engine host calls every
method from its one loop thread.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidegate import capabilities as cap
from workers.engine import (
    ChoiceDelta,
    Delta,
    EngineConfig,
    EngineDead,
    EngineError,
    EngineRequest,
    EngineStats,
    check_kv_policy,
    warm_prompts,
)
from workers.kvcache import stats as alloc_stats
from workers.kvcache.policy import SessionMeta, retention

if TYPE_CHECKING:  # vLLM's types; vLLM itself loads at the engine's start
    from vllm.config import StructuredOutputsConfig, VllmConfig
    from vllm.inputs import TextPrompt, TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

log = logging.getLogger("tidegate.worker")


@cache
def cpu_fp8_kv_supported() -> bool:
    """vLLM's CPU attention runs an FP8 KV cache only where torch sees AVX-512 or AMX; on
    other CPUs its engine core dies at start ('FP8 KV cache on CPU requires ...'). The same
    test vLLM makes (`_get_attn_isa`), so the two never disagree."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def effective_kv_cache_dtype(configured: str, on_cpu: bool) -> str:
    """The KV cache dtype the engine will really run: FP8 falls back to the weights' dtype
    on a CPU that cannot run it, so a lane still serves (and reports what it runs)."""
    if on_cpu and configured.startswith("fp8") and not cpu_fp8_kv_supported():
        return "auto"
    return configured


def enforce_eager(cuda_graphs: bool, on_cpu: bool) -> bool:
    """vLLM's `enforce_eager`: eager where the lane turns CUDA graphs off, and always on a
    CPU, which has no CUDA graphs (not eager, vLLM's CPU build compiles the model with
    torch's inductor: a long engine start on a small machine)."""
    return on_cpu or not cuda_graphs


class _StatsRecorder:
    """A vLLM stat logger: vLLM calls `record` after every engine step with its own
    scheduler counters, which is what `stats()` reports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = EngineStats(kind="vllm")

    def factory(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):  # type: ignore[no-untyped-def]
                recorder.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return Logger(vllm_config, engine_index)

    def record(self, sched: SchedulerStats | None, iteration: IterationStats | None) -> None:
        with self.lock:
            s = self.stats
            if sched is not None:
                s.running, s.waiting = sched.num_running_reqs, sched.num_waiting_reqs
                s.max_running_seen = max(s.max_running_seen, s.running)
                s.kv_usage = sched.kv_cache_usage
                s.prefix_queries_tokens += sched.prefix_cache_stats.queries
                s.prefix_hits_tokens += sched.prefix_cache_stats.hits
            if iteration is not None:
                for done in iteration.finished_requests:
                    reason = str(done.finish_reason)
                    s.finished_by_reason[reason] = s.finished_by_reason.get(reason, 0) + 1

    def snapshot(self) -> EngineStats:
        with self.lock:
            s = self.stats
            return EngineStats(**{**s.__dict__, "finished_by_reason": dict(s.finished_by_reason)})


class VllmEngine:
    kind = "vllm"
    # Everything vLLM's own server does for text (no multimodal model is served).
    capabilities = cap.ALL - {cap.VISION, cap.AUDIO}

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._llm: Any = None
        self._recorder = _StatsRecorder()
        self._capacity_tokens = 0
        self._aborted = 0
        self._loras: dict[str, LoRARequest] = {}  # adapter name -> its request
        self.kv_cache_dtype = config.kv_cache_dtype  # what the engine runs, set by start()
        self._alloc_stats_path: Path | None = None  # written by the plugin in the engine core

    async def start(self) -> None:
        # The CPU build sizes its KV cache from this variable (GiB); ignored on GPUs.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        _check_tool_parsers(cfg.tool_parsers)
        self.kv_cache_dtype = effective_kv_cache_dtype(cfg.kv_cache_dtype,
                                                       current_platform.is_cpu())
        if self.kv_cache_dtype != cfg.kv_cache_dtype:
            log.warning("KV cache dtype %s is not supported on this CPU (needs AVX-512 or "
                        "AMX); running %s", cfg.kv_cache_dtype, self.kv_cache_dtype)
        self._plugin_env()
        args = AsyncEngineArgs(
            model=cfg.model,
            dtype=cfg.dtype,  # type: ignore[arg-type]  # checked by the lanes file
            kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.slots,
            # Waiting requests by EngineRequest.priority (borrowed jobs last), and a more
            # urgent one preempts for a slot (workers/vllm_patches/priority.py); with one
            # priority throughout, this is first come, first served as before.
            scheduling_policy="priority",
            enable_prefix_caching=cfg.enable_prefix_caching,
            num_gpu_blocks_override=cfg.kv_cache_blocks,
            block_size=cfg.kv_block_size,
            disable_log_stats=False,
            enforce_eager=enforce_eager(cfg.cuda_graphs, current_platform.is_cpu()),
            use_tqdm_on_load=False,  # a progress bar is no log line (tidegate/logs.py)
            # Structured output (JSON) without whitespace between tokens: a grammar that
            # allows any lets a model spend its whole max_tokens on spaces (small models
            # do), and compact JSON is the same JSON. An engine-wide setting in vLLM.
            structured_outputs_config=_structured_config(),
            **self._lora_args(),
            **_platform_args(cfg),
        )
        vllm_config = args.create_engine_config()
        if current_platform.is_cpu() and cfg.cpu_executor == "uni":
            # vLLM's CPU build turns "uni" into "mp" (a model process under the engine core,
            # spawned, importing vLLM again: 13-16 s of a worker's start here) for its
            # OpenMP thread binding; the engine core binds its own threads as well (one per
            # worker here). Set after the config is made: as vLLM runs one GPU.
            vllm_config.parallel_config.distributed_executor_backend = "uni"
        self._llm = AsyncLLM.from_vllm_config(vllm_config,
                                              stat_loggers=[self._recorder.factory])
        vcfg = self._llm.vllm_config.cache_config
        self._capacity_tokens = int((vcfg.num_gpu_blocks or 0) * vcfg.block_size)

    def _plugin_env(self) -> None:
        """What tidegate's vLLM patches read in the engine's processes, which vLLM starts
        with this process's environment (workers/vllm_patches/)."""
        from workers.vllm_patches import PatchRefused, check_version, kvcache, priority, wakeup

        check_kv_policy(self.config.kv_policy)
        if self.config.kv_policy == "session":
            import vllm

            try:
                check_version(vllm.__version__)
            except PatchRefused as exc:
                raise EngineError(str(exc)) from None
        fd, path = tempfile.mkstemp(prefix="tidegate-kv-", suffix=".stats")
        os.close(fd)
        self._alloc_stats_path = Path(path)
        alloc_stats.create(self._alloc_stats_path)
        os.environ[kvcache.POLICY_ENV] = self.config.kv_policy
        os.environ[kvcache.STATS_ENV] = path
        os.environ[wakeup.RECHECK_ENV] = str(wakeup.RECHECK_MS)
        os.environ[priority.SLOT_PREEMPT_ENV] = "1"

    def _lora_args(self) -> dict[str, Any]:
        """Engine arguments for the configured LoRA adapters; ids are stable, from 1."""
        adapters = self.config.lora_adapters
        if not adapters:
            return {}
        from vllm.lora.request import LoRARequest

        names = [name for name, _ in adapters]
        if len(set(names)) != len(names):
            raise EngineError(f"duplicate LoRA adapter names in {names}")
        self._loras = {
            name: LoRARequest(name, index, path)
            for index, (name, path) in enumerate(adapters, start=1)
        }
        rank = max(_adapter_rank(path) for _, path in adapters)
        # One slot more than the adapters, left empty (vLLM zero-fills its LoRA slots): in a
        # batch that mixes adapter and base requests, vLLM's torch LoRA ops (the CPU build's)
        # index the slot weights with a base row's -1, which Python reads as the LAST slot.
        # With every slot holding an adapter, base rows got that adapter's output (measured:
        # tests/stack/test_engine_contract.py's mixed batch); an empty last slot adds zero.
        return {"enable_lora": True, "max_lora_rank": _vllm_lora_rank(rank),
                "max_loras": len(adapters) + 1}

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=list(request.stop) or None,
            structured_outputs=_structured(request.guided),
            output_kind=RequestOutputKind.DELTA,
            extra_args={"tidegate": self._kv_meta(request)},
            **_sampling_extras(request),
        )
        lora = None
        if request.lora is not None:
            lora = self._loras.get(request.lora)
            if lora is None:
                raise EngineError(f"unknown LoRA adapter {request.lora!r}")
        finished = False
        try:
            calls = _ToolStream(request.tool_parse, self._llm.get_tokenizer()) \
                if request.tool_parse else None
            async for out in self._llm.generate(
                self._prompt(request), params, request.request_id, lora_request=lora,
                priority=request.priority,
            ):
                delta = _delta(out, request)
                if calls is not None:
                    delta = calls.step(delta)
                finished = delta.finished
                yield delta
        # vLLM's validation errors: ValueError, and VLLMValidationError (a VLLMClientError,
        # not a ValueError) for a prompt longer than the context.
        except (ValueError, VLLMClientError) as exc:
            finished = True
            raise EngineError(str(exc)) from exc
        except EngineDeadError as exc:  # the engine core process died: not this request's fault
            finished = True
            raise EngineDead("vLLM's engine core died") from exc
        finally:
            # Cancelling vLLM's generate() aborts the request inside the engine; the
            # engine's iteration stats do not count client aborts, so count them here.
            if not finished:
                self._aborted += 1

    def _kv_meta(self, request: EngineRequest) -> dict[str, object]:
        """What the KV plugin tags the request's blocks with when it frees them."""
        meta = SessionMeta(session_id=request.session_id, turn=request.turn,
                           lane=request.lane, warm=request.warm)
        return {"session_id": request.session_id, "turn": request.turn, "lane": request.lane,
                "owner": request.session_id or request.request_id,
                "kv": retention(meta, self.config.kv_params).as_dict()}

    def _prompt(self, request: EngineRequest) -> TextPrompt | TokensPrompt:
        # vLLM mixes the salt into the first block's hash, which every later block chains
        # from: requests of different salts share no block.
        prompt: TextPrompt | TokensPrompt
        if not request.resume_token_ids:
            prompt = {"prompt": request.prompt}
        else:
            ids = self._llm.get_tokenizer().encode(request.prompt)
            prompt = {"prompt_token_ids": list(ids) + list(request.resume_token_ids)}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def warm(self, prompts: list[str]) -> None:
        await warm_prompts(self, prompts)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._llm.reset_prefix_cache())

    def stats(self) -> EngineStats:
        snap = self._recorder.snapshot()
        snap.kv_cache_dtype = self.kv_cache_dtype
        snap.kv_capacity_tokens = self._capacity_tokens
        snap.aborted = self._aborted
        snap.kv_policy = self.config.kv_policy
        alloc = alloc_stats.read(self._alloc_stats_path) if self._alloc_stats_path else None
        if alloc is not None and alloc.steps:
            snap.avg_cache_allocation_latency_ms = alloc.recent_ms
            snap.kv_evictions = alloc.evictions
        if self._llm is not None:
            if self._llm.errored:  # vLLM noticed its engine core die (a monitor thread)
                raise EngineDead("vLLM's engine core died")
            snap.unfinished = self._llm.get_num_unfinished_requests()
        return snap

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._alloc_stats_path is not None:
            self._alloc_stats_path.unlink(missing_ok=True)
            self._alloc_stats_path = None


# vLLM's MaxLoRARanks: max_lora_rank must be one of these.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _adapter_rank(path: str) -> int:
    """The largest rank in a PEFT adapter's adapter_config.json."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
        ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
        return max(int(r) for r in ranks)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"LoRA adapter {path}: cannot read its rank ({exc})") from exc


def _vllm_lora_rank(rank: int) -> int:
    for allowed in _VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise EngineError(f"LoRA rank {rank} is above vLLM's largest, {_VLLM_LORA_RANKS[-1]}")


def _platform_args(cfg: EngineConfig) -> dict[str, Any]:
    """Engine arguments that depend on the device.

    On CPU, a seeded request whose prefill is chunked kills the engine core (torch's CPU
    generator cannot rewind its offset), so prefills are never chunked there: every
    prompt that fits the model fits one step's token budget. FP8 weights are a GPU feature.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"quantization": cfg.quantization} if cfg.quantization else {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(cfg.max_model_len, 8192)}


def _sampling_extras(request: EngineRequest) -> dict[str, Any]:
    """SamplingParams' arguments beyond the plain ones, only those the request sets (vLLM's
    defaults are the neutral values)."""
    values: dict[str, Any] = {
        "n": request.n, "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty, "top_k": request.top_k,
        "min_p": request.min_p, "logprobs": request.logprobs,
        "logit_bias": dict(request.logit_bias) or None}
    return {name: value for name, value in values.items() if value is not None}


LOGPROB_FLOOR = -9999.0  # vLLM's server's stand-in for -inf, which JSON cannot carry


def _logprobs(comp: CompletionOutput, top: int | None) -> tuple[list[Any], ...] | None:
    """A CompletionOutput's new tokens' logprobs as the events carry them: [text, logprob,
    [[alternative text, logprob], ...] best first, at most `top`]."""
    if top is None or comp.logprobs is None:
        return None
    out = []
    for token_id, position in zip(comp.token_ids, comp.logprobs, strict=False):
        assert position is not None  # vLLM fills every position once logprobs are asked
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        chosen = position.get(token_id)
        alternatives = [[lp.decoded_token or "", max(lp.logprob, LOGPROB_FLOOR)]
                        for _, lp in ranked[:top]]
        out.append([chosen.decoded_token or "" if chosen else "",
                    max(chosen.logprob, LOGPROB_FLOOR) if chosen else LOGPROB_FLOOR,
                    alternatives])
    return tuple(out)


def _delta(out: RequestOutput, request: EngineRequest) -> Delta:
    """One RequestOutput as a Delta. With n > 1, vLLM's parallel sampling sends each
    output step of one choice (its `index`) alone; `finished` once every choice is."""
    comp = out.outputs[0]
    finished = bool(out.finished)
    reason = comp.finish_reason if out.finished else None
    prompt_tokens, cached = len(out.prompt_token_ids or ()), out.num_cached_tokens
    if request.n == 1:
        return Delta(text=comp.text, token_ids=tuple(comp.token_ids),
                     logprobs=_logprobs(comp, request.logprobs), finished=finished,
                     finish_reason=reason, prompt_tokens=prompt_tokens, cached_tokens=cached)
    choices = tuple(ChoiceDelta(index=c.index, text=c.text, token_ids=tuple(c.token_ids),
                                finish_reason=c.finish_reason,
                                logprobs=_logprobs(c, request.logprobs))
                    for c in out.outputs)
    first = next((c for c in choices if c.index == 0), None)
    return Delta(text=first.text if first else "", token_ids=first.token_ids if first else (),
                 logprobs=first.logprobs if first else None, choices=choices,
                 finished=finished, finish_reason=reason, prompt_tokens=prompt_tokens,
                 cached_tokens=cached)


def _check_tool_parsers(names: tuple[str, ...]) -> None:
    """A lane's tool_parser that vLLM does not have fails the worker's start, not each of
    its `auto` tool requests."""
    if not names:
        return
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise EngineError(f"tool_parser {', '.join(map(repr, unknown))} is not one of vLLM's "
                          f"({', '.join(sorted(known))})")


def _structured_config() -> StructuredOutputsConfig:
    from vllm.config import StructuredOutputsConfig

    # llguidance: it takes the widest range of JSON Schema (xgrammar, vLLM's first choice,
    # refuses some keywords, and without "auto" there is no fallback), and it honours
    # disable_any_whitespace, which vLLM allows only with a named backend.
    return StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)


def _structured(guided: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """vLLM's structured-output constraint from the job's (api/openai_tools.py)."""
    if not guided:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**guided)


class _ToolStream:
    """vLLM's tool parser over one request's deltas (`auto` tool choice), as vLLM's own
    server runs it: each step's text goes through `extract_tool_calls_streaming`, which
    answers the content to send and OpenAI's tool-call deltas; a delta then holds only the
    content, and the calls ride in `tool_calls` (the job's token events, tidegate/events.py).
    """

    def __init__(self, spec: dict[str, Any], tokenizer: TokenizerLike) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            parser_cls = ToolParserManager.get_tool_parser(str(spec.get("parser")))
        except KeyError:
            raise EngineError(f"unknown tool parser {spec.get('parser')!r}; the lane's "
                              f"tool_parser must be one of vLLM's") from None
        self.request = ChatCompletionRequest.model_validate({
            "model": "tidegate", "messages": [{"role": "user", "content": "-"}],
            "tools": spec.get("tools") or [], "tool_choice": "auto"})
        tools: list[Any] = list(self.request.tools or [])
        self.parser = parser_cls(tokenizer, tools)
        self.text = ""
        self.ids: list[int] = []
        self.sent = 0  # characters of the text sent as content
        self.called = False

    def step(self, delta: Delta) -> Delta:
        previous_text, previous_ids = self.text, self.ids
        self.text += delta.text
        self.ids = previous_ids + list(delta.token_ids)
        message = self.parser.extract_tool_calls_streaming(
            previous_text, self.text, delta.text, previous_ids, self.ids,
            list(delta.token_ids), self.request) if delta.text else None
        content = (message.content or "") if message is not None else ""
        calls = tuple(call.model_dump(exclude_none=True)
                      for call in (message.tool_calls if message is not None else []))
        self.called = self.called or bool(calls)
        if delta.finished and not self.called:
            # The parser holds back a tail that could start a call's tag; there is none.
            content = self.text[self.sent:]
        self.sent += len(content)
        return replace(delta, text=content, tool_calls=calls)
