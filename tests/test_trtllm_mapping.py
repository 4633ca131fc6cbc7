"""The TensorRT-LLM adapter's pure logic: backend choice, the precision -> LLM argument
mapping, folding iteration stats, context limits. None of it imports tensorrt_llm, so it
runs on every machine; the adapter itself is exercised by tests/test_engine_contract.py
on a GPU machine (scripts/gpu_check.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from workers.engine import EngineConfig, EngineError, EngineRequest, EngineStats
from workers.trtllm_engine import (
    PYTORCH,
    TENSORRT,
    UNAVAILABLE,
    TrtllmEngine,
    checkpoint_precision,
    clamp_max_tokens,
    detect_backend,
    engine_precision,
    finish_reason,
    fold_iteration,
    llm_kwargs,
    sampling_seed,
    unavailable_reason,
)

ROOT = Path(__file__).resolve().parent.parent
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
        "enable_iter_perf_stats": True,
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


def test_module_import_does_not_import_tensorrt_llm() -> None:
    code = ("import sys, workers.trtllm_engine; "
            "sys.exit('tensorrt_llm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
