"""The queue's own cost on the real path: one API process, a private Redis, a database and
Celery workers hosting the simulated engine (workers/sim_engine.py, GPU token rates, no
model), at several numbers of concurrent streams.

Per level N (`--levels`), four phases on one running stack:

alone   N submitters POST /v1/jobs as fast as the answers come (no SSE; 1-token jobs),
        the Celery worker processes stopped (SIGSTOP, for less than a heartbeat's life):
        the API admits on its own. After a warm-up, a window counts the 202s and reads
        the API process's CPU time (/proc/<pid>/stat utime+stime).
drain   the workers go on and run those jobs: their CPU time until none is left, per job,
        the engine's thread left out (its /proc/<pid>/task/<tid>/comm is
        `tidegate-engine`, workers/host.py).
admit   the same submitters with the workers running the jobs as they come.
stream  N clients each submit a job, read its SSE stream to the end and start the next.
        Jobs submitted inside the window after a warm-up are timed; when it ends the
        clients stop and the jobs still running are cancelled (DELETE).
        queue TTFT    = the client's TTFT (submit start -> first token event received)
                        - the worker's TTFT (the job row's `ttft_ms`, also in the done
                        event: started_at, when the worker claimed it, -> first_token_at,
                        when its event was out; workers/streamer.py)
        delivery lag  = the client's receipt of an event - the worker's time.time() when
                        it wrote the event (the job stream entry's `t`, workers/publisher.py),
                        joined on the event's id after the job ended (XRANGE)
        tokens/s      = token events received in the window / the window
        worker CPU per token: the workers' CPU outside the engine thread in the window /
                        token events the workers wrote in the window (their `t`).

Everything runs on this machine and shares its cores: the client too (aiohttp, one event
loop). Same clock everywhere (time.time()).

    .venv/bin/python bench/frontdoor.py                # 64, 256, 1024, 2048 streams
    .venv/bin/python bench/frontdoor.py --quick        # a smoke run, well under a minute
    .venv/bin/python bench/frontdoor.py --levels 64,256
    .venv/bin/python bench/frontdoor.py --levels 64,256 --profile paced
    .venv/bin/python bench/frontdoor.py --levels 256 --profile paced --spread 0.5
    .venv/bin/python bench/frontdoor.py --levels 256 --profile instant --workers 1

`worker_max_tokens_per_s` = 1e6 / (worker + engine thread CPU us per token): what one
worker process (one GIL) carries at most. With `--profile instant --workers 1` the engine
takes no modelled time: one worker's own cost alone.

Writes bench/results/frontdoor.{md,png,json} (frontdoor-<profile>[-spread<percent>].* for
another sim profile or a spread); the last stdout line is the JSON summary.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/frontdoor.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.frontdoor, then exits

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from redis.crc import key_slot

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
from bench.stack import (
    MODEL,
    bench_database,
    busy_neighbours,
    exit_cleanly_on_signals,
    load_average,
    tidegate_env,
)
from tidegate import keys
from tidegate_tools.procs import Proc, RedisClusterProcs, redis_cluster
from tidegate_tools.stack import WorkerSpec, running_stack
from workers.engine import EngineError
from workers.sim_profile import load_profile

NAMESPACE = "tgbench"  # bench/stack.py's tidegate_env
PROFILE = "llama-3.1-8b-fp8-h100"
ENGINE_THREAD = "tidegate-engine"  # workers/host.py ENGINE_THREAD
LEVELS = (64, 256, 1024, 2048)
SPREAD_SEED = 20261206  # the streamed jobs' lengths with --spread
HEADLINE = 256  # the level the JSON's top-level figures come from
TEMPERATURE = 0.8
ADMIT_MAX_TOKENS = 1  # admit phase: the workers' fixed cost per job, not per token
# Admitting alone, the workers are stopped: the whole phase stays well under a worker
# heartbeat's life (11 s), or the router would see no worker.
ALONE_WARM_S = 1.0
ALONE_WINDOW_S = 6.0
START_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 240.0  # the admitted jobs, and the cancelled ones, get this long to end
# Limits raised so that the bench is never refused (tidegate/settings.py); the figures
# are what one process does, not what its caps let through.
UNCAPPED = {"TIDEGATE_MAX_IN_FLIGHT_PER_TENANT": "1000000",
            "TIDEGATE_MAX_QUEUE_DEPTH": "1000000",
            "TIDEGATE_MAX_ADMISSION_WAITING": "1000000",
            "TIDEGATE_SSE_MAX_STREAMS": "100000",
            "TIDEGATE_SSE_MAX_STREAMS_PER_TENANT": "100000"}
# Figures the JSON's top level carries beside the bars' (issue 29: what one worker carries).
HEADLINE_KEYS = ("worker_cpu_ms_per_job", "worker_cpu_us_per_token_beyond_job",
                 "worker_max_tokens_per_s", "engine_cpu_us_per_token")
# The bars (shown beside the figures, not asserted): key -> (bar, "min"/"max").
# Issue 29's: the worker's, API's and Redis's per token and per job; its latency bars are
# for the `paced` profile (64 and 256 streams).
BARS = {"admit_jobs_per_s": (500.0, "min"), "api_cpu_ms_per_job": (1.0, "max"),
        "api_cpu_us_per_token": (15.0, "max"), "worker_cpu_ms_per_job": (1.2, "max"),
        "worker_cpu_us_per_token": (30.0, "max"), "redis_cpu_us_per_token": (6.0, "max"),
        "queue_ttft_p50_ms": (10.0, "max"), "queue_ttft_p99_ms": (50.0, "max"),
        "delivery_lag_p99_ms": (20.0, "max")}
SHARD_KEYS = ("streams_shards", "shard_token_share", "shard_token_spread",
              "shard_cpu_us_per_token", "shard_cpu_us_per_fleet_token",
              "broker_redis_cpu_us_per_token")
# With --streams-cluster: per shard, and the spread of tokens over the shards.
SHARD_BARS = {"shard_cpu_us_per_token": (6.0, "max"), "shard_token_spread": (0.2, "max")}


@dataclass(frozen=True)
class Config:
    levels: tuple[int, ...]
    workers: int
    slots: int
    lane: str
    max_tokens: int
    warm_s: float  # each phase's warm-up before its window
    window_s: float  # each phase's measured window
    postgresql: bool
    profile: str = PROFILE  # the sim workers' timing (workers/sim_profiles.toml)
    # A streamed job's max_tokens is drawn from max_tokens x (1 +/- spread), seeded. With
    # none, jobs started in one engine step end in one step, and their clients submit again
    # together: the closed loop keeps them in lock-step bursts.
    spread: float = 0.0
    # The token streams on a Redis Cluster of this many masters (TIDEGATE_STREAMS_URL),
    # apart from the broker's redis-server; 0: on the broker's.
    streams_cluster: int = 0

    @property
    def name(self) -> str:
        """The results' file name: other settings' figures never overwrite the bars'."""
        name = "frontdoor" if self.profile == PROFILE else f"frontdoor-{self.profile}"
        name += f"-spread{round(self.spread * 100)}" if self.spread else ""
        return name + (f"-cluster{self.streams_cluster}" if self.streams_cluster else "")


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description="The queue's own cost on the real path, with "
                                "sim workers (bench/README.md).")
    p.add_argument("--levels", default=None,
                   help="concurrent streams, comma-separated (default 64,256,1024,2048)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: levels 16,64, 2 workers x 64 slots, short windows")
    p.add_argument("--workers", type=int, default=None, help="sim workers (default 4)")
    p.add_argument("--slots", type=int, default=None,
                   help="engine slots per worker = Celery threads (default 512)")
    p.add_argument("--lane", default="chat")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed job")
    p.add_argument("--window-s", type=float, default=None, help="measured window per phase")
    p.add_argument("--profile", default=PROFILE,
                   help=f"sim profile of workers/sim_profiles.toml (default {PROFILE})")
    p.add_argument("--spread", type=float, default=0.0,
                   help="streamed jobs' max_tokens drawn from max-tokens x (1 +/- spread), "
                        "0 <= spread < 1 (default 0: every job the same length)")
    p.add_argument("--streams-cluster", type=int, default=0, metavar="N",
                   help="the token streams on a Redis Cluster of N masters (at least 3), "
                        "apart from the broker's Redis; the JSON then has each shard's share "
                        "of the tokens and its CPU per token (default 0: one Redis)")
    p.add_argument("--sqlite", action="store_true",
                   help="the store in a SQLite file (default: a private PostgreSQL database)")
    a = p.parse_args(argv)
    if not 0 <= a.spread < 1:
        p.error(f"--spread {a.spread}: must be at least 0 and below 1")
    if a.streams_cluster and a.streams_cluster < 3:
        p.error(f"--streams-cluster {a.streams_cluster}: a Redis Cluster needs 3 masters")
    try:  # here, not minutes later in every worker's start
        load_profile(a.profile)
    except EngineError as exc:
        p.error(f"--profile: {exc}")
    quick = a.quick
    levels = a.levels or ("16,64" if quick else ",".join(map(str, LEVELS)))
    return Config(levels=tuple(int(x) for x in levels.split(",") if x.strip()),
                  workers=a.workers or (2 if quick else 4), slots=a.slots or (64 if quick else 512),
                  lane=a.lane, max_tokens=a.max_tokens, warm_s=2.0 if quick else 5.0,
                  window_s=a.window_s or (5.0 if quick else 15.0), postgresql=not a.sqlite,
                  profile=a.profile, spread=a.spread, streams_cluster=a.streams_cluster)


# ---------------------------------------------------------------- CPU from /proc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def stat_cpu_s(stat: str) -> float:
    """utime + stime of a /proc/<pid>/stat (or task stat) line, in seconds. The name
    field may hold spaces and parentheses: the fields are counted after its last ')'."""
    rest = stat.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLOCK_TICKS  # fields 14 and 15 of proc(5)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def process_cpu_s(pid: int) -> float:
    try:
        return stat_cpu_s(_read(f"/proc/{pid}/stat"))
    except (OSError, IndexError, ValueError):
        return math.nan


def threads_cpu_s(pid: int, comm: str) -> tuple[float, int]:
    """CPU seconds of the process's threads named `comm`, and how many there are."""
    total, found = 0.0, 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return math.nan, 0
    for tid in tids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            if _read(f"/proc/{pid}/task/{tid}/comm").strip() == comm:
                total += stat_cpu_s(_read(f"/proc/{pid}/task/{tid}/stat"))
                found += 1
    return total, found


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores together, from /proc/stat's first line."""
    values = [int(v) for v in _read("/proc/stat").split("\n", 1)[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass(frozen=True)
class CpuSample:
    at: float
    api_s: float
    worker_s: float  # the Celery worker processes, all threads
    engine_s: float  # their engine threads
    redis_s: float  # the broker's redis-server and the streams' shards, if any
    client_s: float  # this process: the load client
    busy: tuple[float, float]
    shards_s: tuple[float, ...] = ()  # each streams shard (master), CpuMeter.shard_ports


@dataclass(frozen=True)
class CpuDelta:
    wall_s: float
    api_s: float
    worker_s: float  # outside the engine thread
    engine_s: float
    redis_s: float
    client_s: float
    machine_busy: float  # fraction of all cores
    shards_s: tuple[float, ...] = ()

    @classmethod
    def between(cls, a: CpuSample, b: CpuSample) -> CpuDelta:
        busy = ratio(b.busy[0] - a.busy[0], b.busy[1] - a.busy[1])
        engine = b.engine_s - a.engine_s
        return cls(b.at - a.at, b.api_s - a.api_s, b.worker_s - a.worker_s - engine, engine,
                   b.redis_s - a.redis_s, b.client_s - a.client_s, busy,
                   tuple(y - x for x, y in zip(a.shards_s, b.shards_s, strict=True)))


class CpuMeter:
    """The pids a window reads: the API process, the Celery worker processes (the children
    of each `tidegate worker` supervisor, psutil), Redis, and this process."""

    def __init__(self, procs: Sequence[Proc]) -> None:
        def pids(prefix: str) -> list[int]:
            return [p.popen.pid for p in procs if p.name.startswith(prefix)]

        self.api = pids("api:")
        self.redis = pids("redis-server:")
        # A streams cluster's nodes (tidegate_tools/procs.py names them redis-cluster:PORT),
        # by port: no failover happens in the bench, so its masters stay its masters.
        self.shard_ports = sorted(int(p.name.split(":")[1]) for p in procs
                                  if p.name.startswith("redis-cluster:"))
        self.shards = [pid for port in self.shard_ports
                       for pid in pids(f"redis-cluster:{port}")]
        self.workers = [c.pid for sup in pids("worker:")
                        for c in psutil.Process(sup).children(recursive=True)]
        if not self.workers:
            raise RuntimeError("no Celery worker process under the worker supervisors")
        self.engine_threads = sum(threads_cpu_s(pid, ENGINE_THREAD)[1] for pid in self.workers)

    def sample(self) -> CpuSample:
        return CpuSample(
            at=time.time(), api_s=sum(process_cpu_s(p) for p in self.api),
            worker_s=sum(process_cpu_s(p) for p in self.workers),
            engine_s=sum(threads_cpu_s(p, ENGINE_THREAD)[0] for p in self.workers),
            redis_s=sum(process_cpu_s(p) for p in [*self.redis, *self.shards]),
            client_s=time.process_time(), busy=machine_busy(),
            shards_s=tuple(process_cpu_s(p) for p in self.shards))


# ---------------------------------------------------------------- the client


def split_frames(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE frames (separated by a blank line) and the incomplete rest."""
    *frames, rest = buffer.split(b"\n\n")
    return [f for f in frames if f], rest


def parse_frame(frame: bytes) -> tuple[int | None, str, bytes]:
    """(id, event, data) of one SSE frame; id None for a comment or an error frame."""
    seq, kind, data = None, "message", b""
    for line in frame.split(b"\n"):
        name, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if name == b"id":
            seq = int(value)
        elif name == b"event":
            kind = value.decode()
        elif name == b"data":
            data = value
    return seq, kind, data


@dataclass
class JobTrace:
    """One streamed job as the client saw it (wall clock, time.time())."""

    submit_at: float
    accepted_at: float = math.nan
    job_id: str = ""
    first_token_at: float = math.nan
    received: list[tuple[int, float]] = field(default_factory=list)  # (event id, receipt)
    token_events: list[tuple[float, int]] = field(default_factory=list)  # (receipt, tokens)
    done: dict[str, Any] | None = None
    error: str | None = None
    worker_ttft_ms: float = math.nan  # the job row's ttft_ms, read after the phase

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_at - self.submit_at) * 1000

    @property
    def queue_ttft_ms(self) -> float:
        return self.ttft_ms - self.worker_ttft_ms


class Client:
    """aiohttp with no connection cap: the client must not be what limits N streams."""

    def __init__(self, base: str, key: str, lane: str) -> None:
        self.base, self.lane = base, lane
        self.headers = {"Authorization": f"Bearer {key}"}
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120))
        self.counter = 0

    async def close(self) -> None:
        await self.http.close()

    def body(self, max_tokens: int) -> dict[str, Any]:
        self.counter += 1
        return {"lane": self.lane, "prompt": f"Request {self.counter}: summarise order "
                f"{10_000 + self.counter} for the customer in one short line.",
                "max_tokens": max_tokens, "temperature": TEMPERATURE}

    async def submit(self, max_tokens: int) -> tuple[int, str]:
        async with self.http.post(f"{self.base}/v1/jobs", json=self.body(max_tokens),
                                  headers=self.headers) as resp:
            answer = await resp.read()
            job_id = json.loads(answer).get("job_id", "") if resp.status == 202 else ""
            return resp.status, job_id or answer[:200].decode(errors="replace")

    async def stream_job(self, trace: JobTrace, max_tokens: int) -> None:
        """Submits a job and reads its events into `trace` (kept if this is cancelled)."""
        status, job_id = await self.submit(max_tokens)
        trace.accepted_at = time.time()
        if status != 202:
            trace.error = f"HTTP {status}: {job_id}"
            return
        trace.job_id = job_id
        async with self.http.get(f"{self.base}/v1/jobs/{job_id}/events",
                                 headers=self.headers) as resp:
            if resp.status != 200:
                trace.error = f"SSE HTTP {resp.status}"
                return
            buffer = b""
            async for chunk in resp.content.iter_any():
                now = time.time()  # every frame in this chunk arrived now
                frames, buffer = split_frames(buffer + chunk)
                for frame in frames:
                    if self._on_frame(trace, frame, now):
                        return
        trace.error = trace.error or "stream ended without a done event"

    async def cancel(self, job_ids: Sequence[str], at_once: int = 32) -> None:
        """DELETE each job, `at_once` at a time: the phase's jobs still running."""
        gate = asyncio.Semaphore(at_once)

        async def one(job_id: str) -> None:
            async with gate:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.http.delete(f"{self.base}/v1/jobs/{job_id}",
                                                headers=self.headers) as resp:
                        await resp.read()

        await asyncio.gather(*(one(j) for j in job_ids))

    @staticmethod
    def _on_frame(trace: JobTrace, frame: bytes, now: float) -> bool:
        """Records one frame; True once the job's stream is over."""
        seq, kind, data = parse_frame(frame)
        if seq is None:
            if kind == "error":
                trace.error = f"error frame: {data[:200]!r}"
                return True
            return False  # a keep-alive
        trace.received.append((seq, now))
        if kind == "token":
            if math.isnan(trace.first_token_at):
                trace.first_token_at = now
            trace.token_events.append((now, len(json.loads(data)["token_ids"])))
        elif kind in ("done", "error"):
            trace.done = json.loads(data)["data"]  # the event's JSON; its data holds ttft_ms
            if kind == "error":
                trace.error = f"error event: {data[:200]!r}"
            return True
        return False


# ---------------------------------------------------------------- phases


@dataclass
class Window:
    start: float
    end: float
    cpu: CpuDelta | None = None

    def holds(self, t: float) -> bool:
        return self.start <= t < self.end

    @property
    def seconds(self) -> float:
        return self.end - self.start


async def metered(window: Window, meter: CpuMeter) -> None:
    """Reads the CPU counters at the window's edges."""
    await asyncio.sleep(max(0.0, window.start - time.time()))
    first = meter.sample()
    await asyncio.sleep(max(0.0, window.end - time.time()))
    window.cpu = CpuDelta.between(first, meter.sample())


@dataclass
class AdmitResult:
    window: Window
    accepted_at: list[float] = field(default_factory=list)  # 202 times
    job_ids: list[str] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)  # status or exception -> count


async def admit_phase(client: Client, meter: CpuMeter, n: int, cfg: Config) -> AdmitResult:
    """N submitters in a closed loop until the window ends: 202s/s and CPU per job."""
    t0 = time.time()
    result = AdmitResult(Window(t0 + cfg.warm_s, t0 + cfg.warm_s + cfg.window_s))

    async def submitter() -> None:
        while time.time() < result.window.end:
            try:
                status, job_id = await client.submit(ADMIT_MAX_TOKENS)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, job_id = -1, type(exc).__name__
            if status == 202:
                result.accepted_at.append(time.time())
                result.job_ids.append(job_id)
            else:
                what = str(status) if status > 0 else job_id
                result.refused[what] = result.refused.get(what, 0) + 1
                await asyncio.sleep(0.05)

    await asyncio.gather(metered(result.window, meter), *(submitter() for _ in range(n)))
    return result


@contextmanager
def workers_paused(meter: CpuMeter) -> Iterator[None]:
    """The Celery worker processes stopped (SIGSTOP) and continued on exit: while they
    are stopped the API admits alone, and the jobs wait in their queue. Kept shorter
    than a heartbeat's life (keys.heartbeat_ttl_s: 11 s at the default 2 s period), or
    the API's router would see no worker and answer 503."""
    for pid in meter.workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in meter.workers:
            os.kill(pid, signal.SIGCONT)


async def admit_alone_phase(client: Client, meter: CpuMeter, n: int,
                            cfg: Config) -> AdmitResult:
    """The admit phase with the workers stopped: the API's own rate and CPU per job, the
    machine's 2 cores not shared with the workers running the jobs."""
    alone = replace(cfg, warm_s=ALONE_WARM_S, window_s=min(cfg.window_s, ALONE_WINDOW_S))
    with workers_paused(meter):
        return await admit_phase(client, meter, n, alone)


@dataclass
class DrainResult:
    jobs: int  # the admit-alone phase's jobs, all waiting when the workers went on
    cpu: CpuDelta  # from the workers' restart until no job was left in flight


def drain(bench: Bench, meter: CpuMeter, jobs: int) -> DrainResult:
    """The workers run the jobs the API admitted alone: their CPU per job, on their own."""
    first = meter.sample()
    left = wait_idle(bench)
    if left:
        log(f"{left} jobs of the admit-alone phase still in flight after the drain")
    return DrainResult(jobs - left, CpuDelta.between(first, meter.sample()))


@dataclass
class StreamResult:
    window: Window
    traces: list[JobTrace] = field(default_factory=list)
    unfinished: int = 0  # jobs still running when the window ended: cancelled


async def stream_phase(client: Client, meter: CpuMeter, n: int, cfg: Config) -> StreamResult:
    """N clients, each submit -> SSE to the end -> next, starts spread over the warm-up.
    When the window ends the clients stop and the jobs still running are cancelled: at
    high N a job takes minutes on 2 cores, and what is timed (TTFT, the events' lag, the
    tokens received) happened inside the window."""
    t0 = time.time()
    result = StreamResult(Window(t0 + cfg.warm_s, t0 + cfg.warm_s + cfg.window_s))
    ramp_s = min(1.0, cfg.warm_s / 2)

    lengths = random.Random(SPREAD_SEED + n)

    async def streamer(i: int) -> None:
        await asyncio.sleep(ramp_s * i / n)
        while time.time() < result.window.end:
            trace = JobTrace(submit_at=time.time())
            result.traces.append(trace)
            spread = cfg.spread * (2 * lengths.random() - 1)
            try:
                await client.stream_job(trace, max(1, round(cfg.max_tokens * (1 + spread))))
            except (aiohttp.ClientError, TimeoutError) as exc:
                trace.error = type(exc).__name__

    tasks = [asyncio.create_task(streamer(i)) for i in range(n)]
    await metered(result.window, meter)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    running = [t.job_id for t in result.traces if t.job_id and t.done is None and not t.error]
    result.unfinished = len(running)
    await client.cancel(running)
    return result


def read_worker_ttfts(db_url: str, traces: Sequence[JobTrace]) -> None:
    """Each job's ttft_ms from its row (set at its first token, so a job cancelled after
    it has one too)."""
    from store import Store

    store = Store(db_url)
    try:
        for trace in traces:
            job = store.jobs.get_job(trace.job_id) if trace.job_id else None
            if job is not None and job.ttft_ms is not None:
                trace.worker_ttft_ms = job.ttft_ms
    finally:
        store.engine.dispose()


# ---------------------------------------------------------------- figures


def published_times(redis_url: str, job_ids: Sequence[str]) -> dict[str, dict[int, tuple[str,
                                                                                          float]]]:
    """job id -> {seq: (kind, the worker's write time)}, read after the jobs ended."""
    from tidegate import redisconn

    r = redisconn.sync_streams_client(redis_url)
    out: dict[str, dict[int, tuple[str, float]]] = {}
    for start in range(0, len(job_ids), 200):
        batch = job_ids[start:start + 200]
        pipe = r.pipeline(transaction=False)
        for job_id in batch:
            pipe.xrange(keys.job_events(NAMESPACE, job_id))
        for job_id, entries in zip(batch, pipe.execute(), strict=True):
            out[job_id] = {keys.seq_of(eid): (f.get(b"k", b"").decode(), float(f[b"t"]))
                           for eid, f in entries if b"t" in f}
    r.close()
    return out


def delivery_lags_ms(received: Sequence[tuple[int, float]],
                     published: Mapping[int, tuple[str, float]]) -> list[float]:
    """Receipt - write time of each event the client got whose write time is known."""
    return [(at - published[seq][1]) * 1000 for seq, at in received if seq in published]


def p50_p99(values: Sequence[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 99)


def admit_figures(a: AdmitResult, finished_at: Sequence[float]) -> dict[str, Any]:
    """`finished_at`: the admitted jobs' done-event write times (the workers' share)."""
    w = a.window
    cpu = w.cpu
    assert cpu is not None
    admitted = sum(1 for t in a.accepted_at if w.holds(t))
    ended = sum(1 for t in finished_at if w.holds(t))
    return {"admit_jobs_per_s_with_workers": admitted / w.seconds,
            "admitted_in_window": admitted,
            "api_cpu_ms_per_job_with_workers": ratio(cpu.api_s * 1000, admitted),
            "api_cpu_share_admit": cpu.api_s / w.seconds,
            "worker_cpu_ms_per_job_with_api": ratio(cpu.worker_s * 1000, ended),
            "jobs_ended_in_admit_window": ended,
            "admit_refused": dict(a.refused), "admit_machine_busy": cpu.machine_busy,
            "client_cpu_share_admit": cpu.client_s / w.seconds}


def alone_figures(a: AdmitResult, d: DrainResult) -> dict[str, Any]:
    """The API admitting with the workers stopped, then the workers draining its jobs."""
    w = a.window
    assert w.cpu is not None
    admitted = sum(1 for t in a.accepted_at if w.holds(t))
    return {"admit_jobs_per_s": admitted / w.seconds, "admitted_alone_in_window": admitted,
            "api_cpu_ms_per_job": ratio(w.cpu.api_s * 1000, admitted),
            "api_cpu_share_alone": w.cpu.api_s / w.seconds,
            "client_cpu_share_alone": w.cpu.client_s / w.seconds,
            "alone_machine_busy": w.cpu.machine_busy, "alone_refused": dict(a.refused),
            "worker_cpu_ms_per_job": ratio(d.cpu.worker_s * 1000, d.jobs),
            "drained_jobs": d.jobs, "drain_s": d.cpu.wall_s,
            "drain_jobs_per_s": ratio(d.jobs, d.cpu.wall_s)}


def beyond_job_us(f: Mapping[str, Any]) -> float:
    """The workers' CPU per token in the stream window less each job's fixed cost (a
    1-token job's, from the drain), counted once for each job submitted in the window:
    an estimate of what a token itself costs a worker."""
    tokens = f["worker_tokens_in_window"]
    fixed_ms = f["worker_cpu_ms_per_job"] * f["jobs_timed"]
    if not tokens or not math.isfinite(fixed_ms):
        return math.nan
    return (f["worker_cpu_s_stream"] * 1000 - fixed_ms) * 1000 / tokens


def stream_figures(s: StreamResult, published: Mapping[str, Mapping[int, tuple[str, float]]],
                   shard_of: Callable[[str], int] | None = None) -> dict[str, Any]:
    w = s.window
    cpu = w.cpu
    assert cpu is not None
    timed = [t for t in s.traces if w.holds(t.submit_at)]
    ok = [t for t in timed if t.error is None and math.isfinite(t.first_token_at)]
    q50, q99 = p50_p99([t.queue_ttft_ms for t in ok if math.isfinite(t.queue_ttft_ms)])
    c50, c99 = p50_p99([t.ttft_ms for t in ok])
    e50, e99 = p50_p99([t.worker_ttft_ms for t in ok if math.isfinite(t.worker_ttft_ms)])
    lags = [lag for t in s.traces if t.error is None
            for lag in delivery_lags_ms([(q, at) for q, at in t.received if w.holds(at)],
                                        published.get(t.job_id, {}))]
    l50, l99 = p50_p99(lags)
    s50, s99 = p50_p99([(t.accepted_at - t.submit_at) * 1000 for t in timed
                        if math.isfinite(t.accepted_at)])
    received = sum(n for t in s.traces for at, n in t.token_events if w.holds(at))
    # The workers' token events written in the window, in tokens: the stream entry does
    # not say how many tokens an event holds (the sim's hold one); the client's mean does.
    events_in = [n for t in s.traces for _, n in t.token_events]
    per_event = sum(events_in) / len(events_in) if events_in else 1.0
    written = per_event * sum(1 for events in published.values()
                              for kind, at in events.values() if kind == "token" and w.holds(at))
    return {
        "queue_ttft_p50_ms": q50, "queue_ttft_p99_ms": q99,
        "client_ttft_p50_ms": c50, "client_ttft_p99_ms": c99,
        "worker_ttft_p50_ms": e50, "worker_ttft_p99_ms": e99,
        "submit_p50_ms": s50, "submit_p99_ms": s99,
        "delivery_lag_p50_ms": l50, "delivery_lag_p99_ms": l99,
        "tokens_per_s": received / w.seconds,
        "worker_cpu_us_per_token": ratio(cpu.worker_s * 1e6, written),
        "worker_cpu_s_stream": cpu.worker_s, "worker_tokens_in_window": written,
        "engine_cpu_us_per_token": ratio(cpu.engine_s * 1e6, written),
        # What one worker process can carry, its engine client's thread included: one
        # process, one GIL (DESIGN.md "Scale").
        "worker_max_tokens_per_s": ratio(1e6, ratio(cpu.worker_s * 1e6, written)
                                         + ratio(cpu.engine_s * 1e6, written)),
        "api_cpu_us_per_token": ratio(cpu.api_s * 1e6, received),
        "redis_cpu_us_per_token": ratio(cpu.redis_s * 1e6, written),
        "api_cpu_share_stream": cpu.api_s / w.seconds,
        "worker_cpu_share_stream": cpu.worker_s / w.seconds,
        "engine_cpu_share_stream": cpu.engine_s / w.seconds,
        "redis_cpu_share_stream": cpu.redis_s / w.seconds,
        "client_cpu_share_stream": cpu.client_s / w.seconds,
        "stream_machine_busy": cpu.machine_busy,
        "jobs_timed": len(timed), "jobs_with_first_token": len(ok),
        "stream_errors": sum(1 for t in timed if t.error is not None),
        "jobs_done": sum(1 for t in s.traces if t.done is not None and t.error is None),
        "stream_cancelled_at_end": s.unfinished, "lag_samples": len(lags),
        "error_examples": sorted({t.error for t in s.traces if t.error})[:3],
        **(shard_figures(cpu, per_event, published, w, shard_of) if shard_of else {}),
    }


def shard_figures(cpu: CpuDelta, per_event: float,
                  published: Mapping[str, Mapping[int, tuple[str, float]]], w: Window,
                  shard_of: Callable[[str], int]) -> dict[str, Any]:
    """With the streams on a cluster: each shard's share of the tokens written in the
    window (by its jobs' hash tags), how far the most uneven is from an even share, and
    each shard's CPU over its own tokens and over all of them."""
    tokens = [0.0] * len(cpu.shards_s)
    for job_id, events in published.items():
        n = sum(1 for kind, at in events.values() if kind == "token" and w.holds(at))
        tokens[shard_of(job_id)] += n * per_event
    total = sum(tokens)
    shares = [ratio(t, total) for t in tokens]
    even = 1 / len(tokens) if tokens else math.nan
    return {
        "streams_shards": len(tokens),
        "shard_token_share": shares,
        "shard_token_spread": max((abs(x - even) / even for x in shares), default=math.nan),
        "shard_cpu_us_per_token": [ratio(c * 1e6, t) for c, t in zip(cpu.shards_s, tokens,
                                                                   strict=True)],
        "shard_cpu_us_per_fleet_token": [ratio(c * 1e6, total) for c in cpu.shards_s],
        "broker_redis_cpu_us_per_token": ratio((cpu.redis_s - sum(cpu.shards_s)) * 1e6, total),
    }


# ---------------------------------------------------------------- the stack


@dataclass
class Bench:
    base: str
    key: str
    redis_url: str
    procs: list[Proc]
    db_url: str
    tenant_id: int
    streams_url: str = ""  # the streams' Redis when apart from the broker's
    shard_of: Callable[[str], int] | None = None  # a job's streams shard (index), if a cluster


@contextmanager
def frontdoor_stack(tmp: Path, cfg: Config) -> Iterator[Bench]:
    """Private Redis and database, `cfg.workers` sim workers, the API, and with
    `cfg.streams_cluster` a Redis Cluster for the streams; all stopped on exit."""
    from store import Store, upgrade

    specs = [WorkerSpec(cfg.lane, f"sim{i}@frontdoor", pool="vllm", engine="sim")
             for i in range(cfg.workers)]
    with bench_database(tmp, cfg.postgresql) as db_url, ExitStack() as cleanup:
        upgrade(db_url)
        store = Store(db_url)
        tenant, key = store.tenants.create_tenant("frontdoor", [cfg.lane])
        store.engine.dispose()
        env = {**tidegate_env(db_url, cfg.slots), **UNCAPPED, "TIDEGATE_SIM_PROFILE": cfg.profile}
        cluster = None
        if cfg.streams_cluster:
            cluster = cleanup.enter_context(redis_cluster(tmp / "logs" / "streams-cluster",
                                                          masters=cfg.streams_cluster))
            env["TIDEGATE_STREAMS_URL"] = cluster.url
        with running_stack(env, specs, tmp / "logs", private_redis=True,
                           timeout_s=START_TIMEOUT_S) as stack:
            assert stack.redis_url is not None
            bench = Bench(stack.base_url, key, stack.redis_url, stack.procs, db_url, tenant.id,
                          streams_url=stack.redis_url)
            if cluster is not None:
                bench.procs = [*stack.procs, *cluster.procs.values()]
                bench.streams_url, bench.shard_of = cluster.url, shard_index(cluster)
            yield bench


def shard_index(cluster: RedisClusterProcs) -> Callable[[str], int]:
    """A job's shard: the index, in port order, of the master serving its keys' slot."""
    ports = sorted(cluster.masters_now())
    by_slot = {slot: ports.index(cluster.master_of_slot(slot))
               for slot in {key_slot(f"{{{tag}}}".encode()) for tag in keys.JOB_TAGS}}
    return lambda job_id: by_slot[key_slot(keys.job_events(NAMESPACE, job_id).encode())]


def wait_idle(bench: Bench, timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    """Waits until the tenant has no job queued or running; returns how many are left."""
    from store import Store

    store = Store(bench.db_url)
    try:
        end = time.monotonic() + timeout_s
        while (left := store.jobs.count_in_flight(bench.tenant_id)) and time.monotonic() < end:
            time.sleep(0.5)
        return left
    finally:
        store.engine.dispose()


async def run_phases(bench: Bench, meter: CpuMeter, n: int,
                     cfg: Config) -> tuple[AdmitResult, DrainResult, AdmitResult, StreamResult]:
    client = Client(bench.base, bench.key, cfg.lane)
    try:
        alone = await admit_alone_phase(client, meter, n, cfg)
        log(f"N={n}: admit alone: {sum(map(alone.window.holds, alone.accepted_at))} 202s in "
            f"the window, refused {alone.refused or 'none'}; the workers drain them")
        drained = await asyncio.to_thread(drain, bench, meter, len(alone.accepted_at))
        admit = await admit_phase(client, meter, n, cfg)
        log(f"N={n}: admit window: {sum(map(admit.window.holds, admit.accepted_at))} "
            f"202s, refused {admit.refused or 'none'}; draining")
        left = await asyncio.to_thread(wait_idle, bench)
        if left:
            log(f"N={n}: {left} admitted jobs still in flight after {DRAIN_TIMEOUT_S:.0f} s")
        streams = await stream_phase(client, meter, n, cfg)
        return alone, drained, admit, streams
    finally:
        await client.close()


def measure_level(bench: Bench, meter: CpuMeter, n: int, cfg: Config) -> dict[str, Any]:
    neighbours_before = busy_neighbours()
    load = load_average()
    alone, drained, admit, streams = asyncio.run(run_phases(bench, meter, n, cfg))
    left = wait_idle(bench)
    done_t = published_times(bench.streams_url, admit.job_ids)
    finished = [at for events in done_t.values() for kind, at in events.values()
                if kind == "done"]
    published = published_times(bench.streams_url,
                                [t.job_id for t in streams.traces if t.job_id])
    timed = [t for t in streams.traces if streams.window.holds(t.submit_at)]
    read_worker_ttfts(bench.db_url, timed)
    figures = {"concurrency": n, "load_before": load, **alone_figures(alone, drained),
               **admit_figures(admit, finished),
               **stream_figures(streams, published, bench.shard_of),
               "left_in_flight": left}
    figures["worker_cpu_us_per_token_beyond_job"] = beyond_job_us(figures)
    figures["neighbours"] = "; ".join(sorted(set(neighbours_before) | set(busy_neighbours())))
    log(f"N={n}: admit {fmt(figures['admit_jobs_per_s'])} jobs/s, API "
        f"{fmt(figures['api_cpu_ms_per_job'], 2)} ms/job; queue TTFT p50/p99 "
        f"{fmt(figures['queue_ttft_p50_ms'])}/{fmt(figures['queue_ttft_p99_ms'])} ms; lag p99 "
        f"{fmt(figures['delivery_lag_p99_ms'])} ms; {fmt(figures['tokens_per_s'], 0)} tokens/s; "
        f"worker {fmt(figures['worker_cpu_us_per_token'])} us/token; "
        f"{figures['stream_errors']} errors of {figures['jobs_timed']}")
    return figures


# ---------------------------------------------------------------- report


Row = tuple[str, str | tuple[str, ...], int]  # label, figure key(s), digits
ROWS: list[Row] = [
    ("admitted jobs/s (202s), workers stopped", "admit_jobs_per_s", 0),
    ("API CPU per admitted job (ms), workers stopped", "api_cpu_ms_per_job", 2),
    ("worker CPU per 1-token job, outside engine (ms), draining them",
     "worker_cpu_ms_per_job", 2),
    ("drain: jobs/s by the workers alone", "drain_jobs_per_s", 0),
    ("admitted jobs/s (202s) / API CPU per job (ms), workers running",
     ("admit_jobs_per_s_with_workers", "api_cpu_ms_per_job_with_workers"), 2),
    ("worker CPU per token, outside engine (us)", "worker_cpu_us_per_token", 1),
    ("  of which beyond each job's fixed cost (us, estimate)",
     "worker_cpu_us_per_token_beyond_job", 1),
    ("engine thread CPU per token (us)", "engine_cpu_us_per_token", 1),
    ("one worker's ceiling, 1e6 / (worker + engine us per token) (tokens/s)",
     "worker_max_tokens_per_s", 0),
    ("API CPU per delivered token (us)", "api_cpu_us_per_token", 1),
    ("Redis CPU per token (us)", "redis_cpu_us_per_token", 1),
    ("queue TTFT p50 (ms)", "queue_ttft_p50_ms", 1),
    ("queue TTFT p99 (ms)", "queue_ttft_p99_ms", 1),
    ("client TTFT p50 / p99 (ms)", ("client_ttft_p50_ms", "client_ttft_p99_ms"), 1),
    ("worker TTFT p50 / p99 (ms)", ("worker_ttft_p50_ms", "worker_ttft_p99_ms"), 1),
    ("submit, POST to 202, p50 / p99 (ms)", ("submit_p50_ms", "submit_p99_ms"), 1),
    ("delivery lag p50 (ms)", "delivery_lag_p50_ms", 1),
    ("delivery lag p99 (ms)", "delivery_lag_p99_ms", 1),
    ("tokens/s delivered", "tokens_per_s", 0),
    ("CPU share in stream window: API / workers / engine / Redis / client",
         ("api_cpu_share_stream", "worker_cpu_share_stream", "engine_cpu_share_stream",
          "redis_cpu_share_stream", "client_cpu_share_stream"), 2),
    ("machine busy (admit / stream)", ("admit_machine_busy", "stream_machine_busy"), 2),
    ("jobs submitted in window / with a first token / errors",
     ("jobs_timed", "jobs_with_first_token", "stream_errors"), 0),
    ("jobs done in the phase / cancelled at its end",
     ("jobs_done", "stream_cancelled_at_end"), 0)]


SHARD_ROWS: list[tuple[str, str, int]] = [
    ("each streams shard's share of the tokens", "shard_token_share", 3),
    ("each shard's CPU per token it carried (us)", "shard_cpu_us_per_token", 1),
    ("each shard's CPU per token of all (us)", "shard_cpu_us_per_fleet_token", 1)]


def bar_text(key: str) -> str:
    if key not in BARS | SHARD_BARS:
        return ""
    bar, kind = (BARS | SHARD_BARS)[key]
    return f"{'>=' if kind == 'min' else '<='} {bar:g}"


def meets(key: str, value: float) -> str:
    if key not in BARS | SHARD_BARS or not math.isfinite(value):
        return ""
    bar, kind = (BARS | SHARD_BARS)[key]
    return " (ok)" if (value >= bar if kind == "min" else value <= bar) else " (over)"


def level_table(f: Mapping[str, Any]) -> str:
    rows = []
    for label, key, digits in ROWS:
        if isinstance(key, str):
            value = float(f[key])
            rows.append([label, fmt(value, digits) + meets(key, value), bar_text(key)])
        else:
            rows.append([label, " / ".join(fmt(float(f[k]), digits) for k in key), ""])
    if "streams_shards" in f:  # the streams on a cluster (--streams-cluster)
        for label, key, digits in SHARD_ROWS:
            rows.append([label, " / ".join(fmt(float(v), digits) for v in f[key]),
                         "" if key != "shard_cpu_us_per_token" else bar_text(key)])
        spread = float(f["shard_token_spread"])
        rows.append(["most uneven shard's share, off an even share",
                     f"{fmt(spread * 100, 0)}%{meets('shard_token_spread', spread)}",
                     "<= 20%"])
    return markdown_table(["figure", "measured", "bar (issues 11, 29)"], rows)


def plot(path: Path, by_level: Mapping[int, Mapping[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here; set before pyplot is imported
    import matplotlib.pyplot as plt

    panels = [("admitted jobs/s", ["admit_jobs_per_s", "admit_jobs_per_s_with_workers"],
               "admit_jobs_per_s"),
              ("API CPU per job (ms)", ["api_cpu_ms_per_job", "api_cpu_ms_per_job_with_workers"],
               "api_cpu_ms_per_job"),
              ("worker CPU per token, outside engine (us)", ["worker_cpu_us_per_token"],
               "worker_cpu_us_per_token"),
              ("queue TTFT (ms)", ["queue_ttft_p50_ms", "queue_ttft_p99_ms"], "queue_ttft_p99_ms"),
              ("delivery lag (ms)", ["delivery_lag_p50_ms", "delivery_lag_p99_ms"],
               "delivery_lag_p99_ms"),
              ("tokens/s delivered", ["tokens_per_s"], None)]
    levels = sorted(by_level)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (title, series, bar_key) in zip(axes.flat, panels, strict=True):
        for key in series:
            points = [(n, float(by_level[n][key])) for n in levels]
            points = [(n, v) for n, v in points if math.isfinite(v)]  # a missing figure: no dot
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o",
                    label=_series_label(key) if len(series) > 1 else None)
        if bar_key in BARS:
            ax.axhline(BARS[bar_key][0], color="grey", ls="--", lw=1, label="bar (issue 11)")
        ax.set(xscale="log", title=title, xlabel="concurrent streams",
               xlim=(levels[0] / 1.5, levels[-1] * 1.5))
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("tidegate front door: one API process, sim workers (2 cores, client included)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Issue 29's figures when it was filed (frontdoor at 256 streams, the H100 profile), for the
# ceilings plot's "before": constants of the text, not another run's output.
FILED_CEILINGS = {"worker": 1e6 / (79 + 24), "API": 1e6 / 56, "Redis": 1e6 / 21}
GPU_TOKENS_PER_S = (20_000, 30_000)  # a 7-8B FP8 model on one H100-class GPU (issue 29)


def ceilings(f: Mapping[str, Any]) -> dict[str, float]:
    """What one process of each kind carries, 1e6 / its CPU per token: the worker with its
    engine client's thread; Redis, with the streams on a cluster, as the fleet's tokens/s
    at which its busiest shard is full."""
    redis_us = max(f["shard_cpu_us_per_fleet_token"]) if "streams_shards" in f else \
        f["redis_cpu_us_per_token"]
    return {"worker": float(f["worker_max_tokens_per_s"]),
            "API": ratio(1e6, f["api_cpu_us_per_token"]), "Redis": ratio(1e6, redis_us)}


def plot_ceilings(path: Path, f: Mapping[str, Any]) -> None:
    """Each process's tokens/s ceiling at the headline level against the issue's filing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    now = ceilings(f)
    names = list(FILED_CEILINGS)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [FILED_CEILINGS[n] for n in names], 0.4,
           label="when issue 29 was filed")
    ax.bar([x + 0.2 for x in xs], [now[n] for n in names], 0.4, label="this run")
    ax.axhspan(*GPU_TOKENS_PER_S, color="grey", alpha=0.2, label="one H100, 7-8B FP8")
    ax.set_xticks(list(xs), [f"one {n} process" if n != "Redis" else "Redis" for n in names])
    ax.set(ylabel="tokens/s one process carries (1e6 / CPU us per token)",
           title=f"ceilings at {f['concurrency']} streams (2 cores, client included)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series_label(key: str) -> str:
    if key.endswith("_with_workers"):
        return "workers running"
    if key.startswith(("admit_", "api_cpu_")):
        return "workers stopped"
    return key.removesuffix("_ms").rsplit("_", 1)[-1]  # p50, p99


def _lengths(cfg: Config) -> str:
    if not cfg.spread:
        return f"{cfg.max_tokens} (every job the same: lock-step resubmits, see the notes)"
    low, high = (max(1, round(cfg.max_tokens * (1 + d * cfg.spread))) for d in (-1, 1))
    return f"{low}-{high}, uniform (seed {SPREAD_SEED} + the level)"


def setup_lines(cfg: Config, bench_wall_s: float) -> dict[str, Any]:
    host = machine()
    streams = (f"a Redis Cluster of {cfg.streams_cluster} masters (TIDEGATE_STREAMS_URL)"
               if cfg.streams_cluster else "the broker's redis-server")
    return {"path": "client -> one `tidegate api` -> private redis-server -> Celery sim "
                    "workers -> Redis stream -> SSE",
            "token streams on": streams,
            "store": "private PostgreSQL database (127.0.0.1:5432)" if cfg.postgresql
                     else "private SQLite file (WAL)",
            "workers": f"{cfg.workers} x `tidegate worker --engine sim --pool vllm`, lane "
                       f"`{cfg.lane}`, {cfg.slots} engine slots (= Celery threads) each",
            "sim profile": cfg.profile,
            "levels (concurrent streams)": ", ".join(map(str, cfg.levels)),
            "streamed job": f"short prompt, max_tokens {_lengths(cfg)}, temperature "
                            f"{TEMPERATURE} (the sim runs every job to max_tokens)",
            "admit-phase job": f"max_tokens {ADMIT_MAX_TOKENS}",
            "warm-up / window per phase (s)": f"{cfg.warm_s:g} / {cfg.window_s:g} (admit "
                                              f"with the workers stopped: {ALONE_WARM_S:g} / "
                                              f"{min(cfg.window_s, ALONE_WINDOW_S):g})",
            "limits raised": ", ".join(f"{k}={v}" for k, v in UNCAPPED.items()),
            "client": "aiohttp, one asyncio loop in the bench process, no connection cap",
            "machine cores": host["cores"], "cpu": host["cpu"], "python": host["python"],
            "date": host["date"], "wall time of the whole benchmark (s)": round(bench_wall_s, 1)}


NOTES = [
    "queue TTFT = client TTFT (submit start -> first token event received) - the worker's "
    "TTFT from the job row (`ttft_ms`, as in the done event: started_at, set when the worker "
    "claims the job, -> first_token_at, when the worker's streamer had written the first "
    "token's event to Redis). The worker's TTFT therefore includes, besides the engine's "
    "queue and prefill, the worker's own claim write, the `started` event and the first "
    "token's write; the queue TTFT holds the submit (HTTP, admission thread, store, broker), "
    "the broker delivery to a task thread and the token's way from Redis to the client.",
    "Stream phase: jobs submitted in the window are timed to their first token; the "
    "clients stop when the window ends and the jobs still running are cancelled, since at "
    "high N a job takes minutes on 2 cores. Delivery lag and tokens/s count the events "
    "received inside the window.",
    "Lengths (`--spread`): with every streamed job the same length, the jobs an engine step "
    "started end in one step, and their clients submit again together: the closed loop "
    "keeps them in bursts, each admitted one after the other, and a job's queue TTFT "
    "holds its wait behind its burst. `--spread` draws each job's length around "
    "max_tokens, which breaks the bursts up as they form, as varied traffic does.",
    "delivery lag = the client's receipt - the worker's time.time() when it sent the event's "
    "append (the stream entry's `t`), joined on the event id; it covers the append round "
    "trip, the API's XREAD wake-up, SSE framing and the client's own event loop.",
    "worker CPU outside engine: utime+stime of the Celery worker processes (children of "
    "each `tidegate worker` supervisor) minus their `tidegate-engine` threads (the sim "
    "engine's asyncio loop, which also hands each delta to the worker's streamer: an append "
    "to a list under a lock; and the threads it started, which inherit its OS name: its "
    "executor's, the tokenizer's). The streamer's thread (`tidegate-writer`), which writes "
    "every job's events to Redis, counts as the worker's. Per token: divided by the token "
    "events the workers wrote in the window, times the tokens per event the clients saw.",
    "Admit phases: N submitters, no SSE, 1-token jobs. First with the worker processes "
    "stopped (SIGSTOP, for less than a heartbeat's life, so the router still sees them): "
    "the API admits on the real path (HTTP, admission, the job row, the broker publish, "
    "the traffic counters), and only the client, Redis and the database share the cores "
    "with it; `admitted jobs/s` and `API CPU per admitted job` are this phase's. The "
    "workers then run those jobs with nothing else to do: `worker CPU per 1-token job` is "
    "their CPU from their restart until no job is left, per job. Then again with the "
    "workers running the jobs as they come (`workers running`): on 2 cores the workers' "
    "share of each job then caps what the API can admit.",
    "worker CPU per token beyond each job's fixed cost: the workers' CPU in the stream "
    "window less, for each job submitted in the window, the CPU of a 1-token job (the "
    "drain's figure), over the tokens written in the window. An estimate: a job's fixed "
    "cost is paid at its start and its end, which may fall outside the window.",
    "The load client runs on the same 2 cores as everything it measures (its CPU share is in "
    "the table): figures are lower bounds of what the stack does on a machine of its own.",
]


def report(cfg: Config, by_level: dict[int, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    tables = [f"## {n} concurrent streams\n\n{level_table(by_level[n])}" for n in sorted(by_level)]
    notes = list(NOTES)
    notes += [f"WARNING: at {n} streams, other test suites or benchmarks ran: {f['neighbours']}"
              for n, f in by_level.items() if f.get("neighbours")]
    notes += [f"At {n} streams, errors: {f['error_examples']}; refused submits: "
              f"{f['admit_refused']}" for n, f in by_level.items()
              if f["stream_errors"] or f["admit_refused"]]
    setup = setup_lines(cfg, wall_s)
    write_report(RESULTS / f"{cfg.name}.md", "Front door: the queue's own cost (sim workers)",
                 "\n\n".join(tables), setup, notes)
    plot(RESULTS / f"{cfg.name}.png", by_level)
    head = by_level.get(HEADLINE) or by_level[min(by_level, key=lambda n: abs(n - HEADLINE))]
    plot_ceilings(RESULTS / f"{cfg.name}-ceilings.png", head)
    out = {"benchmark": "frontdoor", "headline_concurrency": head["concurrency"],
           **{key: head[key] for key in BARS},
           **{key: head[key] for key in HEADLINE_KEYS},
           **{key: head[key] for key in SHARD_KEYS if key in head},
           "max_tokens_per_s": ceilings(head),
           "bars": {k: list(v) for k, v in BARS.items()},
           "by_concurrency": {str(n): f for n, f in sorted(by_level.items())},
           "setup": setup, "wall_s": round(wall_s, 1)}
    write_json(RESULTS / f"{cfg.name}.json", out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    exit_cleanly_on_signals()
    started = time.monotonic()
    from tidegate_tools.testmodel import build_test_model

    build_test_model(MODEL)  # the API's tokenizer and the sim engine's vocabulary
    tmp = Path(tempfile.mkdtemp(prefix="tidegate-frontdoor-"))
    log(f"logs under {tmp / 'logs'}; levels {cfg.levels}")
    by_level: dict[int, dict[str, Any]] = {}
    with frontdoor_stack(tmp, cfg) as bench:
        meter = CpuMeter(bench.procs)
        log(f"stack ready in {time.monotonic() - started:.0f} s: API pid {meter.api}, Celery "
            f"worker pids {meter.workers}, {meter.engine_threads} engine threads found")
        if meter.engine_threads < len(meter.workers):
            log("WARNING: a worker without a `tidegate-engine` thread: engine CPU not split out")
        for n in cfg.levels:
            by_level[n] = measure_level(bench, meter, n, cfg)
    wall_s = time.monotonic() - started
    out = report(cfg, by_level, wall_s)
    log(f"wrote {RESULTS}/{cfg.name}.md, .png, .json in {wall_s:.0f} s")
    print((RESULTS / f"{cfg.name}.md").read_text(), flush=True)
    print_json_last(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
