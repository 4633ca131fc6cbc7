"""The TensorRT-LLM adapter's pure logic: backend choice, the precision -> LLM argument
mapping, folding iteration stats, context limits. None of it imports tensorrt_llm, so it
runs on every machine; the adapter itself is exercised by tests/test_engine_contract.py
on a GPU machine (scripts/gpu_check.py).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from tidegate.lanes import KvPolicy
from workers.engine import EngineConfig, EngineError, EngineRequest, EngineStats
from workers.trtllm_engine import (
    PYTORCH,
    TENSORRT,
    UNAVAILABLE,
    RetentionPlan,
    TokenRange,
    TrtllmEngine,
    as_timedelta,
    checkpoint_precision,
    clamp_max_tokens,
    clamp_priority,
    detect_backend,
    engine_precision,
    finish_reason,
    fold_iteration,
    llm_kwargs,
    retention_ranges,
    sampling_seed,
    unavailable_reason,
)

CHAT = EngineConfig(model="/models/m", dtype="float16", kv_cache_dtype="fp8", slots=16,
                    max_model_len=2048)
FINANCE = replace(CHAT, kv_cache_dtype="auto")
# One iteration as trtllm-serve's /metrics documents it (cumulative KV block counters).
ITERATION = {
    "iter": 154, "iterLatencyMS": 7.0, "numActiveRequests": 3, "numQueuedRequests": 2,
    "kvCacheStats": {"allocNewBlocks": 3126, "allocTotalBlocks": 3126, "cacheHitRate": 0.00128,
                     "freeNumBlocks": 101253, "maxNumBlocks": 101256, "missedBlocks": 3121,
                     "reusedBlocks": 4, "tokensPerBlock": 32, "usedNumBlocks": 3},
}


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def built_engine(tmp_path: Path, quant_algo: str | None, kv_algo: str | None) -> str:
    """A directory laid out like a built TensorRT engine's config.json."""
    write_json(tmp_path / "config.json", {
        "build_config": {"max_seq_len": 2048},
        "pretrained_config": {"dtype": "float16", "quantization": {
            "quant_algo": quant_algo, "kv_cache_quant_algo": kv_algo}}})
    return str(tmp_path)


def test_pytorch_backend_fp8_kv_cache_goes_in_kv_cache_config() -> None:
    kwargs = llm_kwargs(CHAT, PYTORCH)
    assert kwargs == {
        "model": "/models/m", "dtype": "float16", "max_batch_size": 16, "max_seq_len": 2048,
        "kv_cache_config": {"enable_block_reuse": True, "dtype": "fp8"},
        "enable_iter_perf_stats": True, "guided_decoding_backend": "llguidance",
    }
    assert llm_kwargs(FINANCE, PYTORCH)["kv_cache_config"]["dtype"] == "auto"
    no_reuse = replace(CHAT, enable_prefix_caching=False)
    assert llm_kwargs(no_reuse, PYTORCH)["kv_cache_config"]["enable_block_reuse"] is False


def test_tensorrt_build_quantizes_through_quant_config() -> None:
    kwargs = llm_kwargs(replace(CHAT, quantization="fp8"), TENSORRT)
    assert kwargs["quant_config"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    # The TensorRT backend refuses KvCacheConfig.dtype; stats need no switch there.
    assert kwargs["kv_cache_config"] == {"enable_block_reuse": True}
    assert "enable_iter_perf_stats" not in kwargs
    finance = llm_kwargs(FINANCE, TENSORRT)["quant_config"]
    assert finance == {"quant_algo": None, "kv_cache_quant_algo": None}


def test_fp8_weights_on_pytorch_need_an_fp8_checkpoint(tmp_path: Path) -> None:
    fp8_chat = replace(CHAT, quantization="fp8")
    with pytest.raises(EngineError, match="ModelOpt"):
        llm_kwargs(fp8_chat, PYTORCH, found=(None, None))
    write_json(tmp_path / "hf_quant_config.json",
               {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}})
    found = checkpoint_precision(str(tmp_path))
    assert found == ("FP8", None)
    assert llm_kwargs(fp8_chat, PYTORCH, found=found)["kv_cache_config"]["dtype"] == "fp8"
    # The same checkpoint must not quietly serve FP8 weights to the FP16 finance lane.
    with pytest.raises(EngineError, match="checkpoint has weights FP8"):
        llm_kwargs(FINANCE, PYTORCH, found=found)


def test_hf_config_quantization_is_read_too(tmp_path: Path) -> None:
    write_json(tmp_path / "config.json", {"quantization_config": {"quant_method": "fp8"}})
    assert checkpoint_precision(str(tmp_path)) == ("FP8", None)


def test_built_engine_precision_must_match_the_lane(tmp_path: Path) -> None:
    model = built_engine(tmp_path, None, "FP8")
    assert detect_backend(model) == TENSORRT
    assert engine_precision(model) == (None, "FP8")
    chat = replace(CHAT, model=model)
    kwargs = llm_kwargs(chat, TENSORRT, found=(None, "FP8"), built=True)
    assert "quant_config" not in kwargs  # fixed when the engine was built
    with pytest.raises(EngineError, match="TensorRT engine has"):
        llm_kwargs(replace(FINANCE, model=model), TENSORRT, found=(None, "FP8"), built=True)
    with pytest.raises(EngineError, match="TensorRT backend"):
        llm_kwargs(chat, PYTORCH, found=(None, "FP8"), built=True)


def test_the_test_checkpoint_runs_on_the_pytorch_backend(model_path: Path) -> None:
    assert detect_backend(str(model_path)) == PYTORCH
    assert checkpoint_precision(str(model_path)) == (None, None)


def test_fp8_e5m2_is_refused() -> None:
    with pytest.raises(EngineError, match="E4M3"):
        llm_kwargs(replace(CHAT, kv_cache_dtype="fp8_e5m2"), PYTORCH)


def test_fold_iteration_reads_counts_and_kv_cache() -> None:
    stats = EngineStats(kind="trtllm")
    fold_iteration(stats, ITERATION)
    assert (stats.running, stats.waiting, stats.max_running_seen) == (3, 2, 3)
    assert stats.kv_capacity_tokens == 101256 * 32
    assert stats.kv_usage == pytest.approx(3 / 101256)
    assert (stats.prefix_hits_tokens, stats.prefix_queries_tokens) == (4 * 32, 3125 * 32)
    # Some versions hand back JSON text; an idle iteration lowers running, not the peak.
    fold_iteration(stats, json.dumps({"numActiveRequests": 0, "numQueuedRequests": 0}))
    assert (stats.running, stats.max_running_seen) == (0, 3)
    assert stats.kv_capacity_tokens == 101256 * 32  # kept when an iteration omits it


def test_context_limit_is_vllms() -> None:
    with pytest.raises(EngineError, match="maximum context length is 2048"):
        clamp_max_tokens(2048, 10, 2048)
    assert clamp_max_tokens(2008, 500, 2048) == 40
    assert clamp_max_tokens(10, 24, 2048) == 24


def test_unseeded_requests_get_their_own_seed() -> None:
    # TensorRT-LLM's default seed is one fixed value: every unseeded request would share it.
    unseeded = EngineRequest(request_id="r", prompt="p", max_tokens=4)
    assert len({sampling_seed(unseeded) for _ in range(8)}) == 8
    assert sampling_seed(replace(unseeded, seed=7)) == 7


def test_finish_reasons_are_the_protocols() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "cancelled", "timeout", None)] == [
        "stop", "length", "abort", "abort", None]


@pytest.mark.skipif(unavailable_reason() is None, reason="TensorRT-LLM runs on this machine")
def test_start_says_why_it_cannot_run_here() -> None:
    reason = unavailable_reason()
    assert reason is not None and reason.startswith(UNAVAILABLE)
    engine = TrtllmEngine(CHAT)
    with pytest.raises(EngineError, match="TensorRT-LLM is not installed / needs an NVIDIA GPU"):
        asyncio.run(engine.start())
    asyncio.run(engine.shutdown())  # nothing started: still safe


def test_module_import_does_not_import_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes any `import tensorrt_llm` raise ImportError.
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorrt_llm"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    monkeypatch.delitem(sys.modules, "workers.trtllm_engine", raising=False)
    module = importlib.import_module("workers.trtllm_engine")
    assert module.TrtllmEngine is not None


# --- KV retention: the session policy as a per-request KvCacheRetentionConfig -----------

SESSION = replace(CHAT, kv_policy="session")  # the default KvPolicy: 80, 4 turns, -5, 40, 10
IDLE_MS = 90_000  # KvPolicy.session_idle_s, in the milliseconds TensorRT-LLM takes


def ask(session_id: str | None = None, turn: int = 0, warm: bool = False) -> EngineRequest:
    return EngineRequest(request_id="r", prompt="p", max_tokens=4, session_id=session_id,
                         turn=turn, lane="chat", warm=warm)


@pytest.mark.parametrize(("request_", "priority", "duration_ms"), [
    (ask(), 10, None),  # one-shot: first out, never lapses (it is already the lowest)
    (ask(session_id="s", turn=1), 80, IDLE_MS),
    (ask(session_id="s", turn=4), 80, IDLE_MS),  # the last of the short turns
    (ask(session_id="s", turn=10), 50, IDLE_MS),  # 6 turns past them: 80 - 6 * 5
    (ask(session_id="s", turn=40), 40, IDLE_MS),  # a long session stops at the floor
    (ask(warm=True), 90, IDLE_MS),  # a lane's hot prefix: shared_priority
    (ask(session_id="s", turn=0), 10, None),  # no turn counted: treated as one-shot
], ids=["one-shot", "turn-1", "turn-4", "turn-10", "turn-40-floor", "warm", "turn-0"])
def test_session_policy_covers_prompt_and_decode_with_one_class(
        request_: EngineRequest, priority: int, duration_ms: int | None) -> None:
    plan = retention_ranges(request_, SESSION)
    assert plan == RetentionPlan(ranges=(TokenRange(0, None, priority, duration_ms),),
                                 decode_priority=priority, decode_duration_ms=duration_ms)


def test_a_system_turn_keeps_the_shared_class_whoever_reuses_it() -> None:
    """TensorRT-LLM gives a reused block the class of its latest user, so a one-shot request
    states its system turn's range at shared_priority and cannot demote the lane's prompt."""
    one_shot = replace(ask(), shared_prefix_tokens=300)
    assert retention_ranges(one_shot, SESSION) == RetentionPlan(
        ranges=(TokenRange(0, 300, 90, None), TokenRange(300, None, 10, None)),
        decode_priority=10, decode_duration_ms=None)
    turn = retention_ranges(replace(ask(session_id="s", turn=2), shared_prefix_tokens=300),
                            SESSION)
    assert turn is not None and turn.ranges == (TokenRange(0, 300, 90, IDLE_MS),
                                                TokenRange(300, None, 80, IDLE_MS))


def test_lru_policy_leaves_tensorrt_llms_default() -> None:
    lru = replace(CHAT, kv_policy="lru")
    for request_ in (ask(), ask(session_id="s", turn=2), ask(warm=True)):
        assert retention_ranges(request_, lru) is None
    assert TrtllmEngine(lru).retention_for(ask(session_id="s", turn=2)) is None


def test_unknown_policy_is_refused_before_the_engine_starts() -> None:
    odd = replace(CHAT, kv_policy="lfu")
    with pytest.raises(EngineError, match="unknown KV policy 'lfu'"):
        retention_ranges(ask(), odd)
    with pytest.raises(EngineError, match="unknown KV policy 'lfu'"):
        asyncio.run(TrtllmEngine(odd).start())


def test_lane_parameters_reach_the_plan() -> None:
    params = KvPolicy(session_priority=70, short_session_turns=1, decay_per_turn=10,
                      long_session_floor=45, session_idle_s=2.5)
    plan = retention_ranges(ask(session_id="s", turn=2), replace(SESSION, kv_params=params))
    assert plan is not None and plan.ranges == (TokenRange(0, None, 60, 2500),)


def test_priorities_are_clamped_to_tensorrt_llms_range() -> None:
    assert [clamp_priority(p) for p in (-5, 0, 35, 100, 150)] == [0, 0, 35, 100, 100]
    # KvPolicy validates 0-100; model_construct skips that, as a hand-built config would.
    wild = KvPolicy.model_construct(**{**KvPolicy().model_dump(), "session_priority": 150,
                                       "long_session_floor": 150, "one_shot_priority": -5})
    config = replace(SESSION, kv_params=wild)
    turn = retention_ranges(ask(session_id="s", turn=1), config)
    one_shot = retention_ranges(ask(), config)
    assert turn is not None and (turn.ranges[0].priority, turn.decode_priority) == (100, 100)
    assert one_shot is not None and one_shot.ranges[0].priority == 0


def test_durations_go_to_the_bindings_as_timedeltas() -> None:
    # std::chrono::milliseconds converts from a timedelta; a bare int would not be ms.
    assert as_timedelta(IDLE_MS) == timedelta(seconds=90)
    assert as_timedelta(None) is None


def test_engine_stats_report_the_kv_policy() -> None:
    assert TrtllmEngine(SESSION).stats().kv_policy == "session"
    assert TrtllmEngine(replace(CHAT, kv_policy="lru")).stats().kv_policy == "lru"


@pytest.mark.skipif(unavailable_reason() is not None, reason="needs TensorRT-LLM and a GPU")
def test_retention_for_builds_the_bindings_object() -> None:
    config = TrtllmEngine(SESSION).retention_for(ask(session_id="s", turn=10))
    assert config is not None
    (token_range,) = config.token_range_retention_configs
    assert (token_range.token_start, token_range.token_end, token_range.priority) == (0, None, 50)
    assert token_range.duration_ms == timedelta(milliseconds=IDLE_MS)
    assert config.decode_retention_priority == 50
    assert config.decode_duration_ms == timedelta(milliseconds=IDLE_MS)
