"""KV cache eviction: stock LRU against tidegate's session priority, in simulation and on a
real vLLM worker, and session affinity with two workers. One run.

1. Simulator (workers/kvcache/sim.py, the plugin's own queue and policy): hit rate against
   capacity on two synthetic traces (`tidegate kv synth`) for LRU, the session policy, the
   session policy without its decay by turn (an ablation), Belady's offline reference and
   the infinite-cache ceiling. Trace 1 is shaped like a customer-service deployment (long
   and short conversations, contexts of about 4,000 tokens, a share of one-shot requests
   with long unique contexts); trace 2 is mostly one-shot requests with unique retrieved
   context.
2. Real engine: a smaller trace of the same shape replayed through tidegate (HTTP submit
   with session ids, Celery, a vLLM CPU worker with a 64-block KV cache of 32-token
   blocks), one request at a time, with the plugin's session policy and with stock LRU.
   Hit rate from vLLM's own per-request count (`cached_tokens` of each job), set beside
   the simulator's on the same requests, timed as they were submitted; TTFT of follow-up
   turns from the job rows.
3. Affinity: the same replay on two workers of the lane (each on a core of its own, with a
   256-block cache, enough to keep conversations between their turns), with session
   affinity routing on and off.

Writes bench/results/kv.{md,png,json}; the last stdout line is the JSON summary.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/kv.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.kv, then exits

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidegate_client import Client

from bench.common import (
    RESULTS,
    fmt,
    log,
    machine,
    markdown_table,
    median,
    print_json_last,
    write_json,
    write_report,
)
from bench.stack import MODEL, exit_cleanly_on_signals, tidegate_stack
from tidegate.lanes import KvPolicy
from workers.kvcache.policy import SessionMeta
from workers.kvcache.sim import SimResult, replay
from workers.kvcache.synth import SynthParams, synthesize
from workers.kvcache.textgen import BlockText
from workers.kvcache.trace import TraceRequest, session_metas

TRACES = {
    "trace 1: customer service": SynthParams(),
    "trace 2: one-shot RAG": SynthParams(sessions=150, long_share=0.1, one_shot_share=0.8,
                                         one_shot_context_tokens=3000, seed=1),
}
CAPACITIES = (500, 1000, 2000, 4000, 8000, 16000, 32000)  # 16-token blocks
TARGET_LRU = 0.40  # trace 1 is judged where LRU is nearest this, and at most 45%
POLICIES = ("lru", "session", "session, no decay", "belady")
NO_DECAY = KvPolicy(decay_per_turn=0)

ENGINE_TRACE = SynthParams(sessions=60, system_prompts=2, system_prompt_tokens=300,
                           first_message_tokens=120, message_tokens=20, answer_tokens=50,
                           long_turns=(6, 12), one_shot_context_tokens=800, think_time_s=8.0,
                           arrival_rate=4.0, seed=7)
ENGINE_BLOCK = 32  # tokens: the CPU attention backend's smallest block
ENGINE_BLOCKS = 64  # the worker's KV cache; vLLM keeps one as its null block
AFFINITY_BLOCKS = 256  # per worker: room for what the two workers share between them
LANE = "chat"
ENGINE_ENV = {"TIDEGATE_KV_CACHE_BLOCKS": str(ENGINE_BLOCKS),
              "TIDEGATE_KV_BLOCK_SIZE": str(ENGINE_BLOCK), "TIDEGATE_MAX_MODEL_LEN": "1600",
              "TIDEGATE_ENGINE_SLOTS": "4"}


# ------------------------------------------------------------------------ simulation


def simulate(name: str, params: SynthParams) -> dict[str, Any]:
    requests = synthesize(params)
    metas = list(session_metas(requests))
    rates: dict[str, list[float]] = {p: [] for p in POLICIES}
    for capacity in CAPACITIES:
        for policy in POLICIES:
            rates[policy].append(_sim(requests, metas, policy, capacity).hit_rate)
        log(f"{name}: {capacity:>6} blocks: " + ", ".join(
            f"{p} {rates[p][-1]:.1%}" for p in POLICIES))
    ceiling = replay(requests, metas, "infinite", None).hit_rate
    return {"requests": len(requests), "mean_input_tokens": _mean_input(requests),
            "one_shot": sum(m.session_id is None for m in metas),
            "rates": rates, "infinite": ceiling, "params": dataclasses.asdict(params)}


def _sim(requests: Sequence[TraceRequest], metas: Sequence[SessionMeta], policy: str,
         capacity: int, block_tokens: int = 16) -> SimResult:
    if policy == "session, no decay":
        return replay(requests, metas, "session", capacity, NO_DECAY, block_tokens)
    return replay(requests, metas, policy, capacity, None, block_tokens)


def _mean_input(requests: Sequence[TraceRequest]) -> float:
    return sum(r.input_length for r in requests) / len(requests)


def judged_point(sim: dict[str, Any]) -> int:
    """Where trace 1 is judged: LRU nearest TARGET_LRU without passing 45%."""
    lru = sim["rates"]["lru"]
    allowed = [i for i, rate in enumerate(lru) if rate <= 0.45]
    return min(allowed, key=lambda i: abs(lru[i] - TARGET_LRU))


# ------------------------------------------------------------------------ real engine


@dataclasses.dataclass
class Replayed:
    label: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached: list[int] = dataclasses.field(default_factory=list)  # per request
    submitted_s: list[float] = dataclasses.field(default_factory=list)  # from the first
    followup_ttft_ms: list[float] = dataclasses.field(default_factory=list)
    workers: set[str] = dataclasses.field(default_factory=set)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_on_tidegate(label: str, requests: Sequence[TraceRequest],
                       metas: Sequence[SessionMeta], text: BlockText, workers: list[str],
                       env: dict[str, str]) -> Replayed:
    """The trace through the whole path, one request at a time, on a fresh stack."""
    pairs = [(LANE, name) for name in workers]
    slots = int(env["TIDEGATE_ENGINE_SLOTS"])
    with tempfile.TemporaryDirectory(prefix="tidegate-kv-bench-") as tmp, \
            tidegate_stack(Path(tmp), pairs, slots, env, pin=True) as (base, key, _), \
            Client(base, key, timeout_s=120) as client:
        out, start = Replayed(label), time.monotonic()
        for n, (request, meta) in enumerate(zip(requests, metas, strict=True)):
            out.submitted_s.append(time.monotonic() - start)
            _one(client, out, text.prompt(request), meta)
            if n % 100 == 99:
                log(f"{label}: {n + 1}/{len(requests)} requests, hit rate {out.hit_rate:.1%}")
    return out


def _one(client: Client, out: Replayed, prompt: str, meta: SessionMeta) -> None:
    job = client.submit(LANE, prompt=prompt, max_tokens=1, temperature=0.0,
                        session_id=meta.session_id)
    events = list(client.stream(job["job_id"]))
    if events[-1].kind != "done":
        raise RuntimeError(f"job {job['job_id']} ended {events[-1].kind}: {events[-1].data}")
    row = client.job(job["job_id"])
    out.prompt_tokens += row["prompt_tokens"]
    out.cached_tokens += row["cached_tokens"] or 0
    out.cached.append(row["cached_tokens"] or 0)
    out.workers.add(row["worker"])
    if meta.turn >= 2 and row["ttft_ms"] is not None:
        out.followup_ttft_ms.append(row["ttft_ms"])


def simulated_like(run: Replayed, requests: Sequence[TraceRequest],
                   metas: Sequence[SessionMeta], policy: str) -> float:
    """The simulator on the requests the engine served, at the times they were sent."""
    timed = [dataclasses.replace(r, timestamp=t) for r, t in zip(requests, run.submitted_s,
                                                                  strict=True)]
    return replay(timed, metas, policy, ENGINE_BLOCKS - 1, block_tokens=ENGINE_BLOCK).hit_rate


def engine_runs(text: BlockText) -> dict[str, Any]:
    requests = synthesize(ENGINE_TRACE)
    metas = list(session_metas(requests))
    log(f"engine trace: {len(requests)} requests, mean input {_mean_input(requests):.0f} "
        f"tokens, KV cache {ENGINE_BLOCKS} blocks of {ENGINE_BLOCK} tokens")
    runs, sims = {}, {}
    for policy in ("lru", "session"):
        env = {**ENGINE_ENV, "TIDEGATE_KV_POLICY": policy}
        runs[policy] = replay_on_tidegate(policy, requests, metas, text, ["kv-0@bench"], env)
        sims[policy] = simulated_like(runs[policy], requests, metas, policy)
        log(f"engine, {policy}: hit rate {runs[policy].hit_rate:.1%} "
            f"(simulator {sims[policy]:.1%})")
    affinity = {}
    for on in (True, False):
        env = {**ENGINE_ENV, "TIDEGATE_KV_POLICY": "session",
               "TIDEGATE_KV_CACHE_BLOCKS": str(AFFINITY_BLOCKS),
               "TIDEGATE_SESSION_AFFINITY": "true" if on else "false"}
        label = f"affinity {'on' if on else 'off'}"
        affinity[label] = replay_on_tidegate(label, requests, metas, text,
                                             ["kv-a@bench", "kv-b@bench"], env)
        log(f"two workers, {label}: hit rate {affinity[label].hit_rate:.1%}, jobs on "
            f"{sorted(affinity[label].workers)}")
    return {"requests": requests, "runs": runs, "sims": sims, "affinity": affinity}


# ------------------------------------------------------------------------ report


def sim_table(sims: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, sim in sims.items():
        for i, capacity in enumerate(CAPACITIES):
            rates = sim["rates"]
            rows.append([name, f"{capacity:,}", f"{capacity * 16:,}",
                         *(f"{rates[p][i]:.1%}" for p in POLICIES), f"{sim['infinite']:.1%}",
                         f"{(rates['session'][i] - rates['lru'][i]) * 100:+.1f}"])
    return markdown_table(["trace", "blocks", "tokens", *POLICIES, "infinite",
                           "session - LRU (points)"], rows)


def engine_table(engine: dict[str, Any]) -> str:
    rows = []
    for policy, run in engine["runs"].items():
        rows.append([f"one worker, {policy}", f"{run.hit_rate:.1%}",
                     f"{engine['sims'][policy]:.1%}",
                     f"{(run.hit_rate - engine['sims'][policy]) * 100:+.1f}",
                     fmt(median(run.followup_ttft_ms), 1), str(len(run.followup_ttft_ms))])
    for label, run in engine["affinity"].items():
        rows.append([f"two workers, {label}, session", f"{run.hit_rate:.1%}", "-", "-",
                     fmt(median(run.followup_ttft_ms), 1), str(len(run.followup_ttft_ms))])
    return markdown_table(["run", "engine hit rate", "simulator", "engine - sim (points)",
                           "follow-up TTFT p50 (ms)", "follow-ups"], rows)


def plot(path: Path, sims: dict[str, dict[str, Any]], engine: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, (name, sim) in zip(axes, sims.items(), strict=False):
        for policy in POLICIES:
            ax.plot(CAPACITIES, [r * 100 for r in sim["rates"][policy]], marker="o",
                    label=policy, linestyle=":" if policy == "session, no decay" else "-")
        ax.axhline(sim["infinite"] * 100, color="grey", linestyle="--", label="infinite")
        ax.set(xscale="log", xlabel="KV cache capacity (16-token blocks)",
               ylabel="prefix hit rate (% of input tokens)", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    runs = engine["runs"]
    ax.boxplot([runs["lru"].followup_ttft_ms, runs["session"].followup_ttft_ms],
               tick_labels=[f"LRU ({runs['lru'].hit_rate:.0%} hits)",
                            f"session ({runs['session'].hit_rate:.0%} hits)"],
               showfliers=False)
    ax.set(ylabel="TTFT of follow-up turns (ms)", title="real vLLM worker, same trace")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(sims: dict[str, dict[str, Any]], engine: dict[str, Any]) -> dict[str, Any]:
    first = next(iter(sims.values()))
    i = judged_point(first)
    lru, session, belady = (first["rates"][p][i] for p in ("lru", "session", "belady"))
    worst = min(kept - lru_ for sim in sims.values()
                for kept, lru_ in zip(sim["rates"]["session"], sim["rates"]["lru"], strict=True))
    runs, sim_engine = engine["runs"], engine["sims"]
    affinity = engine["affinity"]
    return {
        "sim_capacity_blocks": CAPACITIES[i],
        "sim_lru_hit_rate": lru, "sim_session_hit_rate": session,
        "sim_belady_hit_rate": belady, "sim_infinite_hit_rate": first["infinite"],
        "sim_gap_closed": (session - lru) / (belady - lru) if belady > lru else None,
        "sim_worst_delta_vs_lru": worst,
        "engine_lru_hit_rate": runs["lru"].hit_rate,
        "engine_session_hit_rate": runs["session"].hit_rate,
        "engine_hit_rate_ratio": runs["session"].hit_rate / runs["lru"].hit_rate
        if runs["lru"].hit_rate else None,
        "engine_sim_max_abs_diff": max(abs(runs[p].hit_rate - sim_engine[p]) for p in runs),
        "engine_followup_ttft_p50_ms": {p: median(r.followup_ttft_ms) for p, r in runs.items()},
        "affinity_hit_rate": {label: r.hit_rate for label, r in affinity.items()},
    }


def main() -> None:
    exit_cleanly_on_signals()
    t0 = time.monotonic()
    sims = {name: simulate(name, params) for name, params in TRACES.items()}
    engine = engine_runs(BlockText(MODEL))
    result = figures(sims, engine)
    setup = {**machine(), "engine trace": dataclasses.asdict(ENGINE_TRACE),
             "engine KV cache": f"{ENGINE_BLOCKS} blocks x {ENGINE_BLOCK} tokens",
             "kv policy": KvPolicy().model_dump(), "run time": f"{time.monotonic() - t0:.0f} s"}
    for name, sim in sims.items():
        setup[name] = (f"{sim['requests']} requests ({sim['one_shot']} one-shot), mean input "
                       f"{sim['mean_input_tokens']:.0f} tokens, params {sim['params']}")
    table = sim_table(sims) + "\n\n" + engine_table(engine)
    write_report(RESULTS / "kv.md", "KV cache eviction: LRU against session priority", table,
                 setup, notes=notes(result))
    plot(RESULTS / "kv.png", sims, engine)
    write_json(RESULTS / "kv.json", {**result, "setup": setup,
                                     "sim": {n: {**s, "capacities": CAPACITIES}
                                             for n, s in sims.items()}})
    print(table, flush=True)
    print_json_last(result)


def notes(result: dict[str, Any]) -> list[str]:
    return [
        f"Trace 1 is judged at {result['sim_capacity_blocks']:,} blocks, where LRU is nearest "
        f"{TARGET_LRU:.0%}: the session policy closes {result['sim_gap_closed']:.0%} of the gap "
        f"between LRU and Belady's reference. The production team's 78% is above this "
        f"trace's infinite-cache ceiling ({result['sim_infinite_hit_rate']:.1%}): a third of "
        f"its requests are one-shot with long unique contexts, which no cache can hit.",
        "Belady's reference keeps, after each request, the blocks whose next use is nearest; "
        "it may keep a block whose prefix was evicted, which no prefix cache can hit, so it "
        "is a reference rather than a strict bound.",
        "Engine and simulator differ where the simulator is simpler than vLLM: vLLM holds a "
        "block for the generated token, keeps one null block, and warms a prompt at start.",
    ]


if __name__ == "__main__":
    main()
