"""Noisy neighbour: one tenant's hostile load must not slow another tenant's submits or
batch (issue 28).

One stack (`running_stack`: a private Redis, a private PostgreSQL database, Celery sim
workers at GPU token rates, the API, and whatever else the launcher starts), plus the
webhook sender (`tidegate webhooks`) and the batch driver's own process (`tidegate
batches`) when the command line has one and the launcher did not start it. Two phases,
one after the other, each a warm-up and a measured window:

alone   the victim tenant alone: POST /v1/jobs on `finance` at a steady rate (open
        loop; one job in four with a `callback_url` to a prompt receiver of the
        benchmark's), and a batch of chat lines through the Batch API (uploaded once, a
        batch created at the phase's start, its `request_counts` polled). The batch runs
        on `chat`'s workers at the lowest priority, so the victim's own submits, on a
        finance worker, never starve it.
loaded  the same victim load while a hostile tenant, in a process of its own, runs:
          bad batches   batches whose lines are `"content": ""`, `"messages": []`, an
                        empty text part, or not JSON at all
          drip          `chat` jobs whose `callback_url` is a receiver on 127.0.0.1 that answers
                        one byte every few seconds (the sender is started with private
                        addresses allowed: TIDEGATE_WEBHOOK_ALLOW_PRIVATE)
          upload        chunked multipart uploads of 1 GiB to /v1/files, streamed from a
                        generator (never held in memory), one after the other
          flood         1,000 unauthenticated submits a second (no key, or a made-up one)

Figures, victim's, per phase: submit latency (POST to the answer; a submit that fails
counts as the submit timeout), p50 and p99; batch progress (input lines completed or
failed per second over the window); webhook delay (receipt - the job's finished_at);
the API process's RSS (/proc/<pid>/status VmRSS) and CPU share. The JSON's headline:
victim_submit_p99_ratio (loaded / alone; within 2x: <= 2), victim_batch_progress_ratio
(loaded / alone; within 2x: >= 0.5), api_rss_growth_mb (the API's peak RSS in the loaded
phase - its RSS just before the hostile load began).

    .venv/bin/python bench/noisy_neighbour.py --quick      # short windows, ~2-3 minutes
    .venv/bin/python bench/noisy_neighbour.py              # 30 s windows
    .venv/bin/python bench/noisy_neighbour.py --window-s 60

Writes bench/results/noisy_neighbour.{md,png,json}; the last stdout line is the JSON
summary. All traffic goes to 127.0.0.1; every process started is stopped on the way out.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/noisy_neighbour.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.noisy_neighbour, then exits

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import httpx
import psutil
from aiohttp import web

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
from bench.frontdoor import machine_busy, process_cpu_s
from bench.stack import (
    MODEL,
    bench_database,
    busy_neighbours,
    exit_cleanly_on_signals,
    load_average,
    tidegate_env,
)
from tidegate_tools.procs import Proc, free_port, tidegate_argv
from tidegate_tools.stack import WorkerSpec, running_stack

NAME = "noisy_neighbour"
PARTS = ("flood", "uploads", "batches", "callbacks")  # the hostile loads (--only)
PROFILE = "llama-3.1-8b-fp8-h100"  # the sim workers' GPU token rates
# The victim submits on `finance` (a worker of its own) and runs its batch on `batch`,
# which runs on `chat`'s workers at the lowest priority: its own submits never starve its
# batch. The hostile tenant's jobs are `chat` jobs, ahead of any batch line.
VICTIM_LANE = "finance"
HOSTILE_LANE = "chat"
TEMPERATURE = 0.8
START_TIMEOUT_S = 180.0
SETUP_TIMEOUT_S = 120.0  # the warm-up job's webhook and the warm-up batch, each
DRAIN_TIMEOUT_S = 120.0  # a phase's jobs and batch get this long to end after it
WEBHOOK_GRACE_S = 10.0  # a window's webhooks that arrive this long after it still count

# The victim.
VICTIM_RATE = 20.0  # submits a second, open loop: a stalled API shows as latency
VICTIM_MAX_TOKENS = 16
VICTIM_CALLBACK_EVERY = 4  # every 4th submit carries a callback_url to the victim's receiver
VICTIM_MAX_PENDING = 200  # submits in flight at most; the next ones are counted as skipped
SUBMIT_TIMEOUT_S = 30.0  # a failed submit counts as this in the percentiles
BATCH_LINES = 5_000  # more than a window completes at the driver's default pace
BATCH_POLL_S = 0.5

# The hostile tenant.
HOSTILE_LEAD_S = 6.0  # the hostile process's start (imports, its receiver) before its load
DRIP_S = 3.0  # the receiver's byte period: under the sender's 10 s read timeout
DRIP_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"  # ~2 minutes of dripping
CALLBACK_BURST = 48  # jobs with the dripping callback at once (3x the sender's 16 threads)
CALLBACK_RATE = 2.0  # then this many a second
BAD_LINES = 400  # lines in each bad batch file
BAD_BATCH_EVERY_S = 2.0
MAX_BAD_BATCHES = 16
UPLOAD_BYTES = 1 << 30  # each chunked upload's file part
UPLOAD_CHUNK = 1 << 20
MAX_UPLOADS = 80  # uploads while the phase lasts, at most (each refused at the file limit)
UPLOAD_EVERY_S = 1.0  # an upload starts at most this often, so they span the window
FLOOD_RATE = 1000.0  # unauthenticated submits a second
FLOOD_MAX_PENDING = 256  # flood requests in flight at most; beyond, a send is skipped
FLOOD_TIMEOUT_S = 10.0
# The hostile client's niceness: its CPU, which an attacker spends on a machine of its own,
# comes last on this one (at 10, the chat workers' own, it took a sixth of the 2 cores from
# the stack it attacks; `--hostile-nice 10` reruns that).
HOSTILE_NICE = 19

# The stack's settings on top of bench/stack.py's: callbacks to the receivers here. Both
# receivers listen on 127.0.0.1, where a deployment has two hosts: the per-host cap is
# raised to the sender's threads so that it does not join them (the per-tenant cap, left
# at its default, is what keeps the tenants apart).
SETTINGS = {"TIDEGATE_SIM_PROFILE": PROFILE, "TIDEGATE_WEBHOOK_ALLOW_PRIVATE": "true",
            "TIDEGATE_WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
            "TIDEGATE_WEBHOOK_HOST_CONCURRENCY": "16"}


@dataclass(frozen=True)
class Config:
    warm_s: float
    window_s: float
    workers: int
    slots: int
    postgresql: bool
    victim_rate: float
    flood_rate: float
    max_uploads: int
    quick: bool
    hostile_nice: int
    parts: tuple[str, ...] = ()  # the hostile loads run; all when empty

    @property
    def name(self) -> str:
        """The results' name: a run of some parts only never overwrites the full run's."""
        return NAME if not self.parts else f"{NAME}-only-{'-'.join(self.parts)}"


def parse_args(argv: Sequence[str] | None = None) -> Config | Path:
    p = argparse.ArgumentParser(description="One tenant's hostile load against another's "
                                "submits and batch (bench/README.md).")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 10 s windows, 2 uploads at most")
    p.add_argument("--window-s", type=float, default=None,
                   help="each phase's measured window (default 60; --quick 10)")
    p.add_argument("--workers", type=int, default=1,
                   help="sim workers of the chat lane, which runs the batch lane (default 1); "
                        "the finance lane has one")
    p.add_argument("--slots", type=int, default=128, help="engine slots per worker")
    p.add_argument("--victim-rate", type=float, default=VICTIM_RATE,
                   help=f"the victim's submits a second (default {VICTIM_RATE:g})")
    p.add_argument("--flood-rate", type=float, default=FLOOD_RATE,
                   help=f"unauthenticated submits a second (default {FLOOD_RATE:g})")
    p.add_argument("--hostile-nice", type=int, default=HOSTILE_NICE,
                   help="the hostile client's niceness (default %(default)s: its own CPU, "
                        "which an attacker spends on a machine of its own, does not come "
                        "before the stack's)")
    p.add_argument("--sqlite", action="store_true",
                   help="the store in a SQLite file (default: a private PostgreSQL database)")
    p.add_argument("--only", default="",
                   help=f"run only these hostile loads, comma-separated, of {', '.join(PARTS)} "
                        "(where the victim's time goes; results under a name of their own)")
    p.add_argument("--hostile", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.hostile is not None:
        return Path(a.hostile)
    window = a.window_s or (10.0 if a.quick else 60.0)  # 1,200 submits: a steadier p99
    if window <= 0 or a.victim_rate <= 0 or a.flood_rate < 0:
        p.error("--window-s and --victim-rate must be positive, --flood-rate not negative")
    parts = tuple(part for part in PARTS if part in a.only.split(","))
    unknown = set(filter(None, a.only.split(","))) - set(PARTS)
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")
    return Config(warm_s=3.0 if a.quick else 5.0, window_s=window, workers=a.workers,
                  slots=a.slots, postgresql=not a.sqlite, victim_rate=a.victim_rate,
                  flood_rate=a.flood_rate, max_uploads=10 if a.quick else MAX_UPLOADS,
                  quick=a.quick, hostile_nice=a.hostile_nice, parts=parts)


# ---------------------------------------------------------------- small helpers


async def sleep_until(at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.time()))


def new_http(limit: int, total_s: float | None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=total_s, sock_connect=10))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def job_body(lane: str, n: int, max_tokens: int,
             callback_url: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"lane": lane, "prompt": f"Order {n}: summarise it for the "
                            "customer in one short line.", "max_tokens": max_tokens,
                            "temperature": TEMPERATURE}
    if callback_url:
        body["callback_url"] = callback_url
    return body


def chat_line(custom_id: str, content: Any, messages: Any = None) -> str:
    msgs = messages if messages is not None else [{"role": "user", "content": content}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "batch", "messages": msgs, "max_tokens": 8}})


def rss_mb(pids: Sequence[int]) -> float:
    """VmRSS of the processes, in MB (/proc/<pid>/status)."""
    total_kb = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


def commit() -> str:
    """The checkout's commit, and whether its tree had changes (the figures are of both)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
    return f"{head} + {changed} changed files" if changed else head


# ---------------------------------------------------------------- the stack


@dataclass
class Bench:
    base: str
    db_url: str
    victim_key: str
    victim_id: int
    hostile_key: str
    procs: list[Proc]  # every process started, the launcher's and this benchmark's
    env: dict[str, str]
    logs: Path
    extra: list[str] = field(default_factory=list)  # processes started here, not by the launcher

    def api_pids(self) -> list[int]:
        """The API process and its children (several API processes, should it fork)."""
        pids = [p.popen.pid for p in self.procs if p.name.startswith("api:")]
        with contextlib.suppress(psutil.Error):
            pids += [c.pid for pid in list(pids)
                     for c in psutil.Process(pid).children(recursive=True)]
        return pids


def cli_commands() -> set[str]:
    """The `tidegate` command line's subcommands: `batches` once the driver has a process
    of its own (else it runs in the API)."""
    import argparse as ap

    from tidegate_tools import cli

    with contextlib.suppress(Exception):
        for action in cli._parser()._actions:
            if isinstance(action, ap._SubParsersAction):
                return set(action.choices)
    return set()


def start_extras(bench: Bench, exits: ExitStack) -> None:
    """The webhook sender, and the batch driver's process where there is one, unless the
    launcher started them; each stopped on the way out."""
    names = " ".join(p.name for p in bench.procs)
    wanted = {"webhooks": "webhook"}  # command -> what the launcher's process name holds
    if "batches" in cli_commands():
        wanted["batches"] = "batch"
    for cmd, mark in wanted.items():
        if mark in names:
            continue
        proc = Proc(cmd, tidegate_argv(cmd), bench.logs / f"{cmd}.log", bench.env)
        exits.callback(proc.stop)
        bench.procs.append(proc)
        bench.extra.append(cmd)


@contextmanager
def noisy_stack(tmp: Path, cfg: Config) -> Iterator[Bench]:
    from store import Store, upgrade

    specs = [WorkerSpec(HOSTILE_LANE, f"sim{i}@noisy", pool="vllm", engine="sim")
             for i in range(cfg.workers)]
    specs.append(WorkerSpec(VICTIM_LANE, "finance0@noisy", pool="vllm", engine="sim"))
    with bench_database(tmp, cfg.postgresql) as db_url:
        upgrade(db_url)
        store = Store(db_url)
        victim, victim_key = store.tenants.create_tenant("victim", [VICTIM_LANE, "batch"])
        _, hostile_key = store.tenants.create_tenant("hostile", [HOSTILE_LANE, "batch"])
        store.engine.dispose()
        env = {**tidegate_env(db_url, cfg.slots), **SETTINGS}
        with running_stack(env, specs, tmp / "logs", private_redis=True,
                           timeout_s=START_TIMEOUT_S) as stack, ExitStack() as exits:
            assert stack.redis_url is not None
            env["TIDEGATE_REDIS_URL"] = stack.redis_url
            bench = Bench(stack.base_url, db_url, victim_key, victim.id, hostile_key,
                          list(stack.procs), env, tmp / "logs")
            start_extras(bench, exits)
            yield bench


def in_flight(bench: Bench) -> int:
    from store import Store

    store = Store(bench.db_url)
    try:
        return store.jobs.count_in_flight(bench.victim_id)
    finally:
        store.engine.dispose()


def wait_idle(bench: Bench, timeout_s: float = DRAIN_TIMEOUT_S) -> int:
    """Waits until the victim has no job queued or running; returns how many are left."""
    end = time.monotonic() + timeout_s
    while (left := in_flight(bench)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


# ---------------------------------------------------------------- the victim's receiver


class Receiver:
    """The victim's webhook receiver on 127.0.0.1: each job's first delivery, when."""

    def __init__(self) -> None:
        self.received: dict[str, tuple[float, float]] = {}  # job id -> (receipt, finished_at)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self.hook)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/hook"

    async def hook(self, request: web.Request) -> web.Response:
        now = time.time()
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = json.loads(await request.read())["data"]
            finished = datetime.fromisoformat(data["finished_at"]).timestamp()
            self.received.setdefault(data["id"], (now, finished))
        return web.Response(status=204)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


# ---------------------------------------------------------------- the victim's load


@dataclass
class Submit:
    at: float  # wall clock when it was sent
    ms: float = math.nan
    status: int = 0  # 0: no answer
    job_id: str = ""
    error: str = ""
    hooked: bool = False  # it carried a callback_url to the victim's receiver


@dataclass
class BatchSample:
    at: float
    done: int  # completed + failed
    failed: int
    status: str


@dataclass
class Window:
    start: float
    end: float

    def holds(self, t: float) -> bool:
        return self.start <= t < self.end

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Phase:
    name: str
    window: Window
    started_at: float  # the load's start (warm-up included)
    submits: list[Submit] = field(default_factory=list)
    skipped: int = 0
    batch_id: str = ""
    batch: list[BatchSample] = field(default_factory=list)
    batch_end: str = ""
    rss: list[tuple[float, float]] = field(default_factory=list)  # (time, MB)
    rss_before_mb: float = math.nan
    api_cpu_share: float = math.nan
    machine_busy: float = math.nan
    cpu_shares: dict[str, float] = field(default_factory=dict)  # group -> cores, in the window
    left_in_flight: int = 0
    load_before: str = ""
    neighbours: str = ""
    hostile: dict[str, Any] = field(default_factory=dict)  # what the hostile process did
    webhooks: dict[str, Any] = field(default_factory=dict)  # the victim's, once all are in


async def one_submit(http: aiohttp.ClientSession, base: str, key: str, body: dict[str, Any],
                     record: Submit) -> None:
    started = time.perf_counter()
    try:
        async with http.post(f"{base}/v1/jobs", json=body, headers=auth(key)) as resp:
            answer = await resp.read()
            record.status = resp.status
            if resp.status == 202:
                record.job_id = json.loads(answer).get("job_id", "")
            else:
                record.error = answer[:120].decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = type(exc).__name__
    record.ms = (time.perf_counter() - started) * 1000


async def victim_submits(bench: Bench, phase: Phase, rate: float, hook_url: str) -> None:
    """Open loop: a submit every 1/rate s from the phase's start to its window's end,
    whatever the answers take (at most VICTIM_MAX_PENDING waiting)."""
    pending: set[asyncio.Task[None]] = set()
    async with new_http(VICTIM_MAX_PENDING, SUBMIT_TIMEOUT_S) as http:
        count = int((phase.window.end - phase.started_at) * rate)
        for n in range(count):
            await sleep_until(phase.started_at + n / rate)
            if len(pending) >= VICTIM_MAX_PENDING:
                phase.skipped += 1
                continue
            record = Submit(at=time.time(), hooked=n % VICTIM_CALLBACK_EVERY == 0)
            phase.submits.append(record)
            body = job_body(VICTIM_LANE, n, VICTIM_MAX_TOKENS,
                            hook_url if record.hooked else None)
            task = asyncio.create_task(one_submit(http, bench.base, bench.victim_key, body,
                                                  record))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=SUBMIT_TIMEOUT_S + 5)


async def create_batch(http: aiohttp.ClientSession, base: str, key: str, file_id: str) -> str:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}
    async with http.post(f"{base}/v1/batches", json=body, headers=auth(key)) as resp:
        answer = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"the victim's batch was refused: HTTP {resp.status} {answer}")
        return str(answer["id"])


async def batch_state(http: aiohttp.ClientSession, base: str, key: str,
                      batch_id: str) -> BatchSample | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        async with http.get(f"{base}/v1/batches/{batch_id}", headers=auth(key)) as resp:
            b = await resp.json(content_type=None)
            counts = b["request_counts"]
            return BatchSample(time.time(), counts["completed"] + counts["failed"],
                               counts["failed"], b["status"])
    return None


async def victim_batch(bench: Bench, phase: Phase, file_id: str) -> None:
    """A batch created at the phase's start, polled until the window's end."""
    async with new_http(4, 10) as http:
        phase.batch_id = await create_batch(http, bench.base, bench.victim_key, file_id)
        while time.time() < phase.window.end:
            sample = await batch_state(http, bench.base, bench.victim_key, phase.batch_id)
            if sample is not None:
                phase.batch.append(sample)
            await asyncio.sleep(BATCH_POLL_S)


async def end_batch(bench: Bench, phase: Phase) -> None:
    """Cancels the phase's batch and waits (bounded) until it has ended, so the next
    phase starts clean."""
    if not phase.batch_id:
        return
    async with new_http(4, 10) as http:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.post(f"{bench.base}/v1/batches/{phase.batch_id}/cancel",
                                 headers=auth(bench.victim_key)) as resp:
                await resp.read()
        end = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < end:
            state = await batch_state(http, bench.base, bench.victim_key, phase.batch_id)
            if state is not None and state.status in ("cancelled", "completed", "failed",
                                                      "expired"):
                phase.batch_end = state.status
                return
            await asyncio.sleep(0.5)
    phase.batch_end = "still open after the phase"


async def sample_rss(bench: Bench, phase: Phase) -> None:
    pids = bench.api_pids()
    while time.time() < phase.window.end:
        phase.rss.append((time.time(), rss_mb(pids)))
        await asyncio.sleep(0.25)
    phase.rss.append((time.time(), rss_mb(pids)))


# Where a window's CPU went: the processes of each group (a Proc's name starts with the
# key) with their children (a worker supervisor's Celery process, ...).
CPU_GROUPS = {"api:": "API", "batches": "batch driver", "webhooks": "webhook sender",
              "worker:sim": "chat worker(s)", "worker:finance": "finance worker",
              "redis-server": "Redis", "hostile": "hostile client"}
VICTIM_CLIENT = "victim client (this process)"


def tree_cpu_s(pid: int) -> float:
    """utime + stime of a process and its descendants alive now."""
    total = process_cpu_s(pid)
    with contextlib.suppress(psutil.Error):
        total += sum(process_cpu_s(c.pid) for c in psutil.Process(pid).children(recursive=True))
    return total


def cpu_by_group(procs: Sequence[Proc]) -> dict[str, float]:
    out = {VICTIM_CLIENT: process_cpu_s(os.getpid())}  # this process alone, not its children
    for proc in procs:
        group = next((g for prefix, g in CPU_GROUPS.items() if proc.name.startswith(prefix)),
                     proc.name)
        out[group] = out.get(group, 0.0) + tree_cpu_s(proc.popen.pid)
    return out


async def sample_cpu(bench: Bench, phase: Phase, extra: Sequence[Proc]) -> None:
    procs = [*bench.procs, *extra]
    await sleep_until(phase.window.start)
    cpu0, busy0 = cpu_by_group(procs), machine_busy()
    await sleep_until(phase.window.end)
    cpu1, busy1 = cpu_by_group(procs), machine_busy()
    phase.cpu_shares = {g: (cpu1[g] - cpu0.get(g, 0.0)) / phase.window.seconds for g in cpu1}
    phase.api_cpu_share = phase.cpu_shares.get("API", math.nan)
    phase.machine_busy = ratio(busy1[0] - busy0[0], busy1[1] - busy0[1])


# ---------------------------------------------------------------- a phase


@dataclass(frozen=True)
class Context:
    bench: Bench
    cfg: Config
    tmp: Path
    file_id: str  # the victim's batch input
    receiver: Receiver


def start_hostile(ctx: Context, start_at: float, end_at: float) -> tuple[Proc, Path]:
    """The hostile tenant's load, in a process of its own: its client's work does not
    delay the victim's measuring loop (they share the cores, as tenants' traffic does)."""
    out = ctx.tmp / "hostile-result.json"
    spec = ctx.tmp / "hostile.json"
    spec.write_text(json.dumps({
        "base": ctx.bench.base, "key": ctx.bench.hostile_key, "start_at": start_at,
        "end_at": end_at, "flood_rate": ctx.cfg.flood_rate,
        "max_uploads": ctx.cfg.max_uploads, "nice": ctx.cfg.hostile_nice, "out": str(out),
        "parts": list(ctx.cfg.parts or PARTS)}))
    spec.chmod(0o600)  # it holds the hostile tenant's key
    argv = [sys.executable, str(Path(__file__).resolve()), "--hostile", str(spec)]
    return Proc("hostile", argv, ctx.bench.logs / "hostile.log", dict(os.environ)), out


def finish_hostile(proc: Proc, out: Path, end_at: float) -> dict[str, Any]:
    """Waits (bounded) for the hostile process to end by itself, stops it anyway, and
    reads what it did."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(max(1.0, end_at - time.time() + 30))
    proc.stop()
    try:
        return dict(json.loads(out.read_text()))
    except (OSError, ValueError):
        return {"error": f"no result from the hostile process; its log:\n{proc.tail(20)}"}


async def run_phase(ctx: Context, name: str, hostile: bool) -> Phase:
    cfg = ctx.cfg
    lead = HOSTILE_LEAD_S if hostile else 1.0
    started_at = time.time() + lead
    window = Window(started_at + cfg.warm_s, started_at + cfg.warm_s + cfg.window_s)
    phase = Phase(name, window, started_at, load_before=load_average())
    neighbours = set(busy_neighbours())
    proc = out = None
    if hostile:
        proc, out = start_hostile(ctx, started_at, window.end)
    try:
        await sleep_until(started_at - 0.2)
        phase.rss_before_mb = rss_mb(ctx.bench.api_pids())  # before any of the load
        await asyncio.gather(victim_submits(ctx.bench, phase, cfg.victim_rate, ctx.receiver.url),
                             victim_batch(ctx.bench, phase, ctx.file_id),
                             sample_rss(ctx.bench, phase),
                             sample_cpu(ctx.bench, phase, [proc] if proc else []))
    finally:
        if proc is not None and out is not None:
            phase.hostile = await asyncio.to_thread(finish_hostile, proc, out, window.end)
    await end_batch(ctx.bench, phase)
    phase.left_in_flight = await asyncio.to_thread(wait_idle, ctx.bench)
    await asyncio.sleep(max(0.0, window.end + WEBHOOK_GRACE_S - time.time()))
    phase.neighbours = "; ".join(sorted(neighbours | set(busy_neighbours())))
    return phase


# ---------------------------------------------------------------- setup


def upload_file(base: str, key: str, text: str, name: str) -> str:
    files = {"file": (name, text.encode(), "application/jsonl")}
    resp = httpx.post(f"{base}/v1/files", headers=auth(key), data={"purpose": "batch"},
                      files=files, timeout=60)
    if resp.status_code != 200:
        raise RuntimeError(f"uploading {name}: HTTP {resp.status_code} {resp.text[:300]}")
    return str(resp.json()["id"])


def victim_lines(count: int, prefix: str) -> str:
    return "".join(chat_line(f"{prefix}{i}", f"Order {i}: one line for the customer.") + "\n"
                   for i in range(count))


def webhook_secrets(bench: Bench) -> None:
    """Each tenant's signing secret: a delivery is sent only for a tenant that has one."""
    for key in (bench.victim_key, bench.hostile_key):
        resp = httpx.post(f"{bench.base}/v1/webhook-secret", headers=auth(key), timeout=30)
        if resp.status_code != 200:
            raise RuntimeError(f"POST /v1/webhook-secret: HTTP {resp.status_code} {resp.text}")


async def warm_up(ctx: Context) -> None:
    """The whole path once before measuring: a victim job whose webhook arrives (the
    sender runs) and a small batch that completes (the batch driver runs, wherever)."""
    bench = ctx.bench
    async with new_http(4, 30) as http:
        record = Submit(at=time.time())
        await one_submit(http, bench.base, bench.victim_key,
                         job_body(VICTIM_LANE, 0, VICTIM_MAX_TOKENS, ctx.receiver.url),
                         record)
        if record.status != 202:
            raise RuntimeError(f"the warm-up submit failed: {record.status} {record.error}")
        small = await asyncio.to_thread(upload_file, bench.base, bench.victim_key,
                                        victim_lines(4, "warm"), "warm.jsonl")
        batch_id = await create_batch(http, bench.base, bench.victim_key, small)
        await wait_async(lambda: record.job_id in ctx.receiver.received, SETUP_TIMEOUT_S,
                         "the warm-up job's webhook", bench)
        await wait_async(lambda: _batch_done(http, bench, batch_id), SETUP_TIMEOUT_S,
                         "the warm-up batch to complete", bench)


async def _batch_done(http: aiohttp.ClientSession, bench: Bench, batch_id: str) -> bool:
    state = await batch_state(http, bench.base, bench.victim_key, batch_id)
    return state is not None and state.status == "completed"


async def wait_async(check: Any, timeout_s: float, what: str, bench: Bench) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        dead = [p.name for p in bench.procs if not p.alive()]
        if dead:
            raise RuntimeError(f"processes died while waiting for {what}: {dead}")
        await asyncio.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}; logs under "
                     f"{bench.logs}")


async def run_all(bench: Bench, cfg: Config, tmp: Path) -> list[Phase]:
    receiver = Receiver()
    await receiver.start()
    try:
        await asyncio.to_thread(webhook_secrets, bench)
        file_id = await asyncio.to_thread(upload_file, bench.base, bench.victim_key,
                                          victim_lines(BATCH_LINES, "v"), "victim.jsonl")
        ctx = Context(bench, cfg, tmp, file_id, receiver)
        await warm_up(ctx)
        log("warm-up done: a webhook delivered and a batch completed")
        phases = []
        for name, hostile in (("alone", False), ("loaded", True)):
            log(f"phase {name}: {cfg.warm_s:g} s warm-up, {cfg.window_s:g} s window")
            phases.append(await run_phase(ctx, name, hostile))
            log(f"phase {name}: {summary_line(phases[-1], receiver)}")
        phases_webhooks(phases, receiver)
        return phases
    finally:
        await receiver.stop()


# ---------------------------------------------------------------- the hostile tenant


@dataclass
class Hostile:
    """What the hostile process did, written as JSON for the benchmark to report."""

    flood_sent: int = 0
    flood_skipped: int = 0  # FLOOD_MAX_PENDING in flight: not sent
    flood_status: dict[str, int] = field(default_factory=dict)
    flood_ms: list[float] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    bad_batches: dict[str, int] = field(default_factory=dict)  # outcome -> count
    bad_file: str = ""
    callback_jobs: dict[str, int] = field(default_factory=dict)  # status -> count
    drip_connections: int = 0
    drip_open_max: int = 0
    drip_open: int = 0
    started_late_s: float = 0.0


def tally(into: dict[str, int], what: object) -> None:
    into[str(what)] = into.get(str(what), 0) + 1


class Drip:
    """A receiver that answers one byte every DRIP_S seconds: each connection holds a
    sender thread (or a slot) for as long as the sender lets it."""

    def __init__(self, h: Hostile, end_at: float) -> None:
        self.h, self.end_at = h, end_at
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/hook"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h = self.h
        h.drip_connections += 1
        h.drip_open += 1
        h.drip_open_max = max(h.drip_open_max, h.drip_open)
        try:
            with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                                     TimeoutError):
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DRIP_S * 3)
            for byte in DRIP_RESPONSE:
                if time.time() >= self.end_at:
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(DRIP_S)
        except (OSError, TimeoutError):
            pass
        finally:
            h.drip_open -= 1
            writer.close()


async def hostile_callbacks(http: aiohttp.ClientSession, spec: dict[str, Any], h: Hostile,
                            url: str) -> None:
    """A burst of jobs whose callback drips, then a steady trickle, until the end."""
    async def one(n: int) -> None:
        record = Submit(at=time.time())
        body = job_body(HOSTILE_LANE, n, 4, url)
        await one_submit(http, spec["base"], spec["key"], body, record)
        tally(h.callback_jobs, record.status or record.error)

    await asyncio.gather(*(one(n) for n in range(CALLBACK_BURST)))
    n = CALLBACK_BURST
    limit = CALLBACK_BURST + int((spec["end_at"] - time.time()) * CALLBACK_RATE)
    while time.time() < spec["end_at"] and n < limit:
        await one(n)
        n += 1
        await asyncio.sleep(1 / CALLBACK_RATE)


def bad_lines(count: int) -> str:
    """Lines a hostile tenant would send: each kind the issue names, round robin."""
    kinds = [lambda i: chat_line(f"e{i}", ""),
             lambda i: chat_line(f"l{i}", None, messages=[]),
             lambda i: chat_line(f"p{i}", [{"type": "text", "text": ""}]),
             lambda i: "{not json " + str(i)]
    return "".join(kinds[i % len(kinds)](i) + "\n" for i in range(count))


async def hostile_batches(http: aiohttp.ClientSession, spec: dict[str, Any],
                          h: Hostile) -> None:
    """A batch of bad lines every BAD_BATCH_EVERY_S, at most MAX_BAD_BATCHES."""
    if not h.bad_file:
        return
    for _ in range(MAX_BAD_BATCHES):
        if time.time() >= spec["end_at"]:
            return
        try:
            await create_batch(http, spec["base"], spec["key"], h.bad_file)
            tally(h.bad_batches, "created")
        except (RuntimeError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            tally(h.bad_batches, str(exc)[:100] if isinstance(exc, RuntimeError)
                  else type(exc).__name__)
        await asyncio.sleep(BAD_BATCH_EVERY_S)


BOUNDARY = "noisyneighbour" + secrets.token_hex(8)


async def upload_body(sent: list[int]) -> AsyncIterator[bytes]:
    """A multipart body whose file part is UPLOAD_BYTES of JSONL, made one chunk at a time
    (the same chunk object each time: nothing accumulates); `sent` counts the bytes."""
    head = (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"batch\r\n--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; "
            f"filename=\"big.jsonl\"\r\ncontent-type: application/jsonl\r\n\r\n").encode()
    line = (chat_line("big", "Order 1: one line for the customer.") + "\n").encode()
    chunk = (line * (UPLOAD_CHUNK // len(line) + 1))[:UPLOAD_CHUNK]
    for part in (head, *_file_chunks(chunk), f"\r\n--{BOUNDARY}--\r\n".encode()):
        sent[0] += len(part)
        yield part


def _file_chunks(chunk: bytes) -> Iterator[bytes]:
    left = UPLOAD_BYTES
    while left > 0:
        yield chunk if left >= len(chunk) else chunk[:left]
        left -= len(chunk)


async def one_upload(http: aiohttp.ClientSession, spec: dict[str, Any]) -> dict[str, Any]:
    sent, started = [0], time.monotonic()
    status, error = 0, ""
    headers = {**auth(spec["key"]),
               "content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    remaining = max(1.0, spec["end_at"] - time.time())
    try:
        async with http.post(f"{spec['base']}/v1/files", data=upload_body(sent),
                             headers=headers,
                             timeout=aiohttp.ClientTimeout(total=remaining)) as resp:
            status = resp.status
            error = (await resp.content.read(300)).decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = type(exc).__name__
    return {"status": status, "bytes_sent": sent[0], "s": round(time.monotonic() - started, 2),
            "answer": error[:200]}


async def hostile_uploads(http: aiohttp.ClientSession, spec: dict[str, Any],
                          h: Hostile) -> None:
    """Chunked uploads one after the other, one every UPLOAD_EVERY_S at most, until the
    phase ends: each is refused at the file limit in well under a second, so a few at
    the start would leave the measured window untouched."""
    for n in range(spec["max_uploads"]):
        await sleep_until(spec["start_at"] + n * UPLOAD_EVERY_S)
        if time.time() >= spec["end_at"] - 1:
            return
        h.uploads.append(await one_upload(http, spec))


class FloodConn(asyncio.Protocol):
    """One keep-alive connection of the flood: a request written as bytes, its response
    read as far as its status and length. Why not aiohttp: the flood's client spent 0.3-0.4
    of a core of the 2 the stack runs on (an attacker spends it on a machine of its own);
    this one spends a tenth of that, so the cores measured are the stack's."""

    def __init__(self, flood: Flood) -> None:
        self.flood, self.buf = flood, bytearray()
        self.transport: asyncio.Transport | None = None
        self.started = 0.0  # the request in flight's send time; 0: idle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.started = time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.started:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = _content_length(bytes(self.buf[:end]))
            if len(self.buf) < end + 4 + length:
                return
            status = int(self.buf[9:12])
            del self.buf[:end + 4 + length]
            self.flood.answered(self, status, time.perf_counter() - self.started)
            self.started = 0.0

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.flood.lost(self)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class Flood:
    """`flood_rate` unauthenticated submits a second on keep-alive connections, each sent
    at its time on a fixed schedule; at most FLOOD_MAX_PENDING in flight (a send that finds
    them all busy is skipped and counted)."""

    def __init__(self, base: str, h: Hostile) -> None:
        url = urlparse(base)
        self.host, self.port, self.h = url.hostname or "127.0.0.1", url.port or 80, h
        self.idle: list[FloodConn] = []
        self.connecting: set[asyncio.Task[None]] = set()
        self.busy = 0  # requests in flight, connecting ones included
        body = json.dumps(job_body(HOSTILE_LANE, 0, 16)).encode()
        self.head = (f"POST /v1/jobs HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(body)}\r\n")
        self.body = body

    def request(self, n: int) -> bytes:
        # Half carry no key, half a made-up one of the right shape: a cache of known-bad
        # keys sees each only once.
        key = "" if n % 2 else f"authorization: Bearer tg_{secrets.token_urlsafe(32)}\r\n"
        return f"{self.head}{key}\r\n".encode() + self.body

    def send(self, n: int) -> None:
        if self.busy >= FLOOD_MAX_PENDING:
            self.h.flood_skipped += 1
            return
        self.h.flood_sent += 1
        self.busy += 1
        if self.idle:
            self.idle.pop().send(self.request(n))
            return
        task = asyncio.create_task(self._connect_and_send(n))  # the schedule goes on meanwhile
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)

    async def _connect_and_send(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: FloodConn(self), self.host, self.port)
        except OSError as exc:
            self.busy -= 1
            tally(self.h.flood_status, type(exc).__name__)
            return
        conn.send(self.request(n))

    def answered(self, conn: FloodConn, status: int, seconds: float) -> None:
        self.busy -= 1
        tally(self.h.flood_status, status)
        self.h.flood_ms.append(seconds * 1000)
        self.idle.append(conn)

    def lost(self, conn: FloodConn) -> None:
        if conn.started:  # its request got no answer
            self.busy -= 1
            tally(self.h.flood_status, "ClientOSError")
        if conn in self.idle:
            self.idle.remove(conn)


async def hostile_flood(spec: dict[str, Any], h: Hostile) -> None:
    rate = float(spec["flood_rate"])
    if rate <= 0:
        return
    flood = Flood(spec["base"], h)
    start = time.time()
    for n in range(int((spec["end_at"] - start) * rate)):
        await sleep_until(start + n / rate)
        flood.send(n)
    deadline = time.time() + FLOOD_TIMEOUT_S
    while flood.busy and time.time() < deadline:
        await asyncio.sleep(0.1)
    for conn in flood.idle:
        if conn.transport is not None:
            conn.transport.close()


async def hostile_main(spec: dict[str, Any]) -> Hostile:
    h = Hostile()
    drip = Drip(h, spec["end_at"])
    await drip.start()
    async with new_http(64, 60) as http:
        try:
            h.bad_file = await asyncio.to_thread(upload_file, spec["base"], spec["key"],
                                                 bad_lines(BAD_LINES), "bad.jsonl")
        except (RuntimeError, httpx.HTTPError) as exc:
            tally(h.bad_batches, f"bad file refused: {exc}"[:100])
        h.started_late_s = max(0.0, time.time() - spec["start_at"])
        await sleep_until(spec["start_at"])
        every = {"flood": lambda: hostile_flood(spec, h),
                 "uploads": lambda: hostile_uploads(http, spec, h),
                 "batches": lambda: hostile_batches(http, spec, h),
                 "callbacks": lambda: hostile_callbacks(http, spec, h, drip.url)}
        loads = [every[part]() for part in spec["parts"]]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*loads),
                                   max(1.0, spec["end_at"] - time.time() + 5))
    assert drip.server is not None
    drip.server.close()
    return h


def run_hostile(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    os.nice(max(0, int(spec["nice"]) - os.nice(0)))  # only ever lowered
    h = asyncio.run(hostile_main(spec))
    Path(spec["out"]).write_text(json.dumps(asdict(h)))
    return 0


# ---------------------------------------------------------------- figures


def submit_ms(s: Submit) -> float:
    """A submit's latency; one that failed counts as the timeout (the victim got nothing)."""
    return s.ms if s.status == 202 and math.isfinite(s.ms) else SUBMIT_TIMEOUT_S * 1000


def timed(phase: Phase) -> list[Submit]:
    return [s for s in phase.submits if phase.window.holds(s.at)]


def batch_progress(phase: Phase) -> float:
    """Lines done a second over the window: between the first sample at or after its start
    and the last before its end."""
    inside = [b for b in phase.batch if phase.window.holds(b.at)]
    if len(inside) < 2 or inside[-1].at <= inside[0].at:
        return math.nan
    return (inside[-1].done - inside[0].done) / (inside[-1].at - inside[0].at)


def phases_webhooks(phases: Sequence[Phase], receiver: Receiver) -> None:
    """Each phase's webhook figures, once every phase's grace has passed."""
    for phase in phases:
        ids = [s.job_id for s in timed(phase) if s.job_id and s.hooked]
        got = [receiver.received[j] for j in ids if j in receiver.received
               and receiver.received[j][0] <= phase.window.end + WEBHOOK_GRACE_S]
        delays = [(at - finished) * 1000 for at, finished in got]
        phase.webhooks = {"expected": len(ids), "received": len(got),
                                      "p50_ms": percentile(delays, 50),
                                      "p99_ms": percentile(delays, 99)}


def phase_figures(phase: Phase) -> dict[str, Any]:
    subs = timed(phase)
    lat = [submit_ms(s) for s in subs]
    ok = [s for s in subs if s.status == 202]
    rss = [mb for at, mb in phase.rss if at >= phase.started_at]
    hooks = phase.webhooks
    return {
        "submits": len(subs), "submits_202": len(ok),
        "submit_errors": dict(Counter(str(s.status or s.error) for s in subs
                                      if s.status != 202)),
        "submits_skipped": phase.skipped,
        "submit_p50_ms": percentile(lat, 50), "submit_p99_ms": percentile(lat, 99),
        "submit_max_ms": max(lat, default=math.nan),
        "batch_lines_per_s": batch_progress(phase),
        "batch_failed_lines": phase.batch[-1].failed if phase.batch else 0,
        "batch_status_at_window_end": phase.batch[-1].status if phase.batch else "unknown",
        "batch_end": phase.batch_end,
        "webhooks_expected": hooks.get("expected", 0),
        "webhooks_received": hooks.get("received", 0),
        "webhook_delay_p50_ms": hooks.get("p50_ms", math.nan),
        "webhook_delay_p99_ms": hooks.get("p99_ms", math.nan),
        "api_rss_before_mb": phase.rss_before_mb,
        "api_rss_peak_mb": max(rss, default=math.nan),
        "api_rss_end_mb": rss[-1] if rss else math.nan,
        "api_cpu_share": phase.api_cpu_share, "machine_busy": phase.machine_busy,
        "cpu_shares": phase.cpu_shares,
        "left_in_flight": phase.left_in_flight, "load_before": phase.load_before,
        "neighbours": phase.neighbours,
    }


def _uploads_cell(uploads: list[dict[str, Any]]) -> str:
    if not uploads:
        return "none"
    answers: dict[str, int] = {}
    for u in uploads:
        tally(answers, u["status"] or u["answer"])
    sent = [u["bytes_sent"] / 2**20 for u in uploads]
    took = [float(u["s"]) for u in uploads]
    return (f"{len(uploads)} uploads; answers {answers}; MiB sent each "
            f"{min(sent):,.0f}-{max(sent):,.0f}; seconds each {min(took):.2f}-{max(took):.2f}")


def hostile_figures(h: dict[str, Any], seconds: float) -> dict[str, Any]:
    if "error" in h:
        return {"error": h["error"]}
    flood_ms = h.get("flood_ms", [])
    return {"flood_sent": h["flood_sent"], "flood_sent_per_s": h["flood_sent"] / seconds,
            "flood_skipped": h["flood_skipped"], "flood_answers": h["flood_status"],
            "flood_p50_ms": percentile(flood_ms, 50), "flood_p99_ms": percentile(flood_ms, 99),
            "uploads": h["uploads"], "bad_batches": h["bad_batches"],
            "callback_jobs": h["callback_jobs"], "drip_connections": h["drip_connections"],
            "drip_open_max": h["drip_open_max"], "started_late_s": h["started_late_s"]}


def summary_line(phase: Phase, receiver: Receiver) -> str:
    lat = [submit_ms(s) for s in timed(phase)]
    return (f"submit p50/p99 {fmt(percentile(lat, 50))}/{fmt(percentile(lat, 99))} ms over "
            f"{len(lat)}, batch {fmt(batch_progress(phase))} lines/s, API RSS "
            f"{fmt(phase.rss_before_mb)} -> peak "
            f"{fmt(max((mb for _, mb in phase.rss), default=math.nan))} MB, "
            f"{len(receiver.received)} webhooks so far")


# ---------------------------------------------------------------- report


ROWS: list[tuple[str, str, int]] = [
    ("submits in the window (202 / all)", "submits_202", 0),
    ("submit p50 (ms)", "submit_p50_ms", 1),
    ("submit p99 (ms)", "submit_p99_ms", 1),
    ("submit max (ms)", "submit_max_ms", 1),
    ("batch progress (lines/s)", "batch_lines_per_s", 1),
    ("batch lines failed (at the window's end)", "batch_failed_lines", 0),
    ("webhooks received / expected", "webhooks_received", 0),
    ("webhook delay p50 (ms)", "webhook_delay_p50_ms", 0),
    ("webhook delay p99 (ms)", "webhook_delay_p99_ms", 0),
    ("API RSS before the phase (MB)", "api_rss_before_mb", 0),
    ("API RSS peak in the phase (MB)", "api_rss_peak_mb", 0),
    ("API CPU share in the window (cores)", "api_cpu_share", 2),
    ("machine busy in the window", "machine_busy", 2),
]


def cell(f: dict[str, Any], key: str, digits: int) -> str:
    value = fmt(float(f[key]), digits)
    if key == "submits_202":
        return f"{value} / {f['submits']}"
    if key == "webhooks_received":
        return f"{value} / {f['webhooks_expected']}"
    return value


def ratio_cell(alone: dict[str, Any], loaded: dict[str, Any], key: str) -> str:
    if key == "submit_p99_ms":
        r = ratio(loaded[key], alone[key])
        return f"{fmt(r, 2)} ({'ok' if r <= 2 else 'over 2x'})"
    if key == "batch_lines_per_s":
        r = ratio(loaded[key], alone[key])
        return f"{fmt(r, 2)} ({'ok' if r >= 0.5 else 'under 0.5'})"
    if key in ("submit_p50_ms", "webhook_delay_p99_ms", "api_cpu_share"):
        return fmt(ratio(loaded[key], alone[key]), 2)
    if key == "api_rss_peak_mb":
        return f"+{fmt(loaded[key] - loaded['api_rss_before_mb'], 0)} MB"
    return ""


def victim_table(alone: dict[str, Any], loaded: dict[str, Any]) -> str:
    rows = [[label, cell(alone, key, d), cell(loaded, key, d), ratio_cell(alone, loaded, key)]
            for label, key, d in ROWS]
    groups = [g for g in (*CPU_GROUPS.values(), VICTIM_CLIENT)
              if g in alone["cpu_shares"] or g in loaded["cpu_shares"]]
    rows += [[f"CPU in the window, cores: {g}", fmt(alone["cpu_shares"].get(g, math.nan), 2),
              fmt(loaded["cpu_shares"].get(g, math.nan), 2), ""] for g in groups if g != "API"]
    return markdown_table(["victim's figure", "alone", "with the hostile tenant",
                           "loaded / alone"], rows)


def hostile_table(h: dict[str, Any]) -> str:
    if "error" in h:
        return f"The hostile process reported nothing: {h['error']}"
    uploads = _uploads_cell(h["uploads"])
    rows = [
        ["unauthenticated submits", f"{h['flood_sent']:,} sent ({fmt(h['flood_sent_per_s'], 0)}"
         f"/s), {h['flood_skipped']:,} skipped at {FLOOD_MAX_PENDING} in flight; answers "
         f"{h['flood_answers']}; p50/p99 {fmt(h['flood_p50_ms'])}/{fmt(h['flood_p99_ms'])} ms"],
        ["chunked 1 GiB uploads", uploads],
        ["bad batches", f"{h['bad_batches']} ({BAD_LINES} bad lines each)"],
        ["jobs with a dripping callback", f"{h['callback_jobs']}; the receiver saw "
         f"{h['drip_connections']} connections, {h['drip_open_max']} held at once"],
    ]
    return markdown_table(["hostile load", "what it did"], rows)


def plot(path: Path, phases: Sequence[Phase]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here; set before pyplot is imported
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for phase in phases:
        _plot_phase(axes, phase)
    titles = [("victim submit latency, CDF (window)", "submit latency (ms)", "fraction"),
              ("victim submits over time", "s since the phase's start", "latency (ms)"),
              ("victim batch: lines done", "s since the phase's start", "lines"),
              ("API RSS", "s since the phase's start", "MB")]
    for ax, (title, xlabel, ylabel) in zip(axes.flat, titles, strict=True):
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_xscale("log")
    axes[0][1].set_yscale("log")
    fig.suptitle("noisy neighbour: the victim tenant alone and beside a hostile one")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_phase(axes: Any, phase: Phase) -> None:
    t0, w = phase.started_at, phase.window
    lat = sorted(submit_ms(s) for s in timed(phase))
    if lat:
        axes[0][0].step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post",
                        label=phase.name)
    axes[0][1].plot([s.at - t0 for s in phase.submits], [submit_ms(s) for s in phase.submits],
                    ".", ms=3, label=phase.name)
    axes[1][0].plot([b.at - t0 for b in phase.batch], [b.done for b in phase.batch],
                    label=phase.name)
    axes[1][1].plot([at - t0 for at, _ in phase.rss], [mb for _, mb in phase.rss],
                    label=phase.name)
    for ax in (axes[0][1], axes[1][0], axes[1][1]):
        ax.axvspan(w.start - t0, w.end - t0, alpha=0.04, color="grey")


def setup_lines(cfg: Config, bench: Bench, wall_s: float) -> dict[str, Any]:
    host = machine()
    procs = ", ".join(p.name.split(":")[0] for p in bench.procs)
    driver = ("its own process (`tidegate batches`)" if "batch" in procs
              else "inside the API process")
    return {
        "machine": f"{host['cores']} cores, {host['cpu']}, Python {host['python']}",
        "date": host["date"], "commit": commit(),
        "processes": procs + (f" (started here: {', '.join(bench.extra)})"
                              if bench.extra else ""),
        "batch driver": driver,
        "store": "private PostgreSQL database (127.0.0.1:5432)" if cfg.postgresql
                 else "private SQLite file",
        "workers": f"`tidegate worker --engine sim --pool vllm`: {cfg.workers} of lane "
                   f"`{HOSTILE_LANE}` (the batch lane runs on it), 1 of `{VICTIM_LANE}`; "
                   f"{cfg.slots} slots each, profile "
                   f"{PROFILE}",
        "settings on top of the defaults": ", ".join(f"{k}={v}" for k, v in SETTINGS.items()),
        "victim": f"POST /v1/jobs on `{VICTIM_LANE}` at {cfg.victim_rate:g}/s (open loop, "
                  f"{VICTIM_MAX_TOKENS} tokens, one in {VICTIM_CALLBACK_EVERY} with a "
                  f"callback_url to a prompt receiver); a batch of "
                  f"{BATCH_LINES:,} chat lines per phase",
        "hostile": f"unauthenticated submits at {cfg.flood_rate:g}/s; up to "
                   f"{cfg.max_uploads} chunked uploads of {UPLOAD_BYTES >> 20:,} MiB (one a "
                   f"second at most); a "
                   f"batch of {BAD_LINES} bad lines every {BAD_BATCH_EVERY_S:g} s (at most "
                   f"{MAX_BAD_BATCHES}); {CALLBACK_BURST} jobs then {CALLBACK_RATE:g}/s with a "
                   f"callback that drips a byte every {DRIP_S:g} s; its client at niceness "
                   f"{cfg.hostile_nice}",
        "hostile loads run": ", ".join(cfg.parts or PARTS),
        "warm-up / window per phase (s)": f"{cfg.warm_s:g} / {cfg.window_s:g}",
        "wall time of the whole benchmark (s)": round(wall_s, 1),
    }


NOTES = [
    "Submit latency: POST /v1/jobs to its answer, as the victim's client saw it; the "
    "submits are sent on a schedule (open loop), so a stalled API shows as latency, not "
    "as fewer requests. A submit answered other than 202, or not at all within "
    f"{SUBMIT_TIMEOUT_S:g} s, counts as {SUBMIT_TIMEOUT_S:g} s in the percentiles.",
    "Batch progress: the batch's request_counts (completed + failed) polled every "
    f"{BATCH_POLL_S:g} s; lines a second between the first and last poll inside the window. "
    "Each phase runs its own batch from the same input file, cancelled when the phase ends.",
    "api_rss_growth_mb: the API process's peak VmRSS during the loaded phase (from the "
    "hostile load's start to the window's end) less its VmRSS just before it.",
    "The hostile tenant runs in a process of its own, so its client's work does not delay "
    "the victim's measuring loop. It shares the machine's cores with the stack, which an "
    "attacker's client would not: it runs at niceness 10 (`--hostile-nice`), the chat "
    "workers' own (lanes.toml `cpu_nice`), so its CPU comes after the API's and beside the "
    "worker that runs the victim's batch. The batch lane's worker is the first to lose CPU "
    "on a saturated machine: the CPU rows say where the cores went.",
    "Webhook delay: the victim receiver's receipt less the job's finished_at (the body's "
    "data); a webhook received later than the window's end + "
    f"{WEBHOOK_GRACE_S:g} s is counted as not received. Both receivers listen on "
    "127.0.0.1, where a deployment has two hosts: the sender's per-host cap is raised to "
    "its thread count (TIDEGATE_WEBHOOK_HOST_CONCURRENCY=16) so that it does not join "
    "them; the per-tenant cap, at its default, is what keeps the tenants apart.",
]


def report(cfg: Config, bench: Bench, phases: Sequence[Phase], wall_s: float) -> dict[str, Any]:
    alone, loaded = (phase_figures(p) for p in phases)
    hostile = hostile_figures(phases[1].hostile, phases[1].window.end - phases[1].started_at)
    p99_ratio = ratio(loaded["submit_p99_ms"], alone["submit_p99_ms"])
    progress_ratio = ratio(loaded["batch_lines_per_s"], alone["batch_lines_per_s"])
    growth = loaded["api_rss_peak_mb"] - loaded["api_rss_before_mb"]
    notes = list(NOTES)
    notes += [f"WARNING: in the {p.name} phase, other test suites or benchmarks ran: "
              f"{p.neighbours}" for p in phases if p.neighbours]
    notes += [f"WARNING: {p.left_in_flight} victim jobs still in flight "
              f"{DRAIN_TIMEOUT_S:g} s after the {p.name} phase" for p in phases
              if p.left_in_flight]
    notes += [f"Victim submit errors ({name}): {f['submit_errors']}"
              for name, f in (("alone", alone), ("loaded", loaded)) if f["submit_errors"]]
    if hostile.get("started_late_s", 0) > 0.5:
        notes.append(f"WARNING: the hostile load started {hostile['started_late_s']:.1f} s late")
    setup = setup_lines(cfg, bench, wall_s)
    table = (f"{victim_table(alone, loaded)}\n\n### What the hostile tenant did (loaded "
             f"phase)\n\n{hostile_table(hostile)}")
    write_report(RESULTS / f"{cfg.name}.md", "Noisy neighbour: a hostile tenant beside a victim",
                 table, setup, notes)
    plot(RESULTS / f"{cfg.name}.png", phases)
    out = {"benchmark": NAME, "parts": list(cfg.parts or PARTS),
           "victim_submit_p99_ratio": p99_ratio,
           "victim_batch_progress_ratio": progress_ratio, "api_rss_growth_mb": growth,
           "within_2x": bool(p99_ratio <= 2 and progress_ratio >= 0.5),
           "alone": alone, "loaded": loaded, "hostile": hostile,
           "setup": setup, "wall_s": round(wall_s, 1)}
    write_json(RESULTS / f"{cfg.name}.json", out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parsed = parse_args(argv)
    if isinstance(parsed, Path):
        return run_hostile(parsed)
    cfg = parsed
    exit_cleanly_on_signals()
    started = time.monotonic()
    from tidegate_tools.testmodel import build_test_model

    build_test_model(MODEL)  # the API's tokenizer and the sim engine's vocabulary
    tmp = Path(tempfile.mkdtemp(prefix="tidegate-noisy-"))
    log(f"logs under {tmp / 'logs'}")
    with noisy_stack(tmp, cfg) as bench:
        setup = setup_lines(cfg, bench, 0)
        for key, value in setup.items():
            log(f"setup: {key}: {value}")
        log(f"stack ready in {time.monotonic() - started:.0f} s")
        phases = asyncio.run(run_all(bench, cfg, tmp))
        wall_s = time.monotonic() - started
        out = report(cfg, bench, phases, wall_s)
    log(f"wrote {RESULTS}/{cfg.name}.md, .png, .json in {wall_s:.0f} s")
    print((RESULTS / f"{cfg.name}.md").read_text(), flush=True)
    print_json_last(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
