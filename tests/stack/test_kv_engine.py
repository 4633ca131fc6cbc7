"""Session-priority eviction on a real vLLM engine (the CPU build): the plugin against
stock vLLM, on a deliberately small KV cache (40 blocks of 32 tokens).

Three engines for the module, each started once: `session` (the plugin's policy), `lru`
(the plugin loaded, stock order) and `stock` (vLLM with no plugin loaded at all). What a
test reads is vLLM's own count of prompt tokens served from the prefix cache for each
request (`num_cached_tokens`), the figure a user sees as `cached_tokens` on the job.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.engine import EngineConfig, EngineRequest
from workers.host import EngineHost
from workers.kvcache.textgen import BlockText
from workers.vllm_engine import VllmEngine

BLOCK = 32  # tokens per KV block: the smallest the CPU attention backend takes
CAPACITY = 40  # blocks, the null block included: 39 usable
MAX_MODEL_LEN = 1024  # vLLM wants one full-length request to fit the cache
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def text(model_path: Path) -> BlockText:
    return BlockText(model_path)


def _start(model_path: Path, policy: str, plugins_off: bool = False) -> EngineHost:
    config = EngineConfig(model=str(model_path), kv_cache_dtype="auto", slots=4,
                          max_model_len=MAX_MODEL_LEN, kv_policy=policy,
                          kv_cache_blocks=CAPACITY, kv_block_size=BLOCK)
    host = EngineHost(VllmEngine(config))
    saved = os.environ.get("VLLM_PLUGINS")
    if plugins_off:  # an allowlist naming no plugin: vLLM as shipped
        os.environ["VLLM_PLUGINS"] = ""
    try:
        host.start()
    except BaseException:
        host.stop()
        raise
    finally:
        if plugins_off:
            os.environ.pop("VLLM_PLUGINS") if saved is None else os.environ.update(
                VLLM_PLUGINS=saved)
    return host


@pytest.fixture(scope="module")
def hosts(model_path: Path) -> Iterator[dict[str, EngineHost]]:
    started: dict[str, EngineHost] = {}
    try:
        for kind in ("session", "lru"):
            started[kind] = _start(model_path, kind)
        yield started
    finally:
        for host in started.values():
            host.stop()


@pytest.fixture(params=["session", "lru"])
def engine(request: pytest.FixtureRequest, hosts: dict[str, EngineHost]
           ) -> tuple[str, EngineHost]:
    return request.param, hosts[request.param]


def run(host: EngineHost, prompt: str, session: str | None = None, turn: int = 0) -> int:
    """One request to its first token; returns its prefix cache hit, in tokens."""
    request = EngineRequest(request_id=uuid.uuid4().hex, prompt=prompt, max_tokens=1,
                            temperature=0.0, session_id=session, turn=turn, lane="chat")
    cached = [d.cached_tokens for d in host.run(request, timeout_s=120) if d.cached_tokens]
    return cached[0] if cached else 0


def blocks(text: BlockText, first_id: int, n: int) -> str:
    return "".join(text.block(first_id + k, BLOCK) for k in range(n))


def flood_scenario(host: EngineHost, text: BlockText, base: int) -> list[int]:
    """A short session's first turn, six one-shot requests that together need more than the
    cache, then the session's second turn. Returns every request's cached tokens."""
    host.reset_prefix_cache()
    history = blocks(text, base, 10)
    hits = [run(host, history + " refund", "short", 1)]
    hits += [run(host, blocks(text, base + 100 * (k + 1), 8)) for k in range(6)]
    hits.append(run(host, history + blocks(text, base + 900, 2), "short", 2))
    return hits


def long_vs_short_scenario(host: EngineHost, text: BlockText, base: int) -> list[int]:
    """A short session (turn 1) and a long one (turn 12) of 6 blocks each, the short one
    freed first; one 30-block request that must evict some of them; then both sessions'
    next turns, the long one's first (so that its own new blocks evict nothing it is
    about to read). Returns every request's cached tokens."""
    host.reset_prefix_cache()
    short, long = blocks(text, base, 6), blocks(text, base + 50, 6)
    hits = [run(host, short + " order", "short", 1), run(host, long + " order", "long", 12)]
    hits.append(run(host, blocks(text, base + 200, 30)))
    hits.append(run(host, long + blocks(text, base + 850, 1), "long", 13))
    hits.append(run(host, short + blocks(text, base + 800, 1), "short", 2))
    return hits


def test_a_short_sessions_prefix_survives_a_one_shot_flood(engine: tuple[str, EngineHost],
                                                            text: BlockText) -> None:
    kind, host = engine
    hits = flood_scenario(host, text, base=1000)
    assert hits[1:-1] == [0] * 6  # unique one-shot contexts never hit
    if kind == "session":
        assert hits[-1] == 10 * BLOCK  # the whole history came back from the cache
    else:
        assert hits[-1] == 0  # LRU let the flood push it out


def test_a_long_sessions_turns_go_before_a_short_sessions(engine: tuple[str, EngineHost],
                                                          text: BlockText) -> None:
    kind, host = engine
    long_next, short_next = long_vs_short_scenario(host, text, base=5000)[-2:]
    if kind == "session":
        assert short_next == 6 * BLOCK and long_next < 6 * BLOCK
    else:  # LRU: the short session was freed first, so it goes first
        assert short_next < 6 * BLOCK and long_next == 6 * BLOCK


def test_plugin_off_is_stock_vllm(model_path: Path, hosts: dict[str, EngineHost],
                                  text: BlockText) -> None:
    """The plugin loaded with the lru policy and vLLM without any plugin serve every
    request of both scenarios with the same prefix hits."""
    def both(host: EngineHost) -> list[int]:
        return flood_scenario(host, text, 20000) + long_vs_short_scenario(host, text, 30000)

    stock = _start(model_path, "lru", plugins_off=True)
    try:
        seen = both(stock)
        assert stock.engine.stats().avg_cache_allocation_latency_ms is None  # no plugin ran
    finally:
        stock.stop()
    assert both(hosts["lru"]) == seen
    assert any(seen)  # the scenarios do hit the cache somewhere


def test_engine_reports_allocation_latency_and_evictions(engine: tuple[str, EngineHost],
                                                         text: BlockText) -> None:
    kind, host = engine
    flood_scenario(host, text, base=40000)
    stats = host.engine.stats()
    assert stats.avg_cache_allocation_latency_ms is not None
    assert 0 < stats.avg_cache_allocation_latency_ms < 1000
    assert stats.kv_evictions > 0 and stats.kv_policy == kind
    assert stats.prefix_queries_tokens > 0
