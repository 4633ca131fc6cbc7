"""A festival night replayed on the real path, time-compressed: pre-warming against
reactive scaling, and pre-warming through a worker killed at the peak's start.

    .venv/bin/python bench/festival.py --quick   # smoke run: short, 3 workers at most
    .venv/bin/python bench/festival.py           # the three runs, about 10 minutes

Nothing is mocked. Each run starts its own stack: a private `redis-server`, a private
PostgreSQL database (`--sqlite`: a SQLite file), `tidegate api`, `tidegate scheduler`
(redbeat's beat, forecast, planner, Celery control commands) and `tidegate worker
--engine sim --pool vllm` processes, one lane each (profile `festival-replay`, 4 slots).

The day. Every process runs on a replay clock (TIDEGATE_REPLAY_*, tidegate/clock.py): a
simulated minute passes in a real second (`speedup` 60). The lanes file declares the
festival window on `finance` and `chat` (a one-off peak, ramping in and out); the store
holds the previous days' arrivals at the steady rates (the forecast's seasonal history)
and today's hour before the replay. Producers (aiohttp, one event loop) submit Poisson
arrivals to both lanes through `POST /v1/jobs` at the steady rate times the declared
factor, and read each job's SSE stream; TTFT = first token received - submit start, in
real seconds (a job's own times are not compressed). The arrivals are seeded: every run
gets the same ones.

Who does what:
- the API counts arrivals per simulated minute; the scheduler moves them into the store,
  forecasts, plans each lane (scheduler/autoscale.py) and activates standby workers
  (warm the lane's prefixes, add_consumer, verified with active_queues());
- the scheduler never starts a process: each tick it writes its plan per lane
  (`keys.scheduler_plans`), with `short`, the workers it wants ready beyond those the
  lane holds. This benchmark plays the node autoscaler: it starts that many new worker
  processes in standby (a cold start: the process's real start, plus the profile's
  modelled engine load compressed, 31.78 s / 60), and nothing else;
- a sim worker plays the profile's cold start (engine load and warm-up) and activation
  (the warm-up of the lane's prefixes) divided by the speed-up; its steps are real time.

The runs, one after the other, same arrivals:
- `prewarm`: TIDEGATE_PREWARM on: the scheduler plans on the forecast one lead time
  ahead, and asks for capacity for the next 30 simulated minutes; a standby pool of two
  workers a lane is held from the start (the operator's: the festival's extra worker and
  one for a failure);
- `reactive`: TIDEGATE_PREWARM off: each lane planned on the last 5 minutes' arrivals; no
  standby pool, so new capacity is a cold start when the traffic is already there;
- `prewarm_kill`: as `prewarm`, and an active `finance` worker SIGKILLed (its process
  group) at the festival's start.

Figures: per simulated minute, TTFT p50/p99 per lane of the jobs submitted in it, queue
depth per lane, workers by state (standby, active, cold-starting: a process started and
not yet standby); per run and lane, peak p99 (the festival window) over steady p99 (the
steady minutes before it); standby activations, cold starts, worker-hours held (every
worker process alive, in simulated hours: the cost); the scheduler's first activation
ahead of the festival, its standby worker-hours, and its forecast against the arrivals.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/festival.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.festival, then exits

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    RESULTS,
    ROOT,
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
from bench.frontdoor import Client, JobTrace
from bench.stack import bench_database, tidegate_env
from scheduler.peaks import PeakWindow, peak_factor
from tidegate import keys, redisconn
from tidegate.fleet import read_fleet
from tidegate.lanes import load_lanes, pool_queue
from tidegate_tools.procs import (
    Proc,
    free_port,
    start_api,
    start_redis,
    start_scheduler,
    start_worker,
    wait_until,
)
from tidegate_tools.stack import api_ready
from workers.sim_profile import load_profile

PROFILE = "festival-replay"  # workers/sim_profiles.toml
SLOTS = 4  # engine slots of a sim worker: few, so the machine is not the bottleneck
MAX_TOKENS = 8
POOL = "vllm"  # the pool the sim workers join (the shipped lanes route to trtllm, vllm)
LANES = ("finance", "chat")
SEED = 20261111
DAY = datetime(2026, 11, 11, tzinfo=UTC)
TICK_S = 1.0  # the scheduler's period, real seconds (a simulated minute at 60x)
HEARTBEAT_S = 0.5
DRAIN_S = 60.0  # jobs still streaming at the end get this long
# The replay's lanes: objectives on the replay engine's scale. The shipped ones (1 s and
# 2 s) are for a GPU engine whose TTFT is tens of milliseconds; here TTFT is ~0.35 s
# without a queue, and the scheduler plans the P99 queue wait against the objective (it
# passes no prefill time), so the replay's objectives are queue-wait budgets.
OBJECTIVE_MS = {"finance": 150.0, "chat": 300.0}


@dataclass(frozen=True)
class Replay:
    """One simulated evening; minutes are minutes of the festival day (UTC)."""

    start_min: int
    # The reference for "peak over steady": steady minutes that end before the festival's
    # start, so that jobs in flight on the worker killed there (prewarm_kill) count in
    # neither window; the table shows them on their own.
    steady: tuple[int, int]
    festival: tuple[int, int]  # the declared window
    end_min: int
    factor: float  # the festival's traffic multiplier
    ramp_min: float
    rates: Mapping[str, float]  # steady jobs/s per lane
    speedup: float
    initial_active: int  # active workers a lane starts with
    standby_pool: int  # standby workers a lane holds from the start (pre-warming runs)
    max_workers: int  # per lane (the lanes file)
    max_procs: int  # worker processes at once, all lanes: the node autoscaler's cap
    grace_s: float  # the stack starts within this; the replay's clock starts after it

    def at(self, minute: float) -> datetime:
        return DAY + timedelta(minutes=minute)

    def window(self) -> PeakWindow:
        return PeakWindow(self.at(self.festival[0]), self.at(self.festival[1]), self.factor,
                          self.ramp_min)

    def rate(self, lane: str, minute: float) -> float:
        return self.rates[lane] * peak_factor([self.window()], self.at(minute))


FULL = Replay(start_min=19 * 60 + 20, steady=(19 * 60 + 30, 19 * 60 + 55),
              festival=(20 * 60, 20 * 60 + 45), end_min=20 * 60 + 50, factor=4.0,
              ramp_min=10.0, rates={"finance": 1.5, "chat": 2.0}, speedup=60.0,
              initial_active=2, standby_pool=2, max_workers=5, max_procs=12,
              grace_s=120.0)
QUICK = Replay(start_min=19 * 60 + 48, steady=(19 * 60 + 50, 19 * 60 + 58),
               festival=(20 * 60, 20 * 60 + 15), end_min=20 * 60 + 17, factor=2.0,
               ramp_min=5.0, rates={"finance": 0.5, "chat": 0.6}, speedup=60.0,
               initial_active=1, standby_pool=0, max_workers=2, max_procs=3,
               grace_s=90.0)


@dataclass(frozen=True)
class RunSpec:
    name: str
    prewarm: bool
    kill: bool


RUNS = {"prewarm": RunSpec("prewarm", True, False),
        "reactive": RunSpec("reactive", False, False),
        "prewarm_kill": RunSpec("prewarm_kill", True, True)}


# -- the stack ------------------------------------------------------------------------


def lanes_file(path: Path, replay: Replay) -> Path:
    """The shipped lanes with the festival declared on both, at the replay's scale."""
    text = (ROOT / "tidegate" / "lanes.toml").read_text()
    start, end = replay.at(replay.festival[0]), replay.at(replay.festival[1])
    extra = []
    for lane in LANES:
        extra.append(f"\n[[lanes.{lane}.peaks]]\nstart = {start:%Y-%m-%dT%H:%M:%SZ}\n"
                     f"end = {end:%Y-%m-%dT%H:%M:%SZ}\nfactor = {replay.factor}\n"
                     f"ramp_min = {replay.ramp_min}\n")
    path.write_text(_with_limits(text + "".join(extra), replay))
    load_lanes(path)  # the model validates it as the processes will
    return path


def _with_limits(body: str, replay: Replay) -> str:
    """Each replayed lane's objective and worker bounds, set in its table."""
    out, lane = [], None
    for line in body.splitlines():
        if line.startswith("[lanes.") and not line.startswith("[[") and "." not in line[7:-1]:
            lane = line[7:-1]
        if lane in LANES and line.startswith("ttft_p99_objective_ms"):
            line = (f"ttft_p99_objective_ms = {OBJECTIVE_MS[lane]:g}\n"
                    f"min_workers = 1\nmax_workers = {replay.max_workers}")
        out.append(line)
    return "\n".join(out) + "\n"


def write_history(db_url: str, replay: Replay, rng: np.random.Generator) -> int:
    """The forecast's history: yesterday's and last week's evenings at the steady rates,
    and today's hour before the replay (Poisson counts per minute)."""
    from store import Store

    store = Store(db_url)
    rows = 0
    first, last = replay.start_min - 60, replay.end_min + 60
    spans = [(-7, first, last), (-1, first, last), (0, first, replay.start_min)]
    per_min_s = 60.0 / replay.speedup  # a simulated minute's real seconds
    try:
        for day, lo, hi in spans:
            for lane in LANES:
                for minute, n in zip(range(lo, hi),
                                     rng.poisson(replay.rates[lane] * per_min_s, hi - lo),
                                     strict=True):
                    if n:
                        store.traffic.record_arrivals(lane, replay.at(minute) + timedelta(days=day),
                                                      int(n))
                        rows += 1
    finally:
        store.engine.dispose()
    return rows


def replay_env(base: Mapping[str, str], replay: Replay, lanes: Path, wall_start: float,
               prewarm: bool) -> dict[str, str]:
    return {**base, "TIDEGATE_SIM_PROFILE": PROFILE, "TIDEGATE_LANES_FILE": str(lanes),
            "TIDEGATE_REPLAY_START": replay.at(replay.start_min).isoformat(),
            "TIDEGATE_REPLAY_WALL_START": f"{wall_start:.3f}",
            "TIDEGATE_REPLAY_SPEEDUP": f"{replay.speedup:g}",
            "TIDEGATE_PREWARM": "true" if prewarm else "false",
            "TIDEGATE_SCHEDULER_TICK_S": f"{TICK_S:g}", "TIDEGATE_HEARTBEAT_S": f"{HEARTBEAT_S:g}",
            "TIDEGATE_LOG_FORMAT": "text", "TIDEGATE_LOG_LEVEL": "WARNING"}


@dataclass
class WorkerProc:
    proc: Proc
    name: str
    lane: str
    started_at: float  # real
    cold: bool  # started by the node autoscaler during the run
    standby: bool  # started with --standby
    ended_at: float | None = None
    ready_at: float | None = None  # its first standby/active heartbeat


@dataclass
class Fleet:
    """The worker processes of a run, and the node autoscaler that adds them."""

    env: dict[str, str]
    logs: Path
    replay: Replay
    workers: list[WorkerProc] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    serial: int = 0

    def start(self, lane: str, standby: bool, cold: bool) -> WorkerProc:
        with self.lock:
            self.serial += 1
            name = f"{lane}{self.serial}@festival"
        proc = start_worker(self.env, lane, name, self.logs, pool=POOL, standby=standby,
                            engine="sim")
        worker = WorkerProc(proc, name, lane, time.time(), cold, standby)
        with self.lock:
            self.workers.append(worker)
        return worker

    def alive(self, lane: str | None = None) -> list[WorkerProc]:
        with self.lock:
            return [w for w in self.workers if w.ended_at is None
                    and (lane is None or w.lane == lane)]

    def kill(self, worker: WorkerProc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.proc.popen.pid, signal.SIGKILL)
        worker.ended_at = time.time()

    def stop_all(self) -> None:
        for w in self.workers:
            w.proc.stop()
            if w.ended_at is None:
                w.ended_at = time.time()


class NodeAutoscaler(threading.Thread):
    """Reads the scheduler's plans; for a lane `short` of workers, starts that many new
    worker processes in standby, less those it started that are not yet heartbeating."""

    def __init__(self, fleet: Fleet, redis_url: str, namespace: str) -> None:
        super().__init__(name="node-autoscaler", daemon=True)
        self.fleet, self.namespace = fleet, namespace
        self.client = redisconn.sync_client(redis_url)
        self.halt = threading.Event()
        self.last_id = "$"

    def run(self) -> None:
        while not self.halt.is_set():
            entries: Any = self.client.xread({keys.scheduler_plans(self.namespace): self.last_id},
                                             count=100, block=250)
            latest: dict[str, dict[str, Any]] = {}
            for _, items in entries or []:
                for entry_id, fields in items:
                    self.last_id = entry_id
                    plan = json.loads(fields[b"p"])
                    latest[plan["lane"]] = plan
            for lane, plan in latest.items():
                self.grow(lane, int(plan["short"]))

    def grow(self, lane: str, short: int) -> None:
        if lane not in LANES or short <= 0:
            return
        beating = {hb.name for hb in read_fleet(self.client, self.namespace)}
        pending = [w for w in self.fleet.alive(lane) if w.name not in beating]
        room = min(self.fleet.replay.max_procs - len(self.fleet.alive()),
                   self.fleet.replay.max_workers + 1 - len(self.fleet.alive(lane)))
        for _ in range(max(0, min(short - len(pending), room))):
            self.fleet.start(lane, standby=True, cold=True)


# -- sampling ---------------------------------------------------------------------------


@dataclass
class Minute:
    """What the sampler saw in one simulated minute (its last sample)."""

    depth: dict[str, int]
    states: dict[str, dict[str, int]]  # lane -> state -> workers


class Sampler(threading.Thread):
    """Once a simulated minute: queue depth per lane, workers by state per lane."""

    def __init__(self, fleet: Fleet, redis_url: str, namespace: str, wall_start: float,
                 lanes_path: Path) -> None:
        super().__init__(name="sampler", daemon=True)
        self.fleet, self.namespace, self.wall_start = fleet, namespace, wall_start
        self.client = redisconn.sync_client(redis_url)
        self.lanes = load_lanes(lanes_path)
        self.halt = threading.Event()
        self.minutes: dict[int, Minute] = {}
        self.period_s = 60.0 / fleet.replay.speedup / 2  # twice a simulated minute

    def run(self) -> None:
        while not self.halt.wait(self.period_s):
            now = time.time()
            minute = self.fleet.replay.start_min + math.floor(
                (now - self.wall_start) * self.fleet.replay.speedup / 60)
            self.minutes[minute] = self.sample(now)

    def sample(self, now: float) -> Minute:
        depth = {lane: sum(int(self.client.llen(q)) for q in keys.queue_sublists(
            pool_queue(self.lanes[lane], POOL))) for lane in LANES}
        states = {lane: {"active": 0, "standby": 0, "cold-starting": 0} for lane in LANES}
        beating = {}
        for hb in read_fleet(self.client, self.namespace):
            beating[hb.name] = hb.state.value
            lane = hb.lanes[0] if hb.lanes else ""
            if lane in states:
                key = hb.state.value if hb.state.value in ("active", "standby") else "cold-starting"
                states[lane][key] += 1
        for w in self.fleet.alive():
            if w.ready_at is None and beating.get(w.name) in ("active", "standby"):
                w.ready_at = now
            if w.name not in beating:
                states[w.lane]["cold-starting"] += 1
        return Minute(depth, states)


# -- traffic ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    lane: str
    at: float  # real seconds from the replay's start


def arrivals(replay: Replay, rng: np.random.Generator) -> list[Arrival]:
    """Poisson arrivals per lane, at each simulated minute's rate (its middle)."""
    out = []
    per_min_s = 60.0 / replay.speedup
    for lane in LANES:
        for i, minute in enumerate(range(replay.start_min, replay.end_min)):
            n = rng.poisson(replay.rate(lane, minute + 0.5) * per_min_s)
            out += [Arrival(lane, (i + u) * per_min_s) for u in rng.uniform(0, 1, n)]
    return sorted(out, key=lambda a: a.at)


@dataclass
class Job:
    lane: str
    minute: int  # the simulated minute it was submitted in
    trace: JobTrace


async def drive(base: str, key: str, plan: Sequence[Arrival], wall_start: float,
                replay: Replay, kill_at: float | None, kill: Any) -> list[Job]:
    clients = {lane: Client(base, key, lane) for lane in LANES}
    jobs: list[Job] = []
    tasks = []

    async def one(arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, wall_start + arrival.at - time.time()))
        minute = replay.start_min + math.floor(arrival.at * replay.speedup / 60)
        job = Job(arrival.lane, minute, JobTrace(submit_at=time.time()))
        jobs.append(job)
        try:
            await clients[arrival.lane].stream_job(job.trace, MAX_TOKENS)
        except Exception as exc:  # noqa: BLE001 - a failed job is a figure, not a crash
            job.trace.error = f"{type(exc).__name__}: {exc}"

    async def killer() -> None:
        assert kill_at is not None
        await asyncio.sleep(max(0.0, kill_at - time.time()))
        await asyncio.to_thread(kill)

    try:
        tasks = [asyncio.create_task(one(a)) for a in plan]
        if kill_at is not None:
            tasks.append(asyncio.create_task(killer()))
        end = wall_start + (replay.end_min - replay.start_min) * 60 / replay.speedup
        done, pending = await asyncio.wait(tasks, timeout=end - time.time() + DRAIN_S)
        for task in pending:
            task.cancel()
    finally:
        for client in clients.values():
            await client.close()
    return jobs


# -- one run ---------------------------------------------------------------------------


@dataclass
class RunResult:
    spec: RunSpec
    jobs: list[Job]
    minutes: dict[int, Minute]
    workers: list[WorkerProc]
    plans: list[dict[str, Any]]
    actions: list[dict[str, Any]]
    wall_start: float
    killed: str | None


def read_stream(client: Any, key: str, field_name: bytes) -> list[dict[str, Any]]:
    return [json.loads(f[field_name]) for _, f in client.xrange(key)]


CLOCK_LEAD_S = 20.0  # the API and the scheduler start within this, before the replay


def run_once(spec: RunSpec, replay: Replay, args: argparse.Namespace, tmp: Path) -> RunResult:
    """One run on a stack of its own; every process it starts is stopped on the way out."""
    from store import Store, upgrade

    logs = tmp / "logs"
    with bench_database(tmp, not args.sqlite) as db_url, contextlib.ExitStack() as stop:
        upgrade(db_url)
        store = Store(db_url)
        _, key = store.tenants.create_tenant("festival", list(LANES))
        store.engine.dispose()
        history = write_history(db_url, replay, np.random.default_rng(SEED + 1))
        log(f"{spec.name}: {history} minutes of history in the store")
        lanes = lanes_file(tmp / "lanes.toml", replay)
        redis_port, api_port = free_port(), free_port()
        redis_proc = start_redis(redis_port, logs)
        stop.callback(redis_proc.stop)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        base_env = {**tidegate_env(db_url, SLOTS), "TIDEGATE_REDIS_URL": redis_url}
        # Workers first: of the replay clock they read only its speed-up, so the clock
        # starts once they are up, not after a guess at how long they take.
        launch = time.time()
        fleet = Fleet(replay_env(base_env, replay, lanes, launch + replay.grace_s,
                                 spec.prewarm), logs, replay)
        stop.callback(fleet.stop_all)
        for lane in LANES:
            for _ in range(replay.initial_active):
                fleet.start(lane, standby=False, cold=False)
            for _ in range(replay.standby_pool if spec.prewarm else 0):
                fleet.start(lane, standby=True, cold=False)
        client = redisconn.sync_client(redis_url)
        namespace = base_env["TIDEGATE_NAMESPACE"]
        names = {w.name for w in fleet.workers}
        wait_until(lambda: names <= ready_workers(client, namespace), replay.grace_s,
                   "the first workers", [w.proc for w in fleet.workers])
        for w in fleet.workers:
            w.ready_at = time.time()
        wall_start = time.time() + CLOCK_LEAD_S
        fleet.env = replay_env(base_env, replay, lanes, wall_start, spec.prewarm)
        api = start_api(fleet.env, api_port, logs)
        stop.callback(api.stop)
        scheduler = start_scheduler(fleet.env, logs)
        stop.callback(scheduler.stop)
        base = f"http://127.0.0.1:{api_port}"
        active = {w.name for w in fleet.workers if w.name in names} - standby_names(fleet)
        wait_until(lambda: api_ready(base, active), CLOCK_LEAD_S, "the API",
                   [api, scheduler])
        log(f"{spec.name}: stack ready {time.time() - launch:.0f} s after launch")
        return drive_run(spec, replay, base, key, redis_url, fleet, wall_start, lanes)


def ready_workers(client: Any, namespace: str) -> set[str]:
    return {hb.name for hb in read_fleet(client, namespace)
            if hb.state.value in ("active", "standby")}


def standby_names(fleet: Fleet) -> set[str]:
    return {w.name for w in fleet.workers if w.standby}


def drive_run(spec: RunSpec, replay: Replay, base: str, key: str, redis_url: str,
              fleet: Fleet, wall_start: float, lanes: Path) -> RunResult:
    namespace = fleet.env["TIDEGATE_NAMESPACE"]
    client = redisconn.sync_client(redis_url)
    if time.time() > wall_start:
        raise RuntimeError("the API and the scheduler took longer than CLOCK_LEAD_S to start")
    autoscaler = NodeAutoscaler(fleet, redis_url, namespace)
    sampler = Sampler(fleet, redis_url, namespace, wall_start, lanes)
    autoscaler.start()
    sampler.start()
    killed: list[str] = []

    def kill() -> None:
        victims = [w for w in fleet.alive("finance") if not w.cold]
        beats = {hb.name: hb.state.value for hb in read_fleet(client, namespace)}
        victim = next((w for w in victims if beats.get(w.name) == "active"), victims[0])
        fleet.kill(victim)
        killed.append(victim.name)
        log(f"{spec.name}: SIGKILLed {victim.name} at the festival's start")

    kill_at = (wall_start + (replay.festival[0] - replay.start_min) * 60 / replay.speedup
               if spec.kill else None)
    plan = arrivals(replay, np.random.default_rng(SEED))
    log(f"{spec.name}: {len(plan)} jobs over {replay.end_min - replay.start_min} simulated "
        f"minutes ({(replay.end_min - replay.start_min) * 60 / replay.speedup:.0f} s)")
    try:
        jobs = asyncio.run(drive(base, key, plan, wall_start, replay, kill_at, kill))
    finally:
        autoscaler.halt.set()
        sampler.halt.set()
        autoscaler.join(5)
        sampler.join(5)
    plans = read_stream(client, keys.scheduler_plans(namespace), b"p")
    actions = read_stream(client, keys.scheduler_actions(namespace), b"a")
    return RunResult(spec, jobs, dict(sampler.minutes), list(fleet.workers), plans, actions,
                     wall_start, killed[0] if killed else None)


# -- figures ---------------------------------------------------------------------------


def sim_minute(replay: Replay, wall_start: float, t: float) -> float:
    return replay.start_min + (t - wall_start) * replay.speedup / 60


def ttfts(jobs: Sequence[Job], lane: str, lo: int, hi: int) -> list[float]:
    return [j.trace.ttft_ms for j in jobs if j.lane == lane and lo <= j.minute < hi
            and not math.isnan(j.trace.first_token_at)]


def summarize(r: RunResult, replay: Replay) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lane in LANES:
        steady = ttfts(r.jobs, lane, *replay.steady)
        peak = ttfts(r.jobs, lane, *replay.festival)
        lane_jobs = [j for j in r.jobs if j.lane == lane]
        out[lane] = {
            "jobs": len(lane_jobs),
            "errors": sum(1 for j in lane_jobs if j.trace.error),
            "steady_p50_ms": percentile(steady, 50), "steady_p99_ms": percentile(steady, 99),
            "peak_p50_ms": percentile(peak, 50), "peak_p99_ms": percentile(peak, 99),
            "peak_over_steady": ratio(percentile(peak, 99), percentile(steady, 99)),
            "forecast_over_arrivals": forecast_ratio(r, replay, lane),
            # the jobs between the steady minutes and the festival (in flight at a kill)
            "between_max_ms": max(ttfts(r.jobs, lane, replay.steady[1], replay.festival[0]),
                                  default=math.nan),
        }
    end = r.wall_start + (replay.end_min - replay.start_min) * 60 / replay.speedup
    held_s = sum(max(0.0, min(w.ended_at or end, end) - max(w.started_at, r.wall_start))
                 for w in r.workers)
    activations = [a for a in r.actions if a.get("action") == "activate"]
    ahead = [replay.festival[0] - sim_minute(replay, r.wall_start, a["ts"])
             for a in activations if a["ts"] >= r.wall_start]
    cold = [w for w in r.workers if w.cold]
    cold_s = [(w.ready_at - w.started_at) * replay.speedup for w in cold if w.ready_at]
    took = [float(a["took_s"]) * replay.speedup for a in activations]
    standby_min = sum(m.states[lane]["standby"] for m in r.minutes.values() for lane in LANES)
    out["fleet"] = {
        "standby_activations": len(activations),
        "cold_starts": len(cold),
        "worker_hours": held_s * replay.speedup / 3600,
        "standby_worker_hours": standby_min / 60,
        "first_activation_ahead_min": max(ahead) if ahead else math.nan,
        "cold_start_sim_s": percentile(cold_s, 50) if cold_s else math.nan,
        "activation_sim_s": percentile(took, 50) if took else math.nan,
        "max_active": max((sum(m.states[lane]["active"] for lane in LANES)
                           for m in r.minutes.values()), default=0),
        "killed": r.killed,
    }
    return out


def forecast_ratio(r: RunResult, replay: Replay, lane: str) -> float:
    """The scheduler's forecast for the festival's minutes (each the forecast of the minute
    it planned in, `now_rps`), summed, over the jobs that arrived in them."""
    expected = forecast_per_minute(r, replay, lane)
    minutes = range(*replay.festival)
    arrived = sum(1 for j in r.jobs if j.lane == lane and j.minute in minutes)
    total = sum(v for m in minutes if not math.isnan(v := expected.get(m, math.nan)))
    return ratio(total, arrived)


def forecast_per_minute(r: RunResult, replay: Replay, lane: str) -> dict[int, float]:
    """Jobs per simulated minute the scheduler expected, by the minute it planned in."""
    return {int(p["at"] // 60) - int(replay.at(0).timestamp() // 60):
            float(p["now_rps"]) * 60 / replay.speedup for p in r.plans if p["lane"] == lane}


def per_minute(r: RunResult, replay: Replay) -> dict[str, Any]:
    minutes = list(range(replay.start_min, replay.end_min))
    series: dict[str, Any] = {"minute": minutes}
    for lane in LANES:
        for q in (50, 99):
            series[f"{lane}_p{q}_ms"] = [
                percentile(v, q) if (v := ttfts(r.jobs, lane, m, m + 1)) else math.nan
                for m in minutes]
        series[f"{lane}_depth"] = [r.minutes[m].depth[lane] if m in r.minutes else math.nan
                                   for m in minutes]
        series[f"{lane}_arrivals"] = [sum(1 for j in r.jobs if j.lane == lane and j.minute == m)
                                      for m in minutes]
        expected = forecast_per_minute(r, replay, lane)
        series[f"{lane}_forecast"] = [expected.get(m, math.nan) for m in minutes]
    for state in ("active", "standby", "cold-starting"):
        series[state] = [sum(r.minutes[m].states[lane][state] for lane in LANES)
                         if m in r.minutes else math.nan for m in minutes]
    return series


def run_table(name: str, s: dict[str, Any]) -> str:
    headers = ["lane", "jobs", "errors", "steady TTFT p50 (ms)", "steady TTFT p99 (ms)",
               "peak TTFT p50 (ms)", "peak TTFT p99 (ms)", "peak p99 / steady p99",
               "forecast / arrivals (festival)", "max TTFT between steady and festival (ms)"]
    rows = [[lane, str(s[lane]["jobs"]), str(s[lane]["errors"]), fmt(s[lane]["steady_p50_ms"]),
             fmt(s[lane]["steady_p99_ms"]), fmt(s[lane]["peak_p50_ms"]),
             fmt(s[lane]["peak_p99_ms"]), fmt(s[lane]["peak_over_steady"], 2),
             fmt(s[lane]["forecast_over_arrivals"], 2), fmt(s[lane]["between_max_ms"])]
            for lane in LANES]
    f = s["fleet"]
    fleet = markdown_table(
        ["standby activations", "cold starts", "worker-h held (simulated)",
         "standby worker-h", "first activation ahead of the festival (min)",
         "cold start (simulated s, median)", "activation (simulated s, median)",
         "max active", "killed"],
        [[str(f["standby_activations"]), str(f["cold_starts"]), fmt(f["worker_hours"], 2),
          fmt(f["standby_worker_hours"], 2), fmt(f["first_activation_ahead_min"]),
          fmt(f["cold_start_sim_s"]), fmt(f["activation_sim_s"]), str(f["max_active"]),
          f["killed"] or "-"]])
    return f"### {name}\n\n{markdown_table(headers, rows)}\n\n{fleet}"


def plot(path: Path, series: Mapping[str, dict[str, Any]], replay: Replay) -> None:
    """Per simulated minute and run: TTFT p50/p99 per lane, queue depth, workers by
    state, the scheduler's forecast against the arrivals; the festival shaded."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; set before pyplot is imported
    import matplotlib.pyplot as plt

    rows = ["finance TTFT (s)", "chat TTFT (s)", "queue depth", "workers", "jobs / minute"]
    fig, axes = plt.subplots(len(rows), len(series), figsize=(5 * len(series), 13),
                             sharex=True, squeeze=False)
    for col, (name, s) in enumerate(series.items()):
        hours = [m / 60 for m in s["minute"]]
        for lane, ax in zip(LANES, axes[:2, col], strict=True):
            for q, style in ((50, ":"), (99, "-")):
                ax.plot(hours, [v / 1000 for v in s[f"{lane}_p{q}_ms"]], style,
                        label=f"p{q}")
            ax.set_yscale("log")
        for lane in LANES:
            axes[2, col].plot(hours, s[f"{lane}_depth"], label=lane)
            axes[4, col].plot(hours, s[f"{lane}_arrivals"], label=f"{lane} arrivals")
            axes[4, col].plot(hours, s[f"{lane}_forecast"], "--", label=f"{lane} forecast")
        axes[3, col].stackplot(hours, s["active"], s["standby"], s["cold-starting"],
                               labels=["active", "standby", "cold-starting"], step="post")
        axes[0, col].set_title(name)
        axes[-1, col].set_xlabel("hour of the festival day (simulated, UTC)")
        for row, ax in enumerate(axes[:, col]):
            ax.axvspan(replay.festival[0] / 60, replay.festival[1] / 60, color="tab:orange",
                       alpha=0.12)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(rows[row])
                ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def setup_lines(replay: Replay, args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    profile = load_profile(PROFILE)
    fmt_min = lambda m: f"{m // 60:02d}:{m % 60:02d}"  # noqa: E731
    return {
        "replay": f"{fmt_min(replay.start_min)}-{fmt_min(replay.end_min)} simulated, "
                  f"{replay.speedup:g} simulated s per real s",
        "festival (declared in the lanes file)": f"{fmt_min(replay.festival[0])}-"
                 f"{fmt_min(replay.festival[1])}, {replay.factor:g}x, ramp {replay.ramp_min:g} min",
        "steady (reference)": f"{fmt_min(replay.steady[0])}-{fmt_min(replay.steady[1])}",
        "traffic": ", ".join(f"{lane} {rate:g} jobs/s steady" for lane, rate
                             in replay.rates.items()) + f", Poisson, seed {SEED}; "
                 f"{MAX_TOKENS} tokens a job; history: the previous days at the steady rates",
        "engine profile": f"`{PROFILE}`: " + ", ".join(
            f"{k} {getattr(profile, k):g}" for k in ("prefill_ms_per_token", "decode_base_ms",
                                                      "decode_ms_per_seq", "cold_start_s",
                                                      "activation_s")),
        "workers": f"sim, {SLOTS} slots, pool {POOL}; {replay.initial_active} active a lane "
                   f"at the start; standby pool {replay.standby_pool} a lane (pre-warming "
                   f"runs); lanes' max {replay.max_workers}; {replay.max_procs} processes at most",
        "objectives (replay lanes)": ", ".join(f"{k} {v:g} ms" for k, v in OBJECTIVE_MS.items()),
        "scheduler": f"tick {TICK_S:g} s real ({TICK_S * replay.speedup:g} s simulated), "
                     f"heartbeat {HEARTBEAT_S:g} s",
        "store": "SQLite" if args.sqlite else "PostgreSQL",
        "machine": machine(),
        "load average at the end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "wall time (s)": f"{wall_s:.0f}",
    }


NOTES = [
    "TTFT is real time (submit -> first token at the client); only the day is compressed.",
    "A cold start is a new worker process: its real start on this machine (Python, Celery, "
    "the tokenizer) plus the profile's modelled load compressed; at 60x every real second "
    "is a simulated minute, so the process's own start weighs far more than the measured "
    "31.78 s would. The figure in the table is the measured one, in simulated seconds.",
    "An activation is the scheduler's control path in real time (warm broadcast, "
    "add_consumer, active_queues() polls) plus the profile's 2.1 s compressed.",
    "worker-h held: every worker process alive between the replay's start and end, in "
    "simulated hours (standby ones included): what each policy pays for.",
    "The steady window ends 5 simulated minutes before the festival: jobs in flight on "
    "the worker killed at its start (prewarm_kill) fall in neither window; the last column "
    "of each lane table shows them (a job in prefill there waits for its lease to expire, "
    "~11 s).",
    "forecast / arrivals: the scheduler's forecast for each festival minute (made in that "
    "minute), summed, over the jobs submitted in them (1.00: right on average).",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run, 3 workers at most")
    ap.add_argument("--runs", default=",".join(RUNS), help="which runs, comma-separated")
    ap.add_argument("--sqlite", action="store_true", help="the store on SQLite")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    replay = QUICK if args.quick else FULL
    names = [n for n in args.runs.split(",") if n]
    began = time.monotonic()
    summaries, series = {}, {}
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"festival-{name}-") as tmp:
            log(f"{name}: logs in {tmp}/logs (removed at the end)")
            result = run_once(RUNS[name], replay, args, Path(tmp))
        summaries[name] = summarize(result, replay)
        series[name] = per_minute(result, replay)
        log(f"{name}: " + ", ".join(f"{lane} peak/steady p99 "
                                     f"{summaries[name][lane]['peak_over_steady']:.2f}"
                                     for lane in LANES))
    suffix = "-quick" if args.quick else ""
    stem = f"festival{suffix}"
    tables = "\n\n".join(run_table(n, s) for n, s in summaries.items())
    write_report(RESULTS / f"{stem}.md", "Festival night replayed on the real path",
                 tables + f"\n\n![per simulated minute]({stem}.png)",
                 setup_lines(replay, args, time.monotonic() - began), NOTES)
    plot(RESULTS / f"{stem}.png", series, replay)
    print(tables)
    figures: dict[str, Any] = {"benchmark": "festival", "quick": args.quick}
    for name, s in summaries.items():
        for lane in LANES:
            figures[f"{name}_{lane}_peak_over_steady"] = s[lane]["peak_over_steady"]
            figures[f"{name}_{lane}_steady_p99_ms"] = s[lane]["steady_p99_ms"]
            figures[f"{name}_{lane}_peak_p99_ms"] = s[lane]["peak_p99_ms"]
            figures[f"{name}_{lane}_errors"] = s[lane]["errors"]
            figures[f"{name}_{lane}_forecast_over_arrivals"] = s[lane]["forecast_over_arrivals"]
        for k in ("standby_activations", "cold_starts", "worker_hours",
                  "standby_worker_hours", "first_activation_ahead_min"):
            figures[f"{name}_{k}"] = s["fleet"][k]
    write_json(RESULTS / f"{stem}.json", {**figures, "summaries": summaries,
                                          "per_minute": series})
    print_json_last(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
