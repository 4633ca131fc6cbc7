"""The engine contract: the same tests against every adapter this machine can run.

Each adapter is started once for the module (engine start dominates the run time) and
driven the way workers drive it, through an EngineHost. vLLM always runs (the CPU build
here, the CUDA build on a GPU machine); TensorRT-LLM runs where `tensorrt_llm` imports
and a CUDA GPU is visible, which scripts/gpu_check.py arranges. The simulated engine
(workers/sim_engine.py, its `fast` profile) runs anywhere, in seconds.

TIDEGATE_CONTRACT_ENGINES (comma list, default "vllm,trtllm,sim") picks the adapters to try.
It is a test knob, not a product setting.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from workers.engine import (
    BORROWED,
    OWN,
    Delta,
    Engine,
    EngineConfig,
    EngineError,
    EngineRequest,
    EngineStats,
)
from workers.host import Cancelled, EngineHost
from workers.vllm_engine import cpu_fp8_kv_supported

KINDS = ("vllm", "trtllm", "sim")
SELECTED = [k.strip() for k in os.environ.get("TIDEGATE_CONTRACT_ENGINES", "vllm,trtllm,sim")
            .split(",") if k.strip()]
if unknown := sorted(set(SELECTED) - set(KINDS)):
    raise pytest.UsageError(f"TIDEGATE_CONTRACT_ENGINES names unknown engines {unknown}; "
                            f"known: {', '.join(KINDS)}")
TRTLLM_SKIP = ("TensorRT-LLM needs an NVIDIA GPU and the tensorrt_llm package; "
               "run scripts/gpu_check.py on a GPU machine")

# The chat lane's profile, the harder of the two precisions; a CPU without AVX-512 or AMX
# cannot run it, and the adapter falls back to the weights' dtype (and says so).
KV_CACHE_DTYPE = "fp8"
EXPECTED_KV = "fp8" if cpu_fp8_kv_supported() else "auto"
MAX_MODEL_LEN = 2048
MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 120.0  # per request: two busy CPU cores are slow, never this slow
STATS_WAIT_S = 10.0  # engine counters arrive a step after the tokens
# " refund" is one token of the test checkpoint's tokenizer: prompts of exact length.
WORD = " refund"
SYSTEM_PROMPT = ("You are the support assistant of a shop. Answer questions about orders, "
                 "refunds, invoices and delivery in one short paragraph. ") * 8
QUESTION = " Where is my refund for order 58213?"

pytestmark = pytest.mark.timeout(900)  # the first test also waits for the engine to start


def _trtllm_unavailable() -> bool:
    from workers.trtllm_engine import unavailable_reason

    return unavailable_reason() is not None


def _engine_params() -> list[Any]:
    params = []
    for kind in KINDS:
        marks: list[pytest.MarkDecorator] = [pytest.mark.gpu] if kind == "trtllm" else []
        if kind not in SELECTED:
            marks.append(pytest.mark.skip(reason=f"{kind} is not in TIDEGATE_CONTRACT_ENGINES"))
        elif kind == "trtllm" and _trtllm_unavailable():
            marks.append(pytest.mark.skip(reason=TRTLLM_SKIP))
        params.append(pytest.param(kind, marks=marks, id=kind))
    return params


# 1 ms a step: real pacing, so a cancel lands mid-stream, yet the suite takes seconds.
SIM_PROFILE = "fast"


# The test LoRA adapter (tidegate_tools/testlora.py), served by the adapters that take
# adapters (vLLM, sim); TensorRT-LLM serves none (the router sends LoRA jobs to vLLM).
ADAPTER = "refunds-tuned"


def make_engine(kind: str, model: Path) -> Engine:
    from tidegate_tools.testlora import build_test_lora

    adapters: tuple[tuple[str, str], ...] = ()
    if kind != "trtllm":
        adapters = ((ADAPTER, str(build_test_lora(model, model.parent / "tidegate-test-lora"))),)
    config = EngineConfig(model=str(model), dtype="float16", kv_cache_dtype=KV_CACHE_DTYPE,
                          max_model_len=MAX_MODEL_LEN, slots=16, kv_cache_gib=1,
                          lora_adapters=adapters)
    if kind == "sim":
        from workers.sim_engine import SimEngine

        return SimEngine(config, profile=SIM_PROFILE)
    if kind == "trtllm":
        from workers.trtllm_engine import TrtllmEngine

        return TrtllmEngine(config)
    from workers.vllm_engine import VllmEngine

    return VllmEngine(config)


@pytest.fixture(scope="module", params=_engine_params())
def host(request: pytest.FixtureRequest, model_path: Path) -> Iterator[EngineHost]:
    """One started engine per adapter for the whole module, stopped whatever happens."""
    engine_host = EngineHost(make_engine(request.param, model_path))
    try:
        engine_host.start()
        yield engine_host
    finally:
        engine_host.stop()


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


# --- helpers ----------------------------------------------------------------------------


def request(prompt: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> EngineRequest:
    return EngineRequest(request_id=f"contract-{uuid.uuid4().hex[:12]}", prompt=prompt,
                         max_tokens=max_tokens, **kw)


def collect(host: EngineHost, req: EngineRequest) -> list[Delta]:
    return list(host.run(req, timeout_s=REQUEST_TIMEOUT_S))


def tokens(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def wait_for(host: EngineHost, check: Callable[[EngineStats], bool],
             timeout_s: float = STATS_WAIT_S) -> EngineStats:
    """The engine's stats once `check` holds; the last stats seen if it never does."""
    deadline = time.monotonic() + timeout_s
    while not check(stats := host.engine.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def warm(host: EngineHost, prompts: list[str]) -> None:
    """Warm through the engine's own loop thread, as the standby bootstep does."""
    asyncio.run_coroutine_threadsafe(host.engine.warm(prompts), host.loop).result(
        timeout=REQUEST_TIMEOUT_S)


def assert_complete(deltas: list[Delta], max_tokens: int) -> None:
    assert deltas, "no deltas at all"
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length"  # the test checkpoint never emits EOS
    assert len(tokens(deltas)) == max_tokens


# --- the contract -----------------------------------------------------------------------


def test_streaming_order(host: EngineHost, tokenizer: Any) -> None:
    prompt = "Hello there, where is my order?"
    deltas = collect(host, request(prompt))
    assert_complete(deltas, MAX_TOKENS)
    # Streamed text is the decoded tokens, in order, each piece exactly once.
    assert "".join(d.text for d in deltas) == tokenizer.decode(tokens(deltas))
    assert all(d.token_ids for d in deltas[:-1]), "an unfinished delta carried no token"
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    assert {d.prompt_tokens for d in deltas} == {prompt_tokens}


def sampled(host: EngineHost, seed: int, temperature: float = 0.8, **kw: Any) -> list[int]:
    # A short prompt: seeded requests whose prefill is chunked crash vLLM's CPU build.
    deltas = collect(host, request("Refund status, please.", max_tokens=16,
                                   temperature=temperature, seed=seed, **kw))
    assert_complete(deltas, 16)
    return tokens(deltas)


def test_seed_makes_sampling_repeatable(host: EngineHost) -> None:
    first = sampled(host, 20261202)
    assert sampled(host, 20261202) == first
    # The controls: another seed samples otherwise, and sampling is not greedy decoding
    # (a temperature the engine ignored would give every seed the same tokens).
    assert sampled(host, 7) != first
    greedy = sampled(host, 20261202, temperature=0.0)
    assert sampled(host, 7, temperature=0.0) == greedy  # no sampling: the seed plays no part
    assert first != greedy


def test_top_p_keeps_only_the_most_likely_tokens(host: EngineHost) -> None:
    """A tiny top_p leaves one candidate per step: two seeds give the same tokens at
    temperature 1; with top_p 1 they sample otherwise. (Not compared with greedy decoding:
    where two logits tie, argmax and top_p may keep different ones of them.)"""
    assert sampled(host, 1, temperature=1.0, top_p=0.001) == sampled(
        host, 2, temperature=1.0, top_p=0.001)
    assert sampled(host, 1, temperature=1.0, top_p=1.0) != sampled(
        host, 2, temperature=1.0, top_p=1.0)


def test_cancel_mid_stream_aborts_in_the_engine(host: EngineHost) -> None:
    before = host.engine.stats().aborted
    req = request("Tell me everything about my invoices.", max_tokens=1500)
    seen: list[Delta] = []
    with pytest.raises(Cancelled):
        for delta in host.run(req, timeout_s=REQUEST_TIMEOUT_S):
            seen.append(delta)
            if len(seen) == 3:
                host.cancel(req.request_id)
    assert len(seen) >= 3 and not any(d.finished for d in seen)
    assert len(tokens(seen)) < 1500
    stats = wait_for(host, lambda s: s.unfinished == 0 and s.aborted > before)
    assert stats.unfinished == 0, "the engine still holds the cancelled request"
    assert stats.aborted == before + 1


def test_warm_prompts_give_prefix_cache_hits(host: EngineHost, tokenizer: Any) -> None:
    # Unique per run so no earlier test cached it; long enough for many 16/32-token blocks.
    prefix = f"Ticket {uuid.uuid4().hex}. " + SYSTEM_PROMPT
    assert len(tokenizer(prefix)["input_ids"]) >= 8 * 32
    warm(host, [prefix])  # a new prefix: the warm request itself finds nothing cached
    after_warm = host.engine.stats().prefix_hits_tokens
    assert_complete(collect(host, request(prefix + QUESTION)), MAX_TOKENS)
    stats = wait_for(host, lambda s: s.prefix_hits_tokens >= after_warm + 4 * 32)
    assert stats.prefix_hits_tokens >= after_warm + 4 * 32, (
        f"the warmed prefix was not reused: hits {after_warm} -> {stats.prefix_hits_tokens}")
    assert stats.prefix_queries_tokens >= stats.prefix_hits_tokens


def test_concurrent_requests_are_batched(host: EngineHost) -> None:
    """The running count, sampled during this test's own load, shows several requests in
    one step (the engine idle before it, so no earlier test's figure counts)."""
    n, results = 8, {}
    gate = threading.Barrier(n)
    assert wait_for(host, lambda s: s.running == 0).running == 0

    def one(i: int) -> None:
        gate.wait()
        results[i] = collect(host, request(f"Order {i}: where is my parcel?", max_tokens=32))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    running = []
    while any(t.is_alive() for t in threads):
        running.append(host.engine.stats().running)
        time.sleep(0.005)  # the sampling period, not a wait for anything
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S)
    assert sorted(results) == list(range(n))
    for deltas in results.values():
        assert_complete(deltas, 32)
    assert max(running) > 1, f"running counts seen during the load: {sorted(set(running))}"


def test_an_own_request_takes_a_slot_from_a_borrowed_one(host: EngineHost,
                                                        tokenizer: Any) -> None:
    """Every slot runs a borrowed request (another lane's job on a lent slot, priority
    BORROWED); an own request arrives. It runs at once, preempting one of them, and ends
    while all of them still run; each borrowed request then ends with all its tokens, and
    greedy, the same tokens as when nothing preempts it: no gap, no repeat."""
    if host.engine.kind == "trtllm":
        pytest.skip("the TensorRT-LLM adapter does not map EngineRequest.priority yet")
    slots, long = host.engine.config.slots, 200
    prompts = [f"Borrowed {i}: list the invoices of order {i}." for i in range(slots)]
    assert wait_for(host, lambda s: s.running == 0).running == 0

    def load(priority: int) -> dict[int, list[Delta]]:
        results: dict[int, list[Delta]] = {}

        def one(i: int) -> None:
            results[i] = collect(host, request(prompts[i], max_tokens=long, temperature=0.0,
                                               priority=priority))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(slots)]
        for t in threads:
            t.start()
        if priority == BORROWED:
            assert wait_for(host, lambda s: s.running == slots, 60).running == slots
            urgent = collect(host, request("Revenue this quarter?", max_tokens=4, priority=OWN))
            assert_complete(urgent, 4)
            assert not results, "a borrowed request ended before the own one"
        for t in threads:
            t.join(timeout=REQUEST_TIMEOUT_S)
        return results

    preempted = load(BORROWED)
    undisturbed = load(OWN)
    for i in range(slots):
        assert_complete(preempted[i], long)
        assert "".join(d.text for d in preempted[i]) == tokenizer.decode(tokens(preempted[i]))
        assert tokens(preempted[i]) == tokens(undisturbed[i]), f"request {i}"


def test_precision_is_reported_as_configured(host: EngineHost) -> None:
    stats = host.engine.stats()
    assert stats.kind == host.engine.kind
    if host.engine.kind != "sim":
        assert stats.kv_cache_dtype == EXPECTED_KV
        assert stats.kv_capacity_tokens > 0
        return
    # The simulator has no kernels to fall back from; what it must show is that the
    # precision it reports is the one it models: an FP8 KV cache holds twice the tokens
    # of a 16-bit one in the same memory.
    from workers.sim_engine import SimEngine

    assert stats.kv_cache_dtype == KV_CACHE_DTYPE
    config = replace(host.engine.config, kv_cache_dtype="auto")
    async def stats_of_a_16_bit_one() -> EngineStats:
        sixteen = SimEngine(config, profile=SIM_PROFILE)
        await sixteen.start()
        try:
            return sixteen.stats()
        finally:
            await sixteen.shutdown()

    wide = asyncio.run(stats_of_a_16_bit_one())
    assert wide.kv_cache_dtype == "auto"
    assert stats.kv_capacity_tokens == 2 * wide.kv_capacity_tokens


def test_prompt_longer_than_context_is_refused(host: EngineHost, tokenizer: Any) -> None:
    before = host.engine.stats()
    prompt = WORD * (MAX_MODEL_LEN + 500)
    assert len(tokenizer(prompt)["input_ids"]) > MAX_MODEL_LEN
    with pytest.raises(EngineError):
        collect(host, request(prompt))
    # A refused request is not an aborted one, and the engine keeps serving.
    assert_complete(collect(host, request("Is my invoice paid?")), MAX_TOKENS)
    stats = wait_for(host, lambda s: s.unfinished == 0)
    assert (stats.unfinished, stats.aborted) == (0, before.aborted)


def test_max_tokens_beyond_context_stops_at_the_limit(host: EngineHost,
                                                      tokenizer: Any) -> None:
    prompt = WORD * (MAX_MODEL_LEN - 40)
    assert len(tokenizer(prompt)["input_ids"]) == MAX_MODEL_LEN - 40
    deltas = collect(host, request(prompt, max_tokens=500))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].prompt_tokens == MAX_MODEL_LEN - 40
    assert len(tokens(deltas)) == 40  # the context is full: prompt + output = the limit


def greedy(host: EngineHost, prompt: str, max_tokens: int, **kw: Any) -> list[Delta]:
    return collect(host, request(prompt, max_tokens=max_tokens, temperature=0.0, **kw))


def test_a_resumed_request_goes_on_after_the_tokens_it_is_given(host: EngineHost) -> None:
    """What "no gap, no repeat" rests on: an attempt that resumes with the tokens an
    earlier one streamed gets exactly the rest of the output the first would have made."""
    prompt = "Where is my refund for order 4411?"
    whole = tokens(greedy(host, prompt, 16))
    assert len(whole) == 16
    rest = greedy(host, prompt, 10, resume_token_ids=tuple(whole[:6]))
    assert tokens(rest) == whole[6:]
    assert rest[-1].finish_reason == "length"


def test_a_stop_string_ends_the_output_before_it(host: EngineHost) -> None:
    prompt = "Please list the invoices of March."
    deltas = greedy(host, prompt, 24)
    text = "".join(d.text for d in deltas)
    # A stop string from the middle of the output: the first delta's text, after the
    # fifth, that is not found earlier in the text (so the cut is where it first appears).
    stop = next((d.text for d in deltas[5:-2] if d.text.strip() and text.find(d.text) >=
                 len("".join(x.text for x in deltas[:5]))), None)
    assert stop is not None, f"no usable stop string in the greedy output {deltas!r}"
    stopped = greedy(host, prompt, 24, stop=(stop,))
    assert "".join(d.text for d in stopped) == text[:text.find(stop)]
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"


def test_a_cache_salt_shares_prefix_blocks_only_with_its_own_salt(host: EngineHost,
                                                                 tokenizer: Any) -> None:
    """Two tenants' identical prompts never share KV blocks: a salted prefix is reused by
    a request of the same salt, not by one of another salt or none."""
    prefix = f"Account {uuid.uuid4().hex}. " + SYSTEM_PROMPT
    assert len(tokenizer(prefix)["input_ids"]) >= 8 * 32
    assert_complete(collect(host, request(prefix + QUESTION, cache_salt="tenant-a")),
                    MAX_TOKENS)

    prompt_tokens = len(tokenizer(prefix + QUESTION)["input_ids"])

    def hits_of(salt: str | None) -> int:
        before = wait_for(host, lambda s: s.unfinished == 0)
        assert_complete(collect(host, request(prefix + QUESTION, cache_salt=salt)),
                        MAX_TOKENS)
        # The counters arrive a step after the tokens: wait until this request's prompt
        # was counted as queried, so a hit not yet counted cannot pass for no hit.
        after = wait_for(host, lambda s: s.prefix_queries_tokens >=
                         before.prefix_queries_tokens + prompt_tokens - 1)
        assert after.prefix_queries_tokens >= before.prefix_queries_tokens + prompt_tokens - 1
        return after.prefix_hits_tokens - before.prefix_hits_tokens

    assert hits_of("tenant-b") < 32, "another tenant's salt reused tenant-a's blocks"
    assert hits_of(None) < 32, "an unsalted request reused tenant-a's blocks"
    assert hits_of("tenant-a") >= 4 * 32, "the same salt did not reuse its own prefix"


def serves_loras(host: EngineHost) -> bool:
    return bool(host.engine.config.lora_adapters)


def test_a_lora_request_runs_its_adapter_and_a_plain_one_the_base(host: EngineHost) -> None:
    """The adapter changes the greedy output (the test adapter's weights are made to), the
    same request gives the same output again, and the base's output is untouched by it."""
    prompt = "Please check the status of my refund"
    if not serves_loras(host):
        with pytest.raises(EngineError, match="LoRA"):
            greedy(host, prompt, 8, lora=ADAPTER)
        return
    base = tokens(greedy(host, prompt, 16))
    tuned = greedy(host, prompt, 16, lora=ADAPTER)
    assert tuned[-1].finished and len(tokens(tuned)) == 16
    assert tokens(tuned) != base, "the adapter changed nothing"
    assert tokens(greedy(host, prompt, 16, lora=ADAPTER)) == tokens(tuned)
    assert tokens(greedy(host, prompt, 16)) == base


def test_lora_and_base_requests_batched_together_keep_their_own_outputs(
        host: EngineHost) -> None:
    """One batch mixing the adapter's requests and the base's: each output is what it is
    alone (no adapter leaks into a base row, nor the base into an adapter's)."""
    if not serves_loras(host):
        pytest.skip("this engine serves no LoRA adapters (its refusal is tested above)")
    prompts = [f"Where is the refund for order {n}?" for n in range(4)]
    alone = {(p, lora): tokens(greedy(host, p, 12, lora=lora))
             for p in prompts for lora in (None, ADAPTER)}
    results: dict[tuple[str, str | None], list[int]] = {}

    def run(p: str, lora: str | None) -> None:
        results[(p, lora)] = tokens(greedy(host, p, 12, lora=lora))

    threads = [threading.Thread(target=run, args=key) for key in alone]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S)
    assert results == alone


def test_an_unknown_lora_is_refused(host: EngineHost) -> None:
    with pytest.raises(EngineError, match="not-an-adapter"):
        greedy(host, "Where is my parcel?", 4, lora="not-an-adapter")
