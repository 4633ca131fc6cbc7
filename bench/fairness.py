"""Fair tenants inside a lane: a quiet tenant beside one that submits ten times its rate,
with weighted fair queuing (tidegate/fairq.py, the default) and with it off (arrival
order, the peer), in one run.

Each system is a stack of its own: a private redis-server and PostgreSQL database, one
`chat` sim worker (workers/sim_engine.py, profile PROFILE: the H100 profile's shape at an
eighth of its rate, so the engine, not this machine's two cores, is the bottleneck) of
SLOTS engine slots, the API, default limits. Two tenants, `quiet` and `flood`, equal
weights. Phases, one after another on each stack:

calibrate   CALIBRATE_JOBS jobs at once: the engine's capacity in jobs/s (C), from the
            rows (jobs started / the time from the first start to the last).
alone       (fair stack only: with one tenant both orders are the same) the quiet tenant
            alone, Poisson arrivals at q = OVERLOAD x C / 11 for WINDOW_S s; TTFT of each
            job on the client (the SDK's submit and SSE stream).
contended   the same quiet load while the flood tenant submits Poisson at 10 q (together
            OVERLOAD x C); the quiet tenant's TTFT as above. The flood's submits only
            submit (its jobs run; nobody reads them); past its in-flight cap (default 1,000)
            they get 429. Afterwards the flood's waiting jobs are cancelled.
backlogged  the flood submits BACKLOG x 10 jobs, then the quiet tenant BACKLOG at once:
            both have jobs waiting from the quiet's burst on. Each tenant's share: its jobs
            started / all jobs started, from the quiet's first submit until its last job
            started (the interval both were backlogged), from the rows.

The JSON's headline (the issue's bars): quiet_ttft_p99_ratio (contended / alone, fair;
<= 1.5) and share_min (the smaller tenant share while both were backlogged, fair; >= 0.45).
The same figures with fair queuing off sit beside them (fifo_*).

    .venv/bin/python bench/fairness.py
    .venv/bin/python bench/fairness.py --window-s 20

Writes bench/results/fairness.{md,png,json}; the last stdout line is the JSON summary.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/fairness.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.fairness, then exits

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from tidegate_client import AsyncClient

from bench.common import (
    fmt,
    log,
    machine,
    markdown_table,
    percentile,
    plot_distributions,
    print_json_last,
    ratio,
    write_json,
    write_report,
)
from bench.stack import (
    MODEL,
    RESULTS,
    START_TIMEOUT_S,
    RequestSpec,
    Sample,
    bench_database,
    exit_cleanly_on_signals,
    load_average,
    tidegate_env,
    tidegate_request,
)
from tidegate_tools.stack import WorkerSpec, running_stack

PROFILE = "paced"  # workers/sim_profiles.toml
SLOTS = 32
# Each job's max_tokens, drawn uniformly (the sim runs every job to it): answers of one
# length, started together by a burst, end together, and a full engine then frees its
# slots in cohorts, once a generation (~1 s here) instead of one every few tens of ms.
MIN_TOKENS, MAX_TOKENS = 8, 32
OVERLOAD = 3.0  # both tenants' arrivals over the engine's capacity
FLOOD_RATIO = 10  # the flood tenant's rate over the quiet one's
WINDOW_S = 30.0
CALIBRATE_JOBS = 4 * SLOTS
BACKLOG = 3 * SLOTS  # the quiet tenant's burst in the backlogged phase
SEED = 20261207
BAR_TTFT_RATIO, BAR_SHARE = 1.5, 0.45
LANE = "chat"
# One API process's admission queue: the flood's submits must not be turned away by it
# (a 503 there says nothing of fairness); the in-flight cap per tenant stays the default.
ENV = {"TIDEGATE_MAX_ADMISSION_WAITING": "100000", "TIDEGATE_SIM_PROFILE": PROFILE}


@dataclass
class System:
    name: str  # "fair" or "fifo"
    capacity_jobs_per_s: float = 0.0
    alone: list[Sample] = field(default_factory=list)
    contended: list[Sample] = field(default_factory=list)
    flood_refused: int = 0
    shares: dict[str, float] = field(default_factory=dict)
    backlog_s: float = 0.0


@dataclass
class Stack:
    base: str
    keys: dict[str, str]  # tenant name -> API key
    ids: dict[str, int]  # tenant name -> id
    store: Any  # store.Store


def prompt(who: str, i: int) -> str:
    return f"Ticket {i} from {who}: a customer asks where order {40000 + i} is. Answer briefly."


# ---------------------------------------------------------------- the stack


@contextmanager
def stack(tmp: Path, fair: bool) -> Iterator[Stack]:
    from store import Store, upgrade

    name = "fair" if fair else "fifo"
    with bench_database(tmp / name, postgresql=True) as db_url:
        upgrade(db_url)
        store = Store(db_url)
        tenants = {who: store.tenants.create_tenant(who, [LANE]) for who in ("quiet", "flood")}
        env = {**tidegate_env(db_url, SLOTS), **ENV,
               "TIDEGATE_FAIR_QUEUING": "true" if fair else "false"}
        specs = [WorkerSpec(LANE, f"sim-{name}@fairness", pool="vllm", engine="sim")]
        with running_stack(env, specs, tmp / name / "logs", private_redis=True,
                           timeout_s=START_TIMEOUT_S) as running:
            yield Stack(running.base_url, {w: t[1] for w, t in tenants.items()},
                        {w: t[0].id for w, t in tenants.items()}, store)


def length(text: str) -> int:
    """A job's max_tokens, from its prompt (the same text gets the same length on both
    systems)."""
    return random.Random(f"{SEED}:{text}").randint(MIN_TOKENS, MAX_TOKENS)


async def submit(http: httpx.AsyncClient, key: str, text: str) -> str | None:
    """One job, not streamed: its id, or None when refused (429/503) or the connection
    failed (counted with the refused)."""
    try:
        answer = await http.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                                 json={"lane": LANE, "prompt": text, "max_tokens": length(text),
                                       "temperature": 0.0})
    except httpx.TransportError:
        return None
    if answer.status_code in (429, 503):
        return None
    answer.raise_for_status()
    return str(answer.json()["job_id"])


def http_client(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, timeout=60,
                             limits=httpx.Limits(max_connections=64))


def aware(t: datetime) -> datetime:
    """The store's times in UTC, whether its driver hands them back with a zone or not."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def started(s: Stack, who: str) -> list[tuple[datetime, int]]:
    """When each of the tenant's jobs started, and the tokens it asked for (its cost)."""
    return sorted((aware(j.started_at), j.prompt_tokens + int(j.sampling["max_tokens"]))
                  for j in s.store.jobs.jobs_of_tenant(s.ids[who], limit=100_000)
                  if j.started_at is not None)


async def wait_idle(s: Stack, who: str, timeout_s: float = 300.0) -> None:
    """Until none of the tenant's jobs is queued or running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = s.store.jobs.jobs_of_tenant(s.ids[who], limit=100_000)
        if all(j.status not in ("queued", "running") for j in jobs):
            return
        await asyncio.sleep(0.5)
    raise SystemExit(f"{who}'s jobs did not end within {timeout_s:.0f} s")


async def cancel_waiting(s: Stack, who: str) -> int:
    """Cancels the tenant's queued jobs (the flood's backlog after a phase)."""
    queued = [j.id for j in s.store.jobs.jobs_of_tenant(s.ids[who], limit=100_000)
              if j.status == "queued"]
    async with http_client(s.base) as http:
        gate = asyncio.Semaphore(32)

        async def one(job_id: str) -> None:
            async with gate:
                for attempt in range(3):  # a keep-alive connection the server closed
                    try:
                        await http.delete(f"/v1/jobs/{job_id}",
                                          headers={"Authorization": f"Bearer {s.keys[who]}"})
                        return
                    except httpx.TransportError:
                        if attempt == 2:
                            raise

        await asyncio.gather(*(one(j) for j in queued))
    await wait_idle(s, who)
    return len(queued)


# ---------------------------------------------------------------- phases


async def calibrate(s: Stack) -> float:
    async with http_client(s.base) as http:
        await asyncio.gather(*(submit(http, s.keys["flood"], prompt("calibration", i))
                               for i in range(CALIBRATE_JOBS)))
    await wait_idle(s, "flood")
    starts = [t for t, _ in started(s, "flood")]
    span = (starts[-1] - starts[0]).total_seconds()
    return (len(starts) - 1) / span if span > 0 else float("nan")


async def poisson(rate: float, window_s: float, seed: int, fire: Any) -> list[asyncio.Task]:
    """Fires `fire(i)` at Poisson arrivals of `rate` a second for `window_s`."""
    rng, tasks, i = random.Random(seed), [], 0
    end = time.monotonic() + window_s
    while (now := time.monotonic()) < end:
        tasks.append(asyncio.create_task(fire(i)))
        i += 1
        await asyncio.sleep(max(0.0, min(rng.expovariate(rate), end - now)))
    return tasks


async def quiet_load(s: Stack, rate: float, window_s: float) -> list[Sample]:
    client = AsyncClient(s.base, s.keys["quiet"], timeout_s=120)
    try:
        async def fire(i: int) -> Sample:
            try:
                text = prompt("quiet", i)
                return await tidegate_request(client, RequestSpec(text, LANE, length(text)))
            except Exception as exc:  # a failed request is an error sample, not a crash
                return Sample(error=type(exc).__name__)

        tasks = await poisson(rate, window_s, SEED, fire)
        return list(await asyncio.gather(*tasks))
    finally:
        await client.aclose()


async def contended(s: Stack, rate: float, window_s: float) -> tuple[list[Sample], int]:
    async with http_client(s.base) as http:
        async def fire(i: int) -> str | None:
            return await submit(http, s.keys["flood"], prompt("flood", i))

        flood = asyncio.create_task(poisson(rate * FLOOD_RATIO, window_s, SEED + 1, fire))
        quiet = await quiet_load(s, rate, window_s)
        ids = await asyncio.gather(*await flood)
    return quiet, sum(job is None for job in ids)


async def backlogged(s: Stack) -> tuple[dict[str, float], float]:
    async with http_client(s.base) as http:
        gate = asyncio.Semaphore(32)

        async def one(who: str, i: int) -> str | None:
            async with gate:
                return await submit(http, s.keys[who], prompt(f"{who} backlog", i))

        await asyncio.gather(*(one("flood", i) for i in range(BACKLOG * FLOOD_RATIO)))
        since = datetime.now(UTC)
        await asyncio.gather(*(one("quiet", i) for i in range(BACKLOG)))
    await wait_idle(s, "quiet")
    until = max(t for t, _ in started(s, "quiet"))
    counts = {who: sum(cost for t, cost in started(s, who) if since <= t <= until)
              for who in ("quiet", "flood")}
    await cancel_waiting(s, "flood")
    total = sum(counts.values())
    return {who: n / total for who, n in counts.items()}, (until - since).total_seconds()


async def measure(s: Stack, system: System, window_s: float, alone: bool) -> None:
    system.capacity_jobs_per_s = await calibrate(s)
    rate = OVERLOAD * system.capacity_jobs_per_s / (FLOOD_RATIO + 1)
    log(f"{system.name}: capacity {system.capacity_jobs_per_s:.1f} jobs/s; quiet at "
        f"{rate:.2f}/s, flood at {rate * FLOOD_RATIO:.1f}/s")
    if alone:
        system.alone = await quiet_load(s, rate, window_s)
        await wait_idle(s, "quiet")
    system.contended, system.flood_refused = await contended(s, rate, window_s)
    log(f"{system.name}: contended phase done; cancelling the flood's waiting jobs")
    await cancel_waiting(s, "flood")
    system.shares, system.backlog_s = await backlogged(s)
    log(f"{system.name}: shares while both were backlogged {system.shares}")


# ---------------------------------------------------------------- report


def ttft_p(samples: list[Sample], q: float) -> float:
    return percentile([x.ttft_ms for x in samples if x.error is None], q)


def part_p50(samples: list[Sample], name: str) -> float:
    """The median of one part of the quiet jobs' TTFT: `submit` (POST to its 202, on the
    client), or what the server reported (`queue_wait_ms`: enqueued to started on a
    worker; `ttft_ms`: enqueued to the first token)."""
    if name == "submit":
        return percentile([x.submit_ms for x in samples if x.error is None], 50)
    return percentile([x.server[name] for x in samples if x.error is None and name in x.server],
                      50)


def parts(samples: list[Sample]) -> dict[str, float]:
    return {"submit_p50_ms": part_p50(samples, "submit"),
            "queue_wait_p50_ms": part_p50(samples, "queue_wait_ms"),
            "server_ttft_p50_ms": part_p50(samples, "ttft_ms")}


def errors(samples: list[Sample]) -> int:
    return sum(x.error is not None for x in samples)


def figures(fair: System, fifo: System) -> dict[str, Any]:
    alone_p99 = ttft_p(fair.alone, 99)
    out: dict[str, Any] = {"benchmark": "fairness"}
    for system in (fair, fifo):
        prefix = "" if system is fair else "fifo_"
        out[f"{prefix}quiet_ttft_p99_ratio"] = ratio(ttft_p(system.contended, 99), alone_p99)
        out[f"{prefix}share_min"] = min(system.shares.values())
    out["claim_holds"] = (out["quiet_ttft_p99_ratio"] <= BAR_TTFT_RATIO
                          and out["share_min"] >= BAR_SHARE)
    out |= {"bar_quiet_ttft_p99_ratio": BAR_TTFT_RATIO, "bar_share_min": BAR_SHARE,
            "quiet_alone_ttft_p50_ms": ttft_p(fair.alone, 50), "quiet_alone_ttft_p99_ms": alone_p99,
            "quiet_alone_parts": parts(fair.alone)}
    for system in (fair, fifo):
        out[system.name] = {
            "capacity_jobs_per_s": system.capacity_jobs_per_s,
            "quiet_ttft_p50_ms": ttft_p(system.contended, 50),
            "quiet_ttft_p99_ms": ttft_p(system.contended, 99),
            "quiet_jobs": len(system.contended), "quiet_errors": errors(system.contended),
            "quiet_error_kinds": dict(Counter(x.error for x in system.contended if x.error)),
            "flood_refused": system.flood_refused, "shares": system.shares,
            "quiet_parts": parts(system.contended),
            "backlogged_s": system.backlog_s}
    return out


def table(fair: System, fifo: System, out: dict[str, Any]) -> str:
    headers = ["system", "phase", "quiet TTFT p50 (ms)", "quiet TTFT p99 (ms)",
               "its submit p50 (ms)", "its queue wait p50 (ms, server)",
               "quiet errors", "share quiet / flood while backlogged"]

    def split(samples: list[Sample]) -> list[str]:
        got = parts(samples)
        return [fmt(got["submit_p50_ms"]), fmt(got["queue_wait_p50_ms"])]

    rows = [["tidegate, quiet alone", "alone", fmt(ttft_p(fair.alone, 50)),
             fmt(ttft_p(fair.alone, 99)), *split(fair.alone),
             f"{errors(fair.alone)}/{len(fair.alone)}", ""]]
    for system, label in ((fair, "fair queuing (default)"), (fifo, "arrival order (off)")):
        shares = system.shares
        rows.append([f"tidegate, {label}", "contended / backlogged",
                     fmt(ttft_p(system.contended, 50)), fmt(ttft_p(system.contended, 99)),
                     *split(system.contended),
                     f"{errors(system.contended)}/{len(system.contended)}",
                     f"{fmt(shares['quiet'], 2)} / {fmt(shares['flood'], 2)}"])
    rows.append(["**fair: contended / alone**", "", "",
                 fmt(out["quiet_ttft_p99_ratio"], 2), "", "", "",
                 f"min {fmt(out['share_min'], 2)}"])
    rows.append(["**off: contended / alone**", "", "",
                 fmt(out["fifo_quiet_ttft_p99_ratio"], 2), "", "", "",
                 f"min {fmt(out['fifo_share_min'], 2)}"])
    return markdown_table(headers, rows)


def setup(fair: System, window_s: float) -> dict[str, Any]:
    return {"tidegate": f"one `chat` sim worker (profile {PROFILE}), {SLOTS} engine slots, "
                        "the API, a private redis-server, a private PostgreSQL database; "
                        "default limits (in flight per tenant 1,000)",
            "tenants": "quiet and flood, equal weights",
            "jobs": f"max_tokens drawn uniformly from {MIN_TOKENS}-{MAX_TOKENS} (seeded by "
                    "the prompt; the sim runs every job to max_tokens)",
            "load": f"Poisson, quiet at {OVERLOAD:.0f} x capacity / {FLOOD_RATIO + 1}, flood "
                    f"at {FLOOD_RATIO}x that, {window_s:.0f} s a phase",
            "backlogged phase": f"{BACKLOG * FLOOD_RATIO} flood jobs, then {BACKLOG} quiet "
                                "jobs at once",
            "capacity measured (fair stack)": f"{fair.capacity_jobs_per_s:.1f} jobs/s",
            **machine(), "load average before": load_average()}


NOTES = [
    "Peer: the same stack with TIDEGATE_FAIR_QUEUING=false, the order jobs arrived in, "
    "measured in the same run after the fair stack.",
    "The quiet tenant's TTFT counts from its SDK submit to the first token on its SSE "
    "stream. While the engine is full, a quiet job at the head of the queue still waits "
    "for a slot to free (a running job's end) and then for the engine's next step: what "
    "fair order cannot take away without preempting a running job.",
    "Shares count the tokens (prompt plus max_tokens: the cost fair queuing charges) of the "
    "jobs each tenant started while both were backlogged.",
]


def report(fair: System, fifo: System, window_s: float) -> dict[str, Any]:
    out = figures(fair, fifo)
    setup_ = setup(fair, window_s)
    out["setup"] = setup_
    verdict = (f"Claim (quiet TTFT p99 contended <= {BAR_TTFT_RATIO}x alone, each tenant >= "
               f"{BAR_SHARE} of capacity while both backlogged): "
               f"{'HOLDS' if out['claim_holds'] else 'DOES NOT HOLD'}, "
               f"{fmt(out['quiet_ttft_p99_ratio'], 2)} and {fmt(out['share_min'], 2)}.")
    body = table(fair, fifo, out)
    write_report(RESULTS / "fairness.md", "Fair tenants in a lane: a quiet tenant beside a "
                 f"flood of {FLOOD_RATIO}x its rate at {OVERLOAD:.0f}x overload", body, setup_,
                 [verdict, *NOTES])
    series = {"quiet alone": [x.ttft_ms for x in fair.alone if x.error is None],
              "quiet contended, fair": [x.ttft_ms for x in fair.contended if x.error is None],
              "quiet contended, arrival order": [x.ttft_ms for x in fifo.contended
                                                 if x.error is None]}
    plot_distributions(RESULTS / "fairness.png", series, "Quiet tenant's TTFT "
                       f"({SLOTS} slots, {OVERLOAD:.0f}x overload, flood {FLOOD_RATIO}x its rate)",
                       "time to first token (ms)", histogram=False, log_x=True)
    write_json(RESULTS / "fairness.json", out)
    print(body)
    print(verdict)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fair tenants in a lane, fair vs arrival order.")
    parser.add_argument("--window-s", type=float, default=WINDOW_S,
                        help=f"seconds of each load phase (default {WINDOW_S:.0f})")
    args = parser.parse_args(argv)
    exit_cleanly_on_signals()
    from tidegate_tools.testmodel import build_test_model

    build_test_model(MODEL)  # the sim worker's tokenizer
    tmp = Path(tempfile.mkdtemp(prefix="tidegate-fairness-"))
    log(f"logs under {tmp}")
    systems = {}
    for fair in (True, False):
        system = System("fair" if fair else "fifo")
        with stack(tmp, fair) as s:
            asyncio.run(measure(s, system, args.window_s, alone=fair))
        systems[system.name] = system
    out = report(systems["fair"], systems["fifo"], args.window_s)
    print_json_last(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
