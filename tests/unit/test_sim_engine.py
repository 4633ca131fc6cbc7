"""The simulated engine (workers/sim_engine.py) on a fake clock: the modelled step times
(what it asked to sleep, never wall-clock timing), admission by slots and KV blocks, the
prefix cache, aborts, resumed and repeated requests, and the profiles file."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from workers.engine import Delta, EngineConfig, EngineError, EngineRequest
from workers.sim_engine import SimEngine
from workers.sim_profile import SimProfile, load_profile
from workers.sim_tokens import Vocab

T = TypeVar("T")
B = 16  # tokens per KV block (the engine's default)
# Every term of the step, in round numbers: the expected sleeps are easy sums.
PROFILE = SimProfile("test", prefill_ms_per_token=0.01, decode_base_ms=1.0,
                     decode_ms_per_seq=0.5)
LONG = "Refund policy for orders shipped abroad, invoices and delivery dates. " * 6


@pytest.fixture(scope="module")
def vocab(model_path: Path) -> Vocab:
    return Vocab.load(str(model_path))


class FakeClock:
    """The engine's clock and sleep: a sleep moves the clock on at once, and is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if seconds:
            self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def run(body: Callable[..., Awaitable[T]], vocab: Vocab, profile: SimProfile = PROFILE,
        **config: Any) -> T:
    """`body(engine, clock)` against a started engine, in a fresh event loop."""
    async def main() -> T:
        clock = FakeClock()
        engine = SimEngine(EngineConfig(model="unused", **config), profile=profile,
                           vocab=vocab, sleep=clock.sleep, clock=clock)
        await engine.start()
        try:
            return await body(engine, clock)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def request(prompt: str = "Where is my order?", max_tokens: int = 5, **kw: Any) -> EngineRequest:
    return EngineRequest(request_id=kw.pop("request_id", uuid.uuid4().hex), prompt=prompt,
                         max_tokens=max_tokens, **kw)


async def collect(engine: SimEngine, req: EngineRequest) -> list[Delta]:
    return [d async for d in engine.generate(req)]


def tokens(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def ms(*values: float) -> Any:
    """Milliseconds as the seconds the engine sleeps, compared approximately."""
    return pytest.approx([v / 1000 for v in values])


# --- the timing model --------------------------------------------------------------


def test_step_time_is_base_plus_per_sequence_kv_and_prefill_terms() -> None:
    p = SimProfile("p", prefill_ms_per_token=0.04, decode_base_ms=6.0, decode_ms_per_seq=0.05,
                   decode_ms_per_1k_kv_tokens=0.04)
    assert p.step_s(0, 0, 0) == 0.0  # nothing to run: no step
    assert p.step_s(1, 0, 0) == pytest.approx(0.00605)
    assert p.step_s(64, 38_400, 0) == pytest.approx((6 + 3.2 + 1.536) / 1000)
    assert p.step_s(0, 0, 2048) == pytest.approx((6 + 81.92) / 1000)
    assert p.step_s(8, 0, 100) > p.step_s(8, 0, 0) > p.step_s(1, 0, 0)


def test_one_request_sleeps_a_prefill_step_then_one_decode_step_a_token(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        deltas = await collect(engine, request(max_tokens=5))
        prompt = deltas[0].prompt_tokens
        assert prompt is not None and len(tokens(deltas)) == 5
        # The prefill step brings the first token; four decode steps of one sequence follow.
        assert clock.sleeps == ms(1 + 0.01 * prompt, *[1.5] * 4)

    run(body, vocab)


def test_a_step_costs_more_with_more_sequences_running(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        reqs = [request(f"Order {i} where?", max_tokens=3) for i in range(4)]
        results = await asyncio.gather(*(collect(engine, r) for r in reqs))
        prompts = sum(d[0].prompt_tokens or 0 for d in results)
        # All four admitted together: one prefill step, then two decode steps of four.
        assert clock.sleeps == ms(1 + 0.01 * prompts, 3.0, 3.0)

    run(body, vocab)


def test_the_token_budget_chunks_a_long_prefill(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        deltas = await collect(engine, request(LONG, max_tokens=1))
        prompt = deltas[0].prompt_tokens or 0
        assert prompt > 100
        chunks = [100] * (prompt // 100) + ([prompt % 100] if prompt % 100 else [])
        assert clock.sleeps == ms(*(1 + 0.01 * n for n in chunks))

    run(body, vocab, profile=replace(PROFILE, max_batched_tokens=100))


def test_timer_slack_is_made_up_by_the_next_steps() -> None:
    """A real timer oversleeps; the engine aims each step at its modelled end."""
    async def body() -> list[float]:
        clock = FakeClock()
        engine = SimEngine(EngineConfig(model="unused"), profile=PROFILE, clock=clock,
                           sleep=clock.sleep)
        await engine._pace(0.010)
        clock.now += 0.004  # the timer woke 4 ms late
        await engine._pace(0.010)
        return clock.sleeps

    assert asyncio.run(body()) == pytest.approx([0.010, 0.006])


# --- prefix cache --------------------------------------------------------------------


def test_a_prefix_hit_shortens_prefill(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        first = await collect(engine, request(LONG, max_tokens=1))
        prompt = first[0].prompt_tokens or 0
        second = await collect(engine, request(LONG, max_tokens=1))
        cached = (prompt - 1) // B * B  # the last prompt token is always computed
        assert (first[0].cached_tokens, second[0].cached_tokens) == (0, cached)
        assert clock.sleeps == ms(1 + 0.01 * prompt, 1 + 0.01 * (prompt - cached))
        stats = engine.stats()
        assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens) == (2 * prompt, cached)

    run(body, vocab)


def test_a_cache_salt_shares_blocks_only_within_its_tenant(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> list[int | None]:
        hits = []
        for salt in ("tenant-a", "tenant-b", "tenant-a", None):
            deltas = await collect(engine, request(LONG, max_tokens=1, cache_salt=salt))
            hits.append(deltas[0].cached_tokens)
        return hits

    a, b, a_again, unsalted = run(body, vocab)
    assert (a, b, unsalted) == (0, 0, 0) and a_again and a_again > 0


def test_a_concurrent_request_hits_blocks_another_still_holds(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        first = asyncio.create_task(collect(engine, request(LONG, max_tokens=50)))
        while engine.stats().running == 0 or not clock.sleeps:
            await asyncio.sleep(0)
        second = await collect(engine, request(LONG, max_tokens=1))
        assert second[0].cached_tokens and second[0].cached_tokens > 0
        await first

    run(body, vocab)


def test_reset_prefix_cache_forgets_prefixes_when_idle(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        await collect(engine, request(LONG, max_tokens=1))
        running = asyncio.create_task(collect(engine, request(max_tokens=20)))
        while engine.stats().running == 0:
            await asyncio.sleep(0)
        assert await engine.reset_prefix_cache() is False  # a request holds blocks
        await running
        assert await engine.reset_prefix_cache() is True
        again = await collect(engine, request(LONG, max_tokens=1))
        assert again[0].cached_tokens == 0

    run(body, vocab)


def test_full_cache_evicts_and_counts_it(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        for i in range(6):
            await collect(engine, request(f"{i} {LONG}", max_tokens=1))
        stats = engine.stats()
        assert stats.kv_evictions > 0 and stats.kv_policy == "session"
        assert stats.avg_cache_allocation_latency_ms is not None

    run(body, vocab, kv_cache_blocks=40)


# --- admission: slots and KV blocks ----------------------------------------------------


def test_slots_cap_the_batch_and_the_rest_wait(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        tasks = [asyncio.create_task(collect(engine, request(f"Order {i}?", max_tokens=4)))
                 for i in range(5)]
        while not clock.sleeps:
            await asyncio.sleep(0)
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.unfinished) == (2, 3, 5)
        for deltas in await asyncio.gather(*tasks):
            assert len(tokens(deltas)) == 4 and deltas[-1].finish_reason == "length"
        assert engine.stats().max_running_seen == 2

    run(body, vocab, slots=2)


def test_a_more_urgent_request_takes_a_slot_and_the_preempted_one_goes_on(
        vocab: Vocab) -> None:
    """A borrowed request (priority 1) holds the only slot; an own one (0) arrives: it is
    admitted at the next step, and the borrowed one ends later with every token, the same
    tokens it would have made alone, and the prompt it was sent."""
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        alone = tokens(await collect(engine, request(max_tokens=12, request_id="borrowed",
                                                     priority=1)))
        first: list[float] = []

        async def own() -> list[Delta]:
            deltas = []
            async for d in engine.generate(request("Revenue?", max_tokens=3, priority=0)):
                first.append(clock.now) if not deltas else None
                deltas.append(d)
            return deltas

        steps = len(clock.sleeps)
        borrowed = [asyncio.create_task(collect(engine, request(
            max_tokens=12, request_id="borrowed", priority=1)))]
        while len(clock.sleeps) < steps + 4:  # the borrowed one prefilled and is decoding
            await asyncio.sleep(0)
        started = clock.now
        mine = await own()
        theirs = await borrowed[0]
        assert len(tokens(mine)) == 3 and first[0] - started < 0.01  # no wait for 12 tokens
        assert tokens(theirs) == alone and theirs[-1].finish_reason == "length"
        assert {d.prompt_tokens for d in theirs} == {len(vocab.encode("Where is my order?"))}
        assert engine._counts["preempted"] == 1

    run(body, vocab, slots=1)


def test_equal_priorities_never_preempt(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        done = await asyncio.gather(*(collect(engine, request(f"Order {i}?", max_tokens=6,
                                                              priority=1)) for i in range(3)))
        assert [len(tokens(d)) for d in done] == [6, 6, 6]
        assert engine._counts["preempted"] == 0

    run(body, vocab, slots=1)


def test_requests_wait_for_kv_blocks(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        # Each needs 2 blocks (a short prompt and 20 tokens); the cache holds 5.
        tasks = [asyncio.create_task(collect(engine, request("Hi?", max_tokens=20)))
                 for _ in range(4)]
        while not clock.sleeps:
            await asyncio.sleep(0)
        assert (engine.stats().running, engine.stats().waiting) == (2, 2)
        assert engine.stats().kv_usage == pytest.approx(4 / 5)
        await asyncio.gather(*tasks)
        stats = engine.stats()
        assert (stats.max_running_seen, stats.kv_usage, stats.finished_by_reason) == (
            2, 0.0, {"length": 4})
        with pytest.raises(EngineError, match="KV blocks"):
            await collect(engine, request("Hi?", max_tokens=100))  # never fits

    run(body, vocab, kv_cache_blocks=5)


def test_max_tokens_stops_at_the_context_and_a_long_prompt_is_refused(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        deltas = await collect(engine, request("Hi there?", max_tokens=500))
        prompt = deltas[-1].prompt_tokens or 0
        assert len(tokens(deltas)) == 64 - prompt and deltas[-1].finish_reason == "length"
        with pytest.raises(EngineError, match="maximum model length"):
            await collect(engine, request(LONG, max_tokens=1))
        assert engine.stats().unfinished == 0 and engine.stats().aborted == 0

    run(body, vocab, max_model_len=64)


# --- aborts --------------------------------------------------------------------------


def test_abort_ends_the_stream_with_abort_and_frees_its_blocks(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        req = request(max_tokens=1000)
        seen = []
        async for delta in engine.generate(req):
            seen.append(delta)
            if len(seen) == 3:
                await engine.abort(req.request_id)
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        assert len(tokens(seen)) == 3
        await engine.abort(req.request_id)  # twice: nothing more
        stats = engine.stats()
        assert (stats.aborted, stats.unfinished, stats.kv_usage) == (1, 0, 0.0)
        assert stats.finished_by_reason == {}

    run(body, vocab)


def test_a_cancelled_caller_aborts_its_request(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        task = asyncio.create_task(collect(engine, request(max_tokens=1000)))
        while len(clock.sleeps) < 3:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = engine.stats()
        assert (stats.aborted, stats.unfinished, stats.running, stats.kv_usage) == (1, 0, 0, 0.0)

    run(body, vocab)


# --- tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 0.8, "seed": 7},
    {"temperature": 0.8},  # no seed: the job id seeds it, and a resume keeps the job id
], ids=["greedy", "seeded", "unseeded"])
def test_a_resumed_request_continues_the_same_tokens(vocab: Vocab,
                                                     sampling: dict[str, Any]) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        whole = tokens(await collect(engine, request(max_tokens=12, request_id="job-1",
                                                     **sampling)))
        resumed = await collect(engine, request(max_tokens=7, request_id="job-1",
                                                resume_token_ids=tuple(whole[:5]), **sampling))
        assert tokens(resumed) == whole[5:]
        assert resumed[0].prompt_tokens == len(vocab.encode("Where is my order?")) + 5

    run(body, vocab)


def test_greedy_agrees_and_seeds_differ(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        async def out(**kw: Any) -> list[int]:
            return tokens(await collect(engine, request(max_tokens=16, **kw)))

        greedy = await out(temperature=0.0, seed=1)
        assert await out(temperature=0.0, seed=2) == greedy
        seeded = await out(temperature=1.0, seed=1)
        assert await out(temperature=1.0, seed=1) == seeded
        assert seeded not in (greedy, await out(temperature=1.0, seed=2))
        assert await out(temperature=1.0, seed=1, top_p=0.001) == await out(
            temperature=1.0, seed=2, top_p=0.001)

    run(body, vocab)


def test_streamed_text_is_the_decoded_tokens(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        deltas = await collect(engine, request(LONG, max_tokens=300, temperature=1.0))
        text = "".join(d.text for d in deltas)
        assert text and text == vocab.tokenizer.decode(tokens(deltas))
        assert not set(tokens(deltas)) & set(vocab.tokenizer.all_special_ids)

    run(body, vocab, max_model_len=4096)


def test_unknown_lora_is_refused_and_a_known_one_changes_the_tokens(vocab: Vocab) -> None:
    async def body(engine: SimEngine, clock: FakeClock) -> None:
        with pytest.raises(EngineError, match="unknown LoRA adapter"):
            await collect(engine, request(lora="nope"))
        base = tokens(await collect(engine, request(temperature=0.0, max_tokens=16)))
        tuned = tokens(await collect(engine, request(temperature=0.0, max_tokens=16,
                                                     lora="support")))
        assert base != tuned

    run(body, vocab, lora_adapters=(("support", "/unused"),))


# --- profiles ------------------------------------------------------------------------


def test_shipped_profiles_have_the_published_scale() -> None:
    assert load_profile("instant").step_s(64, 10_000, 1000) == 0.0
    h100 = load_profile("llama-3.1-8b-fp8-h100")
    assert 0.006 <= h100.step_s(1, 600, 0) <= 0.008  # batch 1: 6-8 ms a token
    assert 0.010 <= h100.step_s(64, 64 * 600, 0) <= 0.015  # batch 64: 10-15 ms
    prefill_per_s = 1 / (h100.prefill_ms_per_token / 1000)
    assert 10_000 <= prefill_per_s <= 60_000


def test_an_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(EngineError, match=r"unknown sim profile 'h100'; known: .*instant"):
        load_profile("h100")
    with pytest.raises(EngineError, match="unknown sim profile"):
        SimEngine(EngineConfig(model="unused"), profile="h100")


@pytest.mark.parametrize(("body", "error"), [
    ("[p]\ndecode_base_ms = -1\n", "decode_base_ms must be a number >= 0"),
    ("[p]\ndecode_base_ms = 'fast'\n", "decode_base_ms must be a number"),
    ("[p]\nstep_ms = 1\n", "unknown field 'step_ms'"),
    ("[p\n", "sim profiles"),
])
def test_a_bad_profile_file_is_an_error_naming_the_field(tmp_path: Path, body: str,
                                                         error: str) -> None:
    path = tmp_path / "profiles.toml"
    path.write_text(body)
    with pytest.raises(EngineError, match=error):
        load_profile("p", path)


def test_an_unknown_kv_policy_is_refused() -> None:
    with pytest.raises(EngineError, match="unknown KV policy"):
        SimEngine(EngineConfig(model="unused", kv_policy="fifo"))
