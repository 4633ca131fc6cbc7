"""End to end: tidegate (HTTP submit -> Redis lane -> Celery worker -> vLLM -> Redis -> SSE)
against vLLM's own OpenAI-compatible server, same checkpoint, same precision, same load.

The two systems run one after the other, never together: the machine has few cores and
the client shares them. Each system gets a warm-up round, then ROUNDS measured rounds of
CONCURRENCY requests launched at once; latencies are pooled over all measured requests,
throughput is the median of the rounds. Everything is timed on the client:
TTFT = first token received - submit start; TPOT = (last token - first token) / (tokens - 1).

    .venv/bin/python bench/e2e.py        (or `make bench`)

Writes bench/results/e2e.{md,png,json}; the last stdout line is the JSON summary.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/e2e.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.e2e, then exits

import sys
from typing import Any

from bench.common import fmt, markdown_table, ratio
from bench.stack import (
    DTYPE,
    MAX_TOKENS,
    LoadFn,
    Measured,
    RequestSpec,
    measure_peer,
    measure_tidegate,
    phases_note,
    publish,
    run_benchmark,
    run_load,
    shared_notes,
    shared_setup,
    summarize,
    tidegate_phases,
    ttfts,
)

LANE = "finance"  # FP16 weights and KV cache: the same precision as the peer below
CONCURRENCY = 64  # = tidegate's engine slots and the peer's --max-num-seqs
ROUNDS = 3
WARMUP = 8
WORKER = "finance-bench@tidegate"
# The production store. A SQLite file serialises every write of the API and the worker
# behind one lock, and its busy handler sleeps: 64 jobs admitted at once waited seconds
# for their rows (TTFT p50 1.5 s with the engine a third busy, 2026-12-06).
STORE = "private database on the machine's PostgreSQL (127.0.0.1:5432)"

TOPICS = ["quarter-end ledger", "refund backlog", "invoice disputes", "cash position",
          "vendor payments", "expense claims", "currency exposure", "audit findings"]


def prompt(round_no: int, i: int) -> str:
    # Distinct per round so later rounds do not ride on whole-prompt cache hits from earlier
    # ones; the shared tail is what business traffic looks like. Same text for both systems.
    topic = TOPICS[i % len(TOPICS)]
    return (f"Round {round_no}, request {i}. Summarise the {topic} for account {1000 + i} "
            "in three short points for the finance team.")


def plan(round_no: int) -> list[RequestSpec]:
    """Round 0 is the warm-up (WARMUP requests); a measured round launches CONCURRENCY."""
    n = WARMUP if round_no == 0 else CONCURRENCY
    return [RequestSpec(prompt(round_no, i), LANE) for i in range(n)]


def load(name: str) -> LoadFn:
    return lambda session: run_load(name, session, plan, ROUNDS)


# ---------------------------------------------------------------- report


METRICS = [("tokens/s", "tokens_per_s", 0), ("TTFT p50 (ms)", "ttft_p50_ms", 1),
           ("TTFT p99 (ms)", "ttft_p99_ms", 1), ("TPOT p50 (ms)", "tpot_p50_ms", 2),
           ("TPOT p99 (ms)", "tpot_p99_ms", 2)]


def table(tide: dict[str, Any], peer: dict[str, Any]) -> str:
    headers = ["system"] + [label for label, _, _ in METRICS] + ["errors"]
    rows = [[name] + [fmt(s[key], d) for _, key, d in METRICS] + [f"{s['errors']}/{s['requests']}"]
            for name, s in (("tidegate", tide), ("vLLM server", peer))]
    rows.append(["ratio (tidegate / vLLM)"]
                + [fmt(ratio(tide[key], peer[key]), 2) for _, key, _ in METRICS] + [""])
    return markdown_table(headers, rows)


def setup(m: Measured) -> dict[str, Any]:
    return {"dtype": f"{DTYPE} weights and KV cache (tidegate lane `{LANE}`)",
            "concurrency": CONCURRENCY, "warm-up requests": WARMUP, "rounds": ROUNDS,
            "tidegate store / broker": f"{STORE} / private redis-server",
            "tidegate worker": f"1 Celery worker, lane `{LANE}`, {CONCURRENCY} engine slots",
            **shared_setup(m)}


def figures(tide: dict[str, Any], peer: dict[str, Any], setup_: dict[str, Any],
            wall_s: float) -> dict[str, Any]:
    ratios = {f"{key.removesuffix('_ms')}_ratio": ratio(tide[key], peer[key])
              for _, key, _ in METRICS[1:]}
    return {"benchmark": "e2e", "throughput_ratio": ratio(tide["tokens_per_s"],
                                                          peer["tokens_per_s"]),
            **ratios, "tidegate": tide, "vllm_server": peer, "setup": setup_,
            "wall_s": round(wall_s, 1)}


def report(m: Measured) -> dict[str, Any]:
    tide = {**summarize(m.tide), **tidegate_phases(m.tide)}
    peer = summarize(m.peer)
    setup_ = setup(m)
    notes = [*shared_notes(m), "Latency percentiles pool all measured requests; errored "
             "requests are left out of them.", phases_note(tide)]
    out = figures(tide, peer, setup_, m.wall_s)
    publish("e2e", "End to end: tidegate vs vLLM's OpenAI server", table(tide, peer), setup_,
            notes, {"tidegate": ttfts(m.tide), "vLLM server": ttfts(m.peer)},
            f"TTFT, {CONCURRENCY} concurrent requests x {MAX_TOKENS} tokens, {ROUNDS} rounds "
            f"pooled ({DTYPE}, {setup_['machine cores']} cores)", out)
    return out


# ---------------------------------------------------------------- main


def main() -> int:
    return run_benchmark(
        "e2e",
        lambda tmp: measure_tidegate(tmp, {LANE: WORKER}, CONCURRENCY, load("tidegate"),
                                     postgresql=True),
        lambda tmp: measure_peer(tmp, CONCURRENCY, CONCURRENCY * 2, load("vLLM server")),
        report)


if __name__ == "__main__":
    sys.exit(main())
