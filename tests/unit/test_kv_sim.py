"""The trace simulator (workers/kvcache/sim.py) on small hand-built traces, the trace
reader and writer (trace.py) and the synthetic trace generator (synth.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from workers.kvcache.policy import SessionMeta
from workers.kvcache.sim import SimResult, replay
from workers.kvcache.synth import SynthParams, synthesize
from workers.kvcache.trace import (
    TraceError,
    TraceRequest,
    read_trace,
    regroup,
    session_metas,
    write_trace,
)

B = 16  # tokens in a trace block


def req(chat_id: int, at: float, hash_ids: Sequence[int], input_length: int | None = None,
        parent: int = -1, turn: int = 1, kind: str = "text") -> TraceRequest:
    """A request; by default its input is exactly its blocks, the last one full."""
    return TraceRequest(chat_id=chat_id, parent_chat_id=parent, timestamp=at,
                        input_length=len(hash_ids) * B if input_length is None else input_length,
                        output_length=10, type=kind, turn=turn, hash_ids=tuple(hash_ids))


def run(requests: list[TraceRequest], policy: str, capacity: int | None,
        metas: list[SessionMeta] | None = None, **kw: object) -> SimResult:
    metas = list(session_metas(requests)) if metas is None else metas
    return replay(requests, metas, policy, capacity, **kw)  # type: ignore[arg-type]


# --- policies against each other ---------------------------------------------------------


CAPACITIES = (40, 150, 500, 1500)
POLICIES = ("infinite", "belady", "session", "lru")


@pytest.fixture(scope="module")
def synth_results() -> dict[tuple[str, int], SimResult]:
    """Every policy at every capacity on one small synthetic trace (about 260 requests)."""
    requests = synthesize(SynthParams(sessions=25, seed=3))
    metas = list(session_metas(requests))
    return {(p, c): replay(requests, metas, p, c) for p in POLICIES for c in CAPACITIES}


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_policies_are_bounded_by_belady_and_the_infinite_cache(
        synth_results: dict[tuple[str, int], SimResult], capacity: int) -> None:
    rate = {p: synth_results[p, capacity].hit_rate for p in POLICIES}
    assert 0 < rate["infinite"] <= 1
    assert rate["infinite"] >= rate["belady"] >= rate["session"]
    assert rate["belady"] >= rate["lru"]


def test_session_policy_beats_lru_on_the_synthetic_trace(
        synth_results: dict[tuple[str, int], SimResult]) -> None:
    for capacity in CAPACITIES[1:]:
        assert synth_results["session", capacity].hit_rate > \
            synth_results["lru", capacity].hit_rate, capacity
    rates = [synth_results["lru", c].hit_rate for c in CAPACITIES]
    assert rates == sorted(rates)  # a bigger cache never hits less
    first = synth_results["session", CAPACITIES[0]]
    assert len(first.hits_per_request) == first.requests
    assert first.input_tokens == synth_results["infinite", CAPACITIES[0]].input_tokens


def flood_trace() -> list[TraceRequest]:
    """A short session's first turn, five one-shot requests, then its second turn."""
    history = [1, 2, 3, 4, 5]  # 4 full blocks and a partial one
    trace = [req(1, 0.0, history, input_length=4 * B + 8)]
    trace += [req(10 + n, 1.0 + n, [100 + 10 * n + k for k in range(5)],
                  input_length=4 * B + 8, kind="oneshot") for n in range(5)]
    trace.append(req(2, 10.0, [1, 2, 3, 4, 6, 7], input_length=5 * B + 8, parent=1, turn=2))
    return trace


def test_a_live_sessions_prefix_survives_a_one_shot_flood() -> None:
    trace = flood_trace()
    session = run(trace, "session", 12)
    lru = run(trace, "lru", 12)
    assert session.hits_per_request[-1] == 4 * B  # the whole history, from the cache
    assert lru.hits_per_request[-1] == 0  # LRU let the flood push it out
    assert session.hits_per_request[:-1] == lru.hits_per_request[:-1] == [0] * 6


def long_and_short(short_at: float, long_at: float) -> tuple[list[TraceRequest],
                                                             list[SessionMeta]]:
    """A short session's first turn and a long session's tenth (4 cached blocks each), a
    one-shot request that must evict 4 of those 8 blocks, then both sessions' next turns."""
    trace = [req(1, short_at, [201, 202, 203, 204, 205], input_length=4 * B + 8),
             req(2, long_at, [101, 102, 103, 104, 105], input_length=4 * B + 8),
             # 8 blocks: the 4 never cached, then 4 of the sessions'
             req(3, long_at + 1, list(range(300, 308)), input_length=7 * B + 8, kind="oneshot"),
             req(4, long_at + 2, [101, 102, 103, 104, 106], input_length=4 * B + 8),
             req(5, long_at + 3, [201, 202, 203, 204, 206], input_length=4 * B + 8)]
    metas = [SessionMeta("short", turn=1), SessionMeta("long", turn=10), SessionMeta(None),
             SessionMeta("long", turn=11), SessionMeta("short", turn=2)]
    return trace, metas


def test_a_long_session_is_evicted_before_a_short_one() -> None:
    trace, metas = long_and_short(short_at=0.0, long_at=1.0)
    session = run(trace, "session", 12, metas)
    assert session.hits_per_request[3:] == [0, 4 * B]  # turn 10 ranks 50, turn 1 ranks 80
    lru = run(trace, "lru", 12, metas)
    assert lru.hits_per_request[3:] == [4 * B, 0]  # LRU evicts the older: the short one


@pytest.mark.parametrize(("short_at", "long_next_hit", "short_next_hit"), [
    (50.0, 0, 4 * B),  # 51 s quiet at the one-shot: still live (80), the long one goes
    (10.0, 4 * B, 0),  # 91 s quiet: lapsed to 35, below the live long session (50)
])
def test_a_quiet_short_session_lapses_below_a_live_long_one(
        short_at: float, long_next_hit: int, short_next_hit: int) -> None:
    trace, metas = long_and_short(short_at=short_at, long_at=100.0)
    result = run(trace, "session", 12, metas)
    assert result.hits_per_request[3:] == [long_next_hit, short_next_hit]


@pytest.mark.parametrize("policy", ["lru", "session", "belady", "infinite"])
def test_the_last_input_token_is_always_computed(policy: str) -> None:
    trace = [req(1, 0.0, [1, 2, 3, 4]),  # 64 tokens: 4 full blocks
             req(2, 1.0, [1, 2, 3, 4]),  # the same prompt hits 3 of them
             req(3, 2.0, [1, 2, 3, 4, 5], input_length=4 * B + 1),  # one token more: all 4
             req(4, 3.0, [1, 2, 3, 9])]  # a different last block: 3
    result = run(trace, policy, 64)
    assert result.hits_per_request == [0, 3 * B, 4 * B, 3 * B]
    assert result.hit_tokens == 10 * B
    assert result.input_tokens == 3 * 4 * B + 4 * B + 1


def test_regroup_merges_trace_blocks_into_engine_blocks() -> None:
    r = req(1, 0.0, [1, 2, 3, 4, 5], input_length=4 * B + 3)
    assert regroup(r, 32).hash_ids == (2, 4, 5)  # a block takes the id of its last part
    assert regroup(r, 64).hash_ids == (4, 5)
    assert regroup(r, 16) == r
    assert regroup(r, 32).input_length == r.input_length
    with pytest.raises(ValueError, match="multiple of 16"):
        regroup(r, 24)


@pytest.mark.parametrize(("block_tokens", "hit"), [(16, 3 * B), (32, 2 * B)])
def test_bigger_engine_blocks_lose_the_partial_match(block_tokens: int, hit: int) -> None:
    trace = [req(1, 0.0, [1, 2, 3, 4, 5]),  # 80 tokens
             req(2, 1.0, [1, 2, 3, 9, 10])]  # shares the first 48 tokens
    for policy in ("lru", "session", "belady", "infinite"):
        result = run(trace, policy, 64, block_tokens=block_tokens)
        assert result.hits_per_request == [0, hit], policy


@pytest.mark.parametrize("policy", ["lru", "session", "belady"])
def test_a_request_bigger_than_the_cache_is_computed_not_kept(policy: str) -> None:
    prompt = req(1, 0.0, [1, 2, 3], input_length=2 * B + 8)
    huge = req(2, 1.0, [1, 2, *range(20, 28)])  # 10 blocks into a cache of 4
    trace = [prompt, huge, replace(prompt, chat_id=3, timestamp=2.0)]
    result = run(trace, policy, 4)
    assert result.hits_per_request == [0, 2 * B, 2 * B]  # its hits counted and kept
    assert result.requests == 3
    assert 0 < result.hit_rate < 1


def test_a_cache_too_small_for_any_request_reports_no_hits() -> None:
    trace = [req(n, float(n), list(range(1, 6))) for n in range(4)]
    for policy in ("lru", "session"):
        result = run(trace, policy, 2)
        assert result.hits_per_request == [0, 0, 0, 0]
        assert result.summary()["hit_rate"] == 0.0


def test_replay_rejects_a_bad_policy_or_capacity() -> None:
    trace = [req(1, 0.0, [1, 2])]
    with pytest.raises(ValueError, match="'fifo'"):
        run(trace, "fifo", 4)
    with pytest.raises(ValueError, match="capacity_blocks"):
        run(trace, "lru", 0)


def test_summary_is_what_the_cli_prints() -> None:
    result = run([req(1, 0.0, [1, 2]), req(2, 1.0, [1, 2, 3])], "session", 8)
    summary = result.summary()
    assert json.loads(json.dumps(summary)) == {
        "policy": "session", "capacity_blocks": 8, "requests": 2, "input_tokens": 80,
        "hit_tokens": 32, "hit_rate": 0.4}


# --- trace files -------------------------------------------------------------------------


def test_trace_round_trips_in_timestamp_order(tmp_path: Path) -> None:
    trace = [req(2, 5.5, [1, 2, 9], input_length=40, parent=1, turn=2),
             req(1, 0.25, [1, 2], input_length=20),
             req(3, 3.0, [], input_length=0, kind="oneshot")]
    path = tmp_path / "deep" / "trace.jsonl"
    assert write_trace(path, trace) == 3
    assert read_trace(path) == sorted(trace, key=lambda r: r.timestamp)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["hash_ids"] == [1, 2, 9] and first["parent_chat_id"] == 1


def test_a_missing_field_names_the_line_and_field(tmp_path: Path) -> None:
    good = req(1, 0.0, [1]).to_json()
    body = json.loads(good)
    del body["input_length"]
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n\n{json.dumps(body)}\n")
    with pytest.raises(TraceError, match=r"line 3: missing field 'input_length'"):
        read_trace(path)


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(req(1, 0.0, [1]).to_json() + "\n{not json\n")
    with pytest.raises(TraceError, match=r"t\.jsonl line 2: not JSON"):
        read_trace(path)


@pytest.mark.parametrize("line", ["42", "null", "[1, 2]", '"chat"'])
def test_a_line_that_is_not_an_object_is_named(tmp_path: Path, line: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(req(1, 0.0, [1]).to_json() + "\n" + line + "\n")
    with pytest.raises(TraceError, match="line 2"):
        read_trace(path)


def test_a_field_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    body = json.loads(req(1, 0.0, [1]).to_json())
    body["hash_ids"] = ["x"]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(body) + "\n")
    with pytest.raises(TraceError, match="line 1"):
        read_trace(path)


def test_a_missing_or_empty_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="nowhere.jsonl"):
        read_trace(tmp_path / "nowhere.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_session_metas_follow_parent_chains() -> None:
    trace = [req(1, 0.0, [1], turn=1),
             req(4, 1.0, [7], turn=1),
             req(6, 2.0, [9], kind="oneshot", turn=1),
             req(2, 3.0, [1, 2], parent=1, turn=2),
             req(5, 4.0, [7, 8], parent=4, turn=2),
             req(3, 5.0, [1, 2, 3], parent=2, turn=3),
             req(8, 6.0, [9, 10], parent=6, turn=2, kind="oneshot")]  # a follow-up is a session
    got = [(m.session_id, m.turn) for m in session_metas(trace, lane="support")]
    assert got == [("s1", 1), ("s4", 1), (None, 0), ("s1", 2), ("s4", 2), ("s1", 3), ("s6", 2)]
    assert {m.lane for m in session_metas(trace, lane="support")} == {"support"}
    assert all(m.live for m in session_metas(trace))


def test_session_metas_take_the_one_shot_types_given() -> None:
    trace = [req(1, 0.0, [1], kind="api"), req(2, 1.0, [2], kind="oneshot")]
    got = [m.session_id for m in session_metas(trace, one_shot_types={"api"})]
    assert got == [None, "s2"]


# --- synthetic traces ---------------------------------------------------------------------

SMALL = SynthParams(sessions=30, seed=7)


def test_synth_is_deterministic_in_its_seed() -> None:
    assert synthesize(SMALL) == synthesize(SMALL)
    assert synthesize(SMALL) != synthesize(SMALL.with_options(seed=8))


@pytest.mark.parametrize(("options", "field"), [
    ({"short_turns": (5, 2)}, "short_turns"),
    ({"long_turns": (0, 3)}, "long_turns"),
    ({"one_shot_share": 1.5}, "one_shot_share"),
    ({"one_shot_share": 1.0}, "one_shot_share"),
    ({"long_share": -0.1}, "long_share"),
    ({"think_time_s": -1.0}, "think_time_s"),
    ({"system_prompt_tokens": -5}, "system_prompt_tokens"),
    ({"sessions": 0}, "sessions"),
])
def test_invalid_synth_params_name_the_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        synthesize(SMALL.with_options(**options))


@pytest.mark.parametrize("share", [0.0, 0.3, 0.6])
def test_synth_one_shot_share_is_as_configured(share: float) -> None:
    trace = synthesize(SynthParams(sessions=60, seed=1, one_shot_share=share))
    one_shots = [r for r in trace if r.type == "oneshot"]
    assert abs(len(one_shots) / len(trace) - share) < 0.01
    assert all(r.parent_chat_id == -1 for r in one_shots)
    first_turns = [r for r in trace if r.type != "oneshot" and r.parent_chat_id == -1]
    assert len(first_turns) == 60


def test_synth_hash_ids_are_shared_only_as_prefixes() -> None:
    trace = synthesize(SMALL)
    seen: dict[int, tuple[int, int | None]] = {}  # id -> (position, the id before it)
    for r in trace:
        assert len(r.hash_ids) == -(-r.input_length // B)  # one id a 16-token block
        for pos, hash_id in enumerate(r.hash_ids):
            before = r.hash_ids[pos - 1] if pos else None
            assert seen.setdefault(hash_id, (pos, before)) == (pos, before), r.chat_id
    # ... and shared they are: system prompts across conversations, histories across turns
    counts: dict[int, int] = {}
    for r in trace:
        for hash_id in r.hash_ids:
            counts[hash_id] = counts.get(hash_id, 0) + 1
    assert max(counts.values()) > SMALL.sessions / (SMALL.lanes * SMALL.system_prompts)


def test_synth_turns_extend_their_parent() -> None:
    trace = synthesize(SMALL)
    by_id = {r.chat_id: r for r in trace}
    children = [r for r in trace if r.parent_chat_id >= 0]
    assert children
    for r in children:
        parent = by_id[r.parent_chat_id]
        assert r.turn == parent.turn + 1 and r.timestamp >= parent.timestamp
        full = parent.input_length // B
        assert r.hash_ids[:full] == parent.hash_ids[:full]
        assert r.input_length > parent.input_length
