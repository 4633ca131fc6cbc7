"""A fleet through a festival day: reactive scaling against pre-warming.

A discrete-event simulation of one lane's fleet from the afternoon through a festival
night declared in the lane's config (10x, ramping over 15 minutes). Both policies see
the same seeded Poisson arrivals; the pre-warming policy runs the scheduler's real
`forecast` and `plan` every minute.

Model
- Arrivals: a Poisson process whose rate is the lane's day curve (previous days' shape,
  today 5% above it) times the declared festival factor, piecewise constant per minute.
- Workers pull from one FCFS lane queue; each runs SLOTS sequences at once, every
  sequence an independent server (the engine figures below were measured with all 64
  slots busy, so they already carry the batching slowdown). TTFT = queue wait + prefill;
  a job holds its slot for prefill + (tokens - 1) x TPOT.
- Reactive: every minute a scaler sizes the fleet to (busy slots + queued jobs) at a
  target utilisation of 75% and cold-starts the missing workers (the profile's cold start
  until they take jobs); it drains one worker after 5 minutes of wanting fewer.
- Pre-warming: every minute the scheduler forecasts the next 30 minutes from the
  history (7 simulated previous days plus today so far), plans the active workers for
  the highest rate before the next decision lands (lead time = activation + margin)
  and activates standby workers; it cold-starts standby workers early enough for
  the highest rate in the 30-minute horizon, and returns one worker a minute to standby
  when it needs fewer.

Calibration (where the figures come from): one named engine profile, the sim engine's
(workers/sim_profiles.toml, `PROFILE`), and nothing another benchmark wrote.
- Per job (PROMPT_TOKENS in, TOKENS out, on a worker with all SLOTS busy): the profile's
  step time gives the median prefill (a step that prefills the prompt beside SLOTS - 1
  decoders) and the median TPOT (a step of SLOTS decoders); both are lognormal around
  them, their p99 SPREAD times the median (a real engine's steps vary with the batch).
  Per-worker capacity = slots / mean service time.
- Cold start and standby -> active: the profile's cold_start_s and activation_s.
- Rates are scaled to the worker's capacity: the day curve's mean is BASE_LOAD workers'
  worth (2-3 workers at dusk, some 20 at the peak), so a run stays at a few million jobs
  (10-20 s of CPU); what the result depends on are ratios: peak / per-worker capacity,
  cold start / ramp.
- Both policies start at 17:00 with the fleet the planner sizes for that minute; the
  first hour is warm-up, left out of every figure but the per-minute plot.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/peak.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.peak, then exits

import bisect
import heapq
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.common import (
    RESULTS,
    fmt,
    log,
    machine,
    markdown_table,
    percentile,
    print_json_last,
    ratio,
    write_json,
    write_report,
)
from scheduler.forecast import forecast, peak_rate_per_s
from scheduler.peaks import PeakWindow, peak_factor, windows_of
from scheduler.planner import Capacity, capacity_from, lead_time_s, plan
from tidegate.lanes import Lane, load_lanes
from tidegate.router import WorkerView
from workers.sim_profile import SimProfile, load_profile

# -- calibration: one named profile of the sim engine ----------------------------------
PROFILE = "llama-3.1-8b-fp8-h100"  # workers/sim_profiles.toml
SLOTS = 64  # engine slots of a worker
PROMPT_TOKENS, TOKENS = 512, 128  # per job
# p99 / p50 of a job's prefill and TPOT: a real engine's steps vary with the batch's
# composition; the profile gives the median step.
PREFILL_SPREAD, TPOT_SPREAD = 2.5, 2.6
MARGIN_S = 50.0  # added to the activation time: the planner's lead time
TICK_S = 60  # both policies decide once a minute (the beat interval)
HORIZON_MIN = 30  # the forecast the standby pool is sized for

# -- traffic ---------------------------------------------------------------------------
DAY0 = datetime(2026, 11, 11, tzinfo=UTC)  # the festival day
BASE_LOAD = 1.15  # the day curve's mean, in workers' capacity: 2-3 workers at dusk
DAY_SWING = 0.3  # the day curve: +-30% around the mean, highest at 20:00
TODAY_GROWTH = 1.05  # the festival day runs 5% above the previous days (the trend sees it)
FESTIVAL = {"start": DAY0 + timedelta(hours=20), "end": DAY0 + timedelta(hours=21, minutes=30),
            "factor": 10.0, "ramp_min": 15.0}
HISTORY_DAYS = 7
SIM_START_H, SIM_END_H = 17, 23  # simulated hours of the festival day
STEADY_H = (18, 20)  # steady state: the hours before the peak, after an hour of warm-up
MAX_WORKERS = 32  # declared with the festival: the lane's default 8 cannot carry 10x
SEED = 20261111

# -- policies --------------------------------------------------------------------------
STANDBY_POOL = 2  # standby workers the pre-warming policy holds before any forecast
HEADROOM = 0.2  # the planner's cushion over the forecast
REACTIVE_UTIL = 0.75  # the reactive scaler's target utilisation
REACTIVE_DOWN_TICKS = 5  # minutes of wanting fewer before it drains to the most of them


@dataclass(frozen=True)
class Engine:
    prefill_p50_s: float
    prefill_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    tokens: int
    cold_start_s: float
    activation_s: float
    profile: SimProfile

    @property
    def source(self) -> str:
        return f"sim profile `{self.profile.name}` (workers/sim_profiles.toml)"

    @property
    def base_rate(self) -> float:
        """Jobs/s at the day curve's mean: BASE_LOAD workers' capacity (lognormal means)."""
        prefill = lognormal_mean(self.prefill_p50_s, self.prefill_p99_s)
        service = prefill + (self.tokens - 1) * lognormal_mean(self.tpot_p50_s, self.tpot_p99_s)
        return BASE_LOAD * SLOTS / service


def engine_figures(name: str = PROFILE) -> Engine:
    """The per-job and fleet figures of the named sim profile: see the module docstring."""
    profile = load_profile(name)
    context = PROMPT_TOKENS + TOKENS // 2  # a decoding sequence's KV tokens, mid-job
    prefill = profile.step_s(SLOTS - 1, (SLOTS - 1) * context, PROMPT_TOKENS)
    tpot = profile.step_s(SLOTS, SLOTS * context, 0)
    return Engine(prefill, prefill * PREFILL_SPREAD, tpot, tpot * TPOT_SPREAD, TOKENS,
                  profile.cold_start_s, profile.activation_s, profile)


def lognormal(rng: np.random.Generator, p50: float, p99: float, n: int) -> np.ndarray:
    return rng.lognormal(math.log(p50), _sigma(p50, p99), n)


def lognormal_mean(p50: float, p99: float) -> float:
    return p50 * math.exp(_sigma(p50, p99) ** 2 / 2)


def _sigma(p50: float, p99: float) -> float:
    return math.log(p99 / p50) / 2.326  # z of the 99th percentile


# -- traffic ---------------------------------------------------------------------------


def day_rate(at: datetime, base_rate: float) -> float:
    """The previous days' arrival rate (jobs/s) at `at`."""
    hours = at.hour + at.minute / 60
    return base_rate * (1 + DAY_SWING * math.cos(2 * math.pi * (hours - 20) / 24))


def festival_rate(at: datetime, windows: Sequence[PeakWindow], base_rate: float) -> float:
    return day_rate(at, base_rate) * TODAY_GROWTH * peak_factor(windows, at)


def minute_counts(rng: np.random.Generator, start: datetime, minutes: int,
                  rate: Any) -> np.ndarray:
    """Poisson arrivals per minute, at the rate in the middle of each minute."""
    mids = [start + timedelta(minutes=i, seconds=30) for i in range(minutes)]
    return rng.poisson([rate(m) * 60 for m in mids])


def history_days(rng: np.random.Generator, base_rate: float) -> dict[datetime, float]:
    """The previous days' arrivals per minute: the forecaster's seasonal history."""
    start = DAY0 - timedelta(days=HISTORY_DAYS)
    counts = minute_counts(rng, start, HISTORY_DAYS * 1440, lambda m: day_rate(m, base_rate))
    return {start + timedelta(minutes=i): float(n) for i, n in enumerate(counts)}


@dataclass
class Jobs:
    """The festival day's jobs, by arrival time (s since the day's midnight)."""

    counts: np.ndarray  # arrivals per minute from midnight to the end of the run
    arrival: np.ndarray
    prefill: np.ndarray
    service: np.ndarray


def festival_jobs(rng: np.random.Generator, windows: Sequence[PeakWindow],
                  engine: Engine) -> Jobs:
    counts = minute_counts(rng, DAY0, SIM_END_H * 60,
                           lambda m: festival_rate(m, windows, engine.base_rate))
    first = SIM_START_H * 60
    arrival = np.concatenate([np.sort(rng.uniform(m * 60, m * 60 + 60, n))
                              for m, n in enumerate(counts[first:], start=first)])
    prefill = lognormal(rng, engine.prefill_p50_s, engine.prefill_p99_s, len(arrival))
    tpot = lognormal(rng, engine.tpot_p50_s, engine.tpot_p99_s, len(arrival))
    return Jobs(counts, arrival, prefill, prefill + (engine.tokens - 1) * tpot)


# -- the fleet -------------------------------------------------------------------------


@dataclass
class Fleet:
    """Workers, and the heap of their slots: (free at, worker id)."""

    slots: list[tuple[float, int]] = field(default_factory=list)
    active_at: dict[int, float] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)
    standby: int = 0
    standby_ready: list[float] = field(default_factory=list)  # cold starts for standby
    cold_starts: int = 0

    def activate(self, at: float) -> None:
        """A worker takes jobs from `at` on: its slots join the heap, free at `at`."""
        wid = len(self.active_at)
        self.active_at[wid] = at
        for _ in range(SLOTS):
            heapq.heappush(self.slots, (at, wid))

    def live(self) -> list[int]:
        return [w for w in self.active_at if w not in self.retired]

    def active(self, t: float) -> int:
        return sum(1 for w in self.live() if self.active_at[w] <= t)

    def pending(self, t: float) -> int:
        return sum(1 for w in self.live() if self.active_at[w] > t)

    def retire(self) -> None:
        """Drain the newest worker: it finishes its jobs and takes no new one."""
        self.retired.add(max(self.live()))

    def busy(self, t: float) -> int:
        return sum(1 for free_at, w in self.slots
                   if free_at > t and w not in self.retired and self.active_at[w] <= t)


@dataclass(frozen=True)
class Observed:
    busy: int  # slots running a job
    queued: int  # jobs waiting in the lane queue


class Policy(Protocol):
    name: str

    def tick(self, t: float, fleet: Fleet, seen: Observed) -> None: ...


def run_minute(fleet: Fleet, arrival: list[float], service: list[float], start: list[float],
               head: int, end: float) -> int:
    """Start, in arrival order, every queued or arriving job whose slot frees before
    `end`; the rest wait for the next decision. Returns the first job not started."""
    slots, retired, n = fleet.slots, fleet.retired, len(arrival)
    while head < n and arrival[head] < end and slots:
        free_at, wid = heapq.heappop(slots)
        if wid in retired:
            continue  # a drained worker's slot: it takes nothing started from now on
        begin = free_at if free_at > arrival[head] else arrival[head]
        if begin >= end:
            heapq.heappush(slots, (free_at, wid))
            break
        start[head] = begin
        heapq.heappush(slots, (begin + service[head], wid))
        head += 1
    return head


@dataclass
class Run:
    name: str
    ttft: np.ndarray  # s, by arrival order
    wait: np.ndarray
    active: list[int]  # per minute
    held: list[int]  # active + starting + standby, per minute: GPUs the policy pays for
    cold_starts: int


def simulate(jobs: Jobs, policy: Policy, initial_workers: int) -> Run:
    fleet = Fleet(standby=STANDBY_POOL if policy.name == "pre-warming" else 0)
    t0 = SIM_START_H * 3600.0
    for _ in range(initial_workers):
        fleet.activate(t0)
    arrival, service = jobs.arrival.tolist(), jobs.service.tolist()
    start = [math.inf] * len(arrival)
    head, active, held = 0, [], []
    for t in np.arange(t0, SIM_END_H * 3600.0, TICK_S).tolist():
        queued = bisect.bisect_left(arrival, t) - head
        policy.tick(t, fleet, Observed(fleet.busy(t), queued))
        active.append(fleet.active(t))
        held.append(len(fleet.live()) + fleet.standby + len(fleet.standby_ready))
        head = run_minute(fleet, arrival, service, start, head, t + TICK_S)
    run_minute(fleet, arrival, service, start, head, math.inf)  # drain what is left
    wait = np.asarray(start) - jobs.arrival
    return Run(policy.name, wait + jobs.prefill, wait, active, held, fleet.cold_starts)


# -- policies --------------------------------------------------------------------------


@dataclass
class Reactive:
    """Sizes the fleet to what it sees now; new workers need a cold start. Scales down
    like an autoscaler's stabilisation window: to the most it wanted in the last minutes."""

    lane: Lane
    cold_start_s: float
    name: str = "reactive"
    recent: list[int] = field(default_factory=list)  # what it wanted, last minutes

    def tick(self, t: float, fleet: Fleet, seen: Observed) -> None:
        demand = seen.busy + seen.queued
        wanted = math.ceil(demand / (SLOTS * REACTIVE_UTIL))
        wanted = min(self.lane.max_workers, max(self.lane.min_workers, wanted))
        self.recent = [*self.recent, wanted][-REACTIVE_DOWN_TICKS:]
        live = fleet.active(t) + fleet.pending(t)
        for _ in range(wanted - live):
            fleet.activate(t + self.cold_start_s)
            fleet.cold_starts += 1
        if len(self.recent) == REACTIVE_DOWN_TICKS:
            for _ in range(live - max(self.recent)):
                fleet.retire()


@dataclass
class Prewarm:
    """The scheduler's loop: forecast, plan, activate standby workers ahead of time."""

    lane: Lane
    history: dict[datetime, float]  # grows by one minute each tick
    today: np.ndarray  # the festival day's arrivals per minute (read as minutes end)
    capacity: Capacity
    prefill_ms: float
    engine: Engine
    name: str = "pre-warming"
    plans: list[int] = field(default_factory=list)

    def tick(self, t: float, fleet: Fleet, seen: Observed) -> None:
        now = DAY0 + timedelta(seconds=t)
        minute = int(t // 60) - 1
        self.history[now - timedelta(minutes=1)] = float(self.today[minute])
        expected = forecast(self.history, now, HORIZON_MIN, windows_of(self.lane))
        lead = timedelta(seconds=lead_time_s(self.engine.activation_s, MARGIN_S) + TICK_S)
        target = self.workers(peak_rate_per_s(expected, now, now + lead))
        ready = self.workers(peak_rate_per_s(expected, now, now + timedelta(minutes=HORIZON_MIN)))
        self.plans.append(target)
        self.fill_standby(t, fleet, ready)
        self.scale(t, fleet, target)

    def workers(self, rate_per_s: float) -> int:
        c = self.capacity
        return plan(rate_per_s, c.per_worker_rps, c.mean_service_s, c.slots,
                    self.lane.ttft_p99_objective_ms, self.lane.min_workers,
                    self.lane.max_workers, HEADROOM, self.prefill_ms)

    def fill_standby(self, t: float, fleet: Fleet, ready: int) -> None:
        """Keep live + standby workers at the horizon's plan plus the standby pool:
        cold-start the missing ones, release the extra standby ones."""
        fleet.standby += sum(1 for at in fleet.standby_ready if at <= t)
        fleet.standby_ready = [at for at in fleet.standby_ready if at > t]
        live = len(fleet.live())
        wanted = max(ready - live, 0) + STANDBY_POOL
        for _ in range(wanted - fleet.standby - len(fleet.standby_ready)):
            fleet.standby_ready.append(t + self.engine.cold_start_s)
            fleet.cold_starts += 1
        fleet.standby = min(fleet.standby, max(wanted - len(fleet.standby_ready), 0))

    def scale(self, t: float, fleet: Fleet, target: int) -> None:
        up = min(target - fleet.active(t) - fleet.pending(t), fleet.standby)
        for _ in range(max(0, up)):
            fleet.activate(t + self.engine.activation_s)
            fleet.standby -= 1
        if target < fleet.active(t):  # one a minute: the forecast may turn back up
            fleet.retire()
            fleet.standby += 1


# -- measures --------------------------------------------------------------------------


def window_mask(jobs: Jobs, start_s: float, end_s: float) -> np.ndarray:
    return (jobs.arrival >= start_s) & (jobs.arrival < end_s)


def per_minute_p99(jobs: Jobs, ttft: np.ndarray) -> list[float]:
    """TTFT P99 of the jobs arriving in each simulated minute (arrivals are sorted)."""
    edges = np.arange(SIM_START_H * 3600, SIM_END_H * 3600 + 1, 60)
    bounds = np.searchsorted(jobs.arrival, edges)
    return [float(np.percentile(ttft[a:b], 99)) if b > a else math.nan
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def summarize(jobs: Jobs, run: Run, objective_s: float) -> dict[str, Any]:
    steady = window_mask(jobs, STEADY_H[0] * 3600, STEADY_H[1] * 3600)
    peak = window_mask(jobs, _seconds(FESTIVAL["start"]), _seconds(FESTIVAL["end"]))
    steady_p99 = percentile(run.ttft[steady].tolist(), 99)
    peak_p99 = percentile(run.ttft[peak].tolist(), 99)
    minutes = per_minute_p99(jobs, run.ttft)
    return {
        "steady_ttft_p50_ms": percentile(run.ttft[steady].tolist(), 50) * 1000,
        "steady_ttft_p99_ms": steady_p99 * 1000,
        "peak_ttft_p99_ms": peak_p99 * 1000,
        "p99_over_steady": ratio(peak_p99, steady_p99),
        "worst_minute_p99_ms": max(minutes) * 1000,
        "peak_over_objective": float(np.mean(run.ttft[peak] > objective_s)),
        "peak_wait_p99_ms": percentile(run.wait[peak].tolist(), 99) * 1000,
        "max_active": max(run.active),
        "cold_starts": run.cold_starts,
        "active_worker_h": sum(run.active) / 60,
        "held_worker_h": sum(run.held) / 60,
        "minute_p99_ms": [m * 1000 for m in minutes],
        "active": run.active,
    }


def _seconds(at: Any) -> float:
    return float((at - DAY0).total_seconds())


# -- report ----------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]], objective_ms: float) -> str:
    headers = ["policy", "steady TTFT p50 (ms)", "steady TTFT p99 (ms)",
               "peak TTFT p99 (ms)", "peak p99 / steady p99", "worst minute p99 (ms)",
               f"peak jobs over {objective_ms:,.0f} ms", "max active", "cold starts",
               "active worker-h", "GPU-h held"]
    rows = [[name, fmt(r["steady_ttft_p50_ms"]), fmt(r["steady_ttft_p99_ms"]),
             fmt(r["peak_ttft_p99_ms"]), fmt(r["p99_over_steady"], 2),
             fmt(r["worst_minute_p99_ms"]), f"{r['peak_over_objective']:.2%}",
             str(r["max_active"]), str(r["cold_starts"]), fmt(r["active_worker_h"]),
             fmt(r["held_worker_h"])] for name, r in results.items()]
    return markdown_table(headers, rows)


def plot(path: Path, jobs: Jobs, results: dict[str, dict[str, Any]]) -> None:
    """Per-minute TTFT P99 of both policies over the arrival rate; active workers below."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; set before pyplot is imported
    import matplotlib.pyplot as plt

    first = SIM_START_H * 60
    hours = [(first + i) / 60 for i in range(len(jobs.counts) - first)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    rate = top.twinx()
    rate.fill_between(hours, jobs.counts[first:] / 60, color="0.85", step="post")
    rate.set_ylabel("arrivals per second")
    top.set_zorder(rate.get_zorder() + 1)
    top.patch.set_visible(False)
    for name, r in results.items():
        top.plot(hours, [v / 1000 for v in r["minute_p99_ms"]], label=name, lw=1.2)
        bottom.step(hours, r["active"], where="post", label=name)
    top.set(yscale="log", ylabel="TTFT p99 per minute (s)",
            title="Festival night (10x in 15 min): TTFT p99, reactive vs pre-warming")
    bottom.set(xlabel="hour of the festival day (UTC)", ylabel="active workers")
    for ax in (top, bottom):
        ax.axvspan(_seconds(FESTIVAL["start"]) / 3600, _seconds(FESTIVAL["end"]) / 3600,
                   color="tab:orange", alpha=0.08)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setup(engine: Engine, capacity: Capacity, lane: Lane, jobs: Jobs) -> dict[str, Any]:
    mean_prefill = float(np.mean(jobs.prefill))
    return {
        "lane": f"`{lane.name}` (TTFT p99 objective {lane.ttft_p99_objective_ms:,.0f} ms, "
                f"{lane.min_workers}-{lane.max_workers} workers)",
        "engine figures from": engine.source,
        "per job": f"{PROMPT_TOKENS} prompt tokens; prefill lognormal p50 "
                   f"{engine.prefill_p50_s * 1000:.0f} ms / p99 "
                   f"{engine.prefill_p99_s * 1000:.0f} ms (mean {mean_prefill * 1000:.0f} ms); "
                   f"{engine.tokens} tokens at TPOT p50 {engine.tpot_p50_s * 1000:.1f} ms / "
                   f"p99 {engine.tpot_p99_s * 1000:.1f} ms",
        "per worker": f"{SLOTS} slots, mean service {capacity.mean_service_s:.2f} s, "
                      f"capacity {capacity.per_worker_rps:.1f} jobs/s",
        "engine profile": _profile_line(engine.profile),
        "cold start / activation (standby -> active)": f"{engine.cold_start_s:g} s / "
                                                       f"{engine.activation_s:g} s (the profile's)",
        "traffic": f"Poisson, day curve {engine.base_rate:.1f} jobs/s ({BASE_LOAD:g} workers' "
                   f"capacity) +-{DAY_SWING:.0%} (highest "
                   f"20:00), festival day {TODAY_GROWTH - 1:.0%} above the {HISTORY_DAYS} "
                   "previous days",
        "festival (declared in the lane)": f"{FESTIVAL['start']:%H:%M}-{FESTIVAL['end']:%H:%M}"
                                           f" UTC, {FESTIVAL['factor']:g}x, ramp "
                                           f"{FESTIVAL['ramp_min']:g} min",
        "jobs simulated per policy": f"{len(jobs.arrival):,}",
        "steady state / peak": f"arrivals {STEADY_H[0]}:00-{STEADY_H[1]}:00 / the festival "
                               "window",
        "pre-warming": f"forecast {HORIZON_MIN} min, lead time "
                       f"{lead_time_s(engine.activation_s, MARGIN_S):.0f} s (+{TICK_S} s to "
                       f"the next decision), headroom {HEADROOM:.0%}, standby pool "
                       f"{STANDBY_POOL} + cold starts for the horizon",
        "reactive": f"target utilisation {REACTIVE_UTIL:.0%} of (busy + queued), drain after "
                    f"{REACTIVE_DOWN_TICKS} min",
        "seed": SEED,
    }


NOTES = [
    "Each slot is an independent server; the per-job figures are the profile's steps with "
    "all 64 slots busy, so batching's slowdown is in them, not modelled on top.",
    "A drained worker finishes its jobs; a retired pre-warming worker goes back to standby.",
    "GPU-h held counts active, starting and standby workers: what each policy pays for.",
    "Rates are scaled down (2-3 workers at dusk, some 20 at the peak); the result depends "
    "on ratios: peak / per-worker capacity and cold start / ramp.",
    "The reactive scaler counts queued jobs as demand: after the ramp's first minutes it "
    "asks for the lane's maximum, then drains back after its 5-minute window.",
    "Percentiles: linear between closest ranks (bench/common.percentile; numpy's default "
    "for the per-minute series).",
]


JSON_PREFIX = {"reactive": "reactive", "pre-warming": "prewarm"}


def lane_with_festival() -> Lane:
    """The shipped `chat` lane with the festival declared, through the lanes-file model."""
    chat = load_lanes()["chat"].model_dump()
    chat["peaks"] = [FESTIVAL]
    chat["max_workers"] = MAX_WORKERS
    return Lane(**chat)


@dataclass
class Outcome:
    engine: Engine
    lane: Lane
    jobs: Jobs
    capacity: Capacity
    results: dict[str, dict[str, Any]]


def compute() -> Outcome:
    """Both policies through the festival day: everything from the named profile, the
    lanes model and the seed; no file another benchmark wrote."""
    rng = np.random.default_rng(SEED)
    engine = engine_figures()
    lane = lane_with_festival()
    history = history_days(rng, engine.base_rate)
    jobs = festival_jobs(rng, windows_of(lane), engine)
    log(f"{len(jobs.arrival):,} jobs from {SIM_START_H}:00 to {SIM_END_H}:00")
    view = WorkerView(name="w", pool="vllm", lanes=frozenset({lane.name}), state="active",
                      slots=SLOTS, mean_job_ms=float(np.mean(jobs.service)) * 1000)
    capacity = capacity_from([view], lane.name)
    assert capacity is not None
    for m in range(SIM_START_H * 60):  # today before the simulated hours
        history[DAY0 + timedelta(minutes=m)] = float(jobs.counts[m])
    prewarm = Prewarm(lane, history, jobs.counts, capacity,
                      float(np.mean(jobs.prefill)) * 1000, engine)
    policies: list[Policy] = [Reactive(lane, engine.cold_start_s), prewarm]
    # Both start with the fleet the planner sizes for the first minute's rate.
    initial = prewarm.workers(float(jobs.counts[SIM_START_H * 60]) / 60)
    results = {}
    for policy in policies:
        run = simulate(jobs, policy, initial)
        results[policy.name] = summarize(jobs, run, lane.ttft_p99_objective_ms / 1000)
        log(f"{policy.name}: peak p99 / steady p99 "
            f"{results[policy.name]['p99_over_steady']:.2f}")
    return Outcome(engine, lane, jobs, capacity, results)


def main() -> int:
    began = time.process_time()
    out = compute()
    results = out.results
    report = table(results, out.lane.ttft_p99_objective_ms)
    info = setup(out.engine, out.capacity, out.lane, out.jobs) | {"machine": machine()}
    cpu_s = time.process_time() - began
    info["CPU time of the run (s)"] = f"{cpu_s:.1f}"
    write_report(RESULTS / "peak.md", "Festival night: reactive scaling vs pre-warming",
                 report + "\n\n![TTFT p99 per minute](peak.png)", info, NOTES)
    plot(RESULTS / "peak.png", out.jobs, results)
    print(f"engine: {info['engine profile']}")
    print(report)
    figures = {
        "benchmark": "peak",
        "profile": out.engine.profile.name,
        "prewarm_p99_over_steady": results["pre-warming"]["p99_over_steady"],
        "reactive_p99_over_steady": results["reactive"]["p99_over_steady"],
        **{f"{JSON_PREFIX[name]}_{key}": value for name, r in results.items()
           for key, value in r.items() if not isinstance(value, list)},
        "cpu_s": round(cpu_s, 1),
    }
    write_json(RESULTS / "peak.json", {**figures, "setup": info, "per_minute": {
        name: {"minute_p99_ms": r["minute_p99_ms"], "active": r["active"]}
        for name, r in results.items()}})
    print_json_last(figures)
    return 0


def _profile_line(profile: SimProfile) -> str:
    """The profile as the report prints it: its name and every figure."""
    figures = ", ".join(f"{f.name} {getattr(profile, f.name):g}" for f in fields(profile)
                        if f.name != "name")
    return f"`{profile.name}` (workers/sim_profiles.toml): {figures}"


if __name__ == "__main__":
    sys.exit(main())
