"""Chaos: every accepted job ends, whatever dies on the way, and its consumer sees each
token exactly once.

A mixed load of streaming jobs runs on two vLLM workers of one lane while the benchmark
applies, one after the other, each fault the design promises to survive:

    worker SIGKILL (its process group: supervisor, worker, engine core) -> restarted
    Redis SIGKILL and restart empty (no persistence)                    -> same port
    API SIGKILL and restart                                              -> same port
    PostgreSQL restart (a private cluster, `pg_ctl restart -m immediate`)
    a worker SIGKILLed again                                             -> restarted
    an engine death (the vLLM engine core SIGKILLed, the worker left alone)

A worker fault hits the worker with the most requests in its engine at that moment.

Before each fault the benchmark waits until both workers heartbeat `active` again, so
every fault hits a whole system. Producers retry a refused or failed submit with the same
`Idempotency-Key`; consumers reconnect with `Last-Event-ID`, as the SDK does. Every
consumer checks that its sequence numbers are contiguous and that its text equals the
stored output. Recovery of a job = the longest wait for its next token that the fault
caused (`recoveries`), for the jobs that were streaming when it hit (on the faulted
worker, for worker and engine faults).

    .venv/bin/python bench/chaos.py [--jobs 200] [--faults api,worker]

Writes bench/results/chaos.{md,png,json}; the last stdout line is the JSON summary.
Needs PostgreSQL's server binaries (Debian's postgresql package, /usr/lib/postgresql).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/chaos.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.chaos, then exits

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
from tidegate_client import StreamError
from tidegate_client.client import _SseParser

from bench.common import (
    RESULTS,
    fmt,
    log,
    machine,
    markdown_table,
    percentile,
    print_json_last,
    write_json,
    write_report,
)
from bench.stack import MODEL, exit_cleanly_on_signals, tidegate_env
from tidegate import keys
from tidegate.events import Event
from tidegate.fleet import read_heartbeat
from tidegate.records import WorkerState
from tidegate_tools.procs import (
    Proc,
    free_port,
    start_api,
    start_redis,
    start_worker,
    tidegate_argv,
    wait_until,
)

LANE = "finance"  # FP16 on every machine (an FP8 KV cache may fall back on a CPU)
WORKERS = ("chaos-a@tidegate", "chaos-b@tidegate")
MAX_TOKENS = 160  # seconds of generation: jobs are streaming when a fault hits
SUBMIT_EVERY_S = 0.5  # 2 jobs/s while the faults run: 320 tokens/s, within one worker's reach
# Just before each fault, a burst of long jobs, so that many are streaming when it hits.
BURST_JOBS, BURST_MAX_TOKENS, BURST_LEAD_S = 16, 500, 4.0  # finance: 512 at most
FAULT_GAP_S = 12.0  # at least this long between two faults, once the system is whole
RECOVERY_WINDOW_S = 3.0  # a job "streaming" at a fault had a token this recently
DRAIN_S = 5.0  # a wait that begins this soon after a fault is the fault's (`recoveries`)
SETTLE_S = 240.0  # after the last submit, how long every job has to end
PG_BIN = Path("/usr/lib/postgresql/15/bin")

# ---------------------------------------------------------------- a private PostgreSQL


class PgCluster:
    """A PostgreSQL cluster of the benchmark's own (initdb in a temp dir, trust auth), so a
    restart disturbs nothing else. Run as `postgres` when the benchmark runs as root."""

    def __init__(self, root: Path) -> None:
        self.dir, self.port = root / "pgdata", free_port()
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        self.bin = bins[-1] if bins else PG_BIN
        if not (self.bin / "pg_ctl").exists():
            raise SystemExit(f"chaos needs PostgreSQL's server binaries ({self.bin}): "
                             "apt-get install postgresql")
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        self._run("initdb", "-D", str(self.dir), "-A", "trust", "-U", "postgres", "--no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _ctl(self, *args: str) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.dir), "-o", options,
                  "-l", str(self.dir.parent / "postgres.log"), "-w", *args)

    def start(self) -> None:
        self._ctl("start")

    def restart(self) -> None:
        self._ctl("-m", "immediate", "restart")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ctl("-m", "immediate", "stop")


# ---------------------------------------------------------------- the stack and its faults


@dataclass
class Stack:
    tmp: Path
    env: dict[str, str]
    redis_port: int
    api_port: int
    redis: Proc | None = None
    api: Proc | None = None
    scheduler: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.tmp / "logs"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def procs(self) -> list[Proc]:
        return [p for p in (self.redis, self.scheduler, *self.workers.values(), self.api) if p]

    def start_worker(self, name: str) -> None:
        cores = os.cpu_count() or 1
        self.workers[name] = start_worker(self.env, LANE, name, self.logs,
                                          cpus=str(WORKERS.index(name) % cores))

    def start_api(self) -> None:
        self.api = start_api(self.env, self.api_port, self.logs)

    def start_scheduler(self) -> None:
        self.scheduler = Proc("scheduler", tidegate_argv("scheduler"),
                              self.logs / "scheduler.log", self.env)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, socket_timeout=2, socket_connect_timeout=1)

    def active(self, name: str) -> bool:
        try:
            hb = read_heartbeat(self.client(), self.env["TIDEGATE_NAMESPACE"], name)
        except redis.RedisError:
            return False
        return hb is not None and hb.state == WorkerState.ACTIVE

    def whole(self) -> bool:
        try:
            api_ok = httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            api_ok = False
        return api_ok and all(self.active(name) for name in self.workers)

    def stop(self) -> None:
        for proc in reversed(self.procs()):
            proc.stop()


def kill_group(proc: Proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait()


def engine_cores(proc: Proc) -> list[psutil.Process]:
    root = psutil.Process(proc.popen.pid)
    return [p for p in root.children(recursive=True) if p.name().startswith("VLLM::")]


def busiest(stack: Stack) -> str:
    """The worker with the most requests in its engine now: the fault's target, so that
    a fault on a worker hits jobs mid-generation (the router may have sent the burst to
    either worker)."""
    def running(name: str) -> int:
        hb = read_heartbeat(stack.client(), stack.env["TIDEGATE_NAMESPACE"], name)
        return hb.stats.unfinished if hb is not None and hb.stats is not None else -1
    return max(stack.workers, key=running)


def fault_worker(stack: Stack) -> str:
    name = busiest(stack)
    kill_group(stack.workers[name])
    stack.start_worker(name)  # as an orchestrator would: a new process, the same name
    return name


def fault_redis(stack: Stack) -> str:
    assert stack.redis is not None
    kill_group(stack.redis)
    stack.redis = start_redis(stack.redis_port, stack.logs)  # empty: it keeps nothing
    return ""


def fault_api(stack: Stack) -> str:
    assert stack.api is not None
    kill_group(stack.api)
    stack.start_api()
    return ""


def fault_engine(stack: Stack) -> str:
    name = busiest(stack)
    cores = engine_cores(stack.workers[name])
    if not cores:
        raise RuntimeError(f"no vLLM engine core under worker {name}")
    for core in cores:
        with contextlib.suppress(psutil.NoSuchProcess):
            core.kill()
    return name


# ---------------------------------------------------------------- producers and consumers


@dataclass
class Job:
    n: int
    max_tokens: int
    submitted_at: float = 0.0
    job_id: str | None = None
    worker: str | None = None  # from its `started` event
    tokens: list[float] = field(default_factory=list)  # arrival time of each token event
    text: str = ""
    completion_tokens: int = 0
    last_seq: int = -1
    duplicates: int = 0
    gaps: int = 0
    end: str | None = None  # "done" or "error:<code>"
    end_at: float | None = None
    refused: str | None = None  # a submit the API refused for good (4xx)
    faults_seen: list[str] = field(default_factory=list)  # seq anomalies, for the report
    bench_error: str | None = None  # the benchmark's own client failed on this job
    connects: list[tuple[float, str]] = field(default_factory=list)  # SSE tries: when, outcome
    token_seqs: list[int] = field(default_factory=list)  # beside `tokens`

    def on_event(self, event: Event, now: float) -> None:
        if event.seq <= self.last_seq:
            self.duplicates += 1
            self.faults_seen.append(f"seq {event.seq} again after {self.last_seq}")
            return
        if event.seq != self.last_seq + 1:
            self.gaps += event.seq - self.last_seq - 1
            self.faults_seen.append(f"seq {event.seq} after {self.last_seq} ({event.kind})")
        self.last_seq = event.seq
        if event.kind == "started":
            self.worker = str(event.data.get("worker"))
        elif event.kind == "token":
            self.tokens.append(now)
            self.token_seqs.append(event.seq)
            self.text += event.text
            self.completion_tokens += len(event.token_ids)
        elif event.terminal:
            code = event.data.get("code") or event.data.get("finish_reason")
            self.end = "done" if event.kind == "done" else f"error:{code}"
            self.end_at = now


def prompt(n: int) -> str:
    topics = ("ledger", "refunds", "invoices", "cash", "payroll", "audit", "fx", "vendors")
    return f"Job {n}. Summarise the {topics[n % len(topics)]} position for account {n} briefly."


async def submit(http: httpx.AsyncClient, job: Job, give_up_at: float) -> None:
    """POST until accepted: refused (429/503) or unreachable means try again, with the same
    Idempotency-Key so a submit that did land before a crash is not made twice."""
    body = {"lane": LANE, "prompt": prompt(job.n), "max_tokens": job.max_tokens,
            "temperature": 0.8, "seed": job.n}
    headers = {"Idempotency-Key": f"chaos-{uuid.uuid4().hex}"}
    job.submitted_at = time.monotonic()
    while time.monotonic() < give_up_at:
        try:
            resp = await http.post("/v1/jobs", json=body, headers=headers)
        except httpx.HTTPError:
            await asyncio.sleep(0.25)
            continue
        if resp.status_code in (429, 503):
            await asyncio.sleep(min(float(resp.headers.get("retry-after", "1")), 2.0))
            continue
        if resp.status_code >= 400:
            job.refused = f"{resp.status_code} {resp.text[:200]}"
            return
        job.job_id = resp.json()["job_id"]
        return


async def consume(http: httpx.AsyncClient, job: Job, give_up_at: float) -> None:
    """Reads the job's events to its end, reconnecting after the last one it kept."""
    while job.end is None and time.monotonic() < give_up_at:
        headers = {"Last-Event-ID": str(job.last_seq)} if job.last_seq >= 0 else {}
        try:
            async with http.stream("GET", f"/v1/jobs/{job.job_id}/events", headers=headers,
                                   timeout=httpx.Timeout(10.0, read=60.0)) as resp:
                job.connects.append((time.monotonic(), str(resp.status_code)))
                if resp.status_code != 200:
                    await resp.aread()
                    wait_s = float(resp.headers.get("retry-after", "0.25"))
                else:
                    wait_s = 0.25
                    await read_events(resp, job)
        except httpx.HTTPError as exc:
            job.connects.append((time.monotonic(), type(exc).__name__))
            wait_s = 0.25
        if job.end is None:
            await asyncio.sleep(min(wait_s, 2.0))


async def read_events(resp: httpx.Response, job: Job) -> None:
    """The SDK's own SSE parser: the API's own `error` event (no id) raises StreamError;
    `reconnect` and `unavailable` mean reconnect, any other code ends the job's reading."""
    parser = _SseParser()
    async for line in resp.aiter_lines():
        try:
            event = parser.feed(line)
        except StreamError as exc:
            if exc.code not in ("reconnect", "unavailable"):
                job.end, job.end_at = f"stream:{exc.code}", time.monotonic()
            return
        if event is not None:
            job.on_event(event, time.monotonic())
            if job.end is not None:
                return


async def one_job(http: httpx.AsyncClient, job: Job, give_up_at: float) -> None:
    """Submit, then read to the end; a job not ended by `give_up_at` counts as lost (a
    stream that only sends keep-alives would otherwise be read forever)."""
    async def run() -> None:
        await submit(http, job, give_up_at)
        if job.job_id is not None:
            await consume(http, job, give_up_at)

    try:
        await asyncio.wait_for(run(), timeout=give_up_at - time.monotonic())
    except TimeoutError:
        pass
    except Exception as exc:  # one consumer's surprise must not end the run: report it
        job.bench_error = f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the run


@dataclass
class Fault:
    name: str
    at: float  # monotonic
    target: str = ""  # the worker, for worker and engine faults
    took_s: float = 0.0  # how long applying it took (a restart's start included)


FAULTS: dict[str, tuple[str, Callable[[Stack], str]]] = {
    "worker": ("worker SIGKILL", lambda stack: fault_worker(stack)),
    "redis": ("Redis restart, empty", lambda stack: fault_redis(stack)),
    "api": ("API SIGKILL + restart", lambda stack: fault_api(stack)),
    "pg": ("PostgreSQL restart", lambda stack: pg_restart(stack)),
    "engine": ("engine death", lambda stack: fault_engine(stack)),
}
PLAN = ("worker", "redis", "api", "pg", "worker", "engine")  # the six, in order


async def apply_faults(stack: Stack, faults: list[Fault], t0: float, plan: list[str],
                       burst: Callable[[], Awaitable[None]]) -> None:
    for key in plan:
        name, apply_to = FAULTS[key]
        await asyncio.sleep(FAULT_GAP_S)
        await wait_whole(stack)
        await burst()  # long jobs streaming on both workers when the fault hits
        at = time.monotonic()
        target = await asyncio.to_thread(apply_to, stack)
        faults.append(Fault(name, at, target, time.monotonic() - at))
        log(f"fault at {at - t0:6.1f} s: {name} {target}".rstrip())


pg_restart_fn: list[Any] = []  # set in main: the cluster's restart


def pg_restart(_stack: Stack) -> str:
    pg_restart_fn[0]()
    return ""


async def wait_whole(stack: Stack) -> None:
    started = time.monotonic()
    while not await asyncio.to_thread(stack.whole):
        if time.monotonic() - started > 300:
            raise RuntimeError("the stack did not come back whole in 300 s: "
                               + ", ".join(f"{p.name} alive={p.alive()}" for p in stack.procs()))
        await asyncio.sleep(0.5)


async def run_load(stack: Stack, min_jobs: int,
                   plan: list[str]) -> tuple[list[Job], list[Fault], float]:
    # SIGTERM/SIGINT cancel the load, so the stack's `finally` stops every process (a
    # SystemExit raised by a plain signal handler does not get out of the event loop).
    main_task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert main_task is not None
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, main_task.cancel)
    faults: list[Fault] = []
    jobs: list[Job] = []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=stack.base_url, limits=limits, timeout=10.0,
                                 headers={"Authorization": f"Bearer {stack.env['CHAOS_KEY']}"}
                                 ) as http:
        tasks: list[asyncio.Task[None]] = []

        def start(max_tokens: int) -> None:
            job = Job(len(jobs), max_tokens=max_tokens)
            jobs.append(job)
            tasks.append(asyncio.create_task(one_job(http, job, time.monotonic() + SETTLE_S)))

        async def burst() -> None:
            for _ in range(BURST_JOBS):
                start(BURST_MAX_TOKENS)
            await asyncio.sleep(BURST_LEAD_S)

        fault_task = asyncio.create_task(apply_faults(stack, faults, t0, plan, burst))
        while not fault_task.done() or len(jobs) < min_jobs:
            start(MAX_TOKENS)
            await asyncio.sleep(SUBMIT_EVERY_S)
        await fault_task  # raises if the stack did not come back
        log(f"all faults applied; {len(jobs)} jobs submitted; waiting for every job to end")
        await asyncio.gather(*tasks)
    return jobs, faults, t0


# ---------------------------------------------------------------- figures


def recoveries(jobs: list[Job], fault: Fault) -> list[float]:
    """For each job streaming when the fault hit (on the faulted worker, for worker and
    engine faults): the longest wait for its next token that the fault caused, from the
    fault or from the token before, whichever is later; the job's end counts as a token,
    a job that never ended waited forever. Waits that begin up to DRAIN_S after the fault
    count too: tokens already on their way (socket buffers, a dead process's last writes)
    arrive just after a fault and would otherwise hide the stall behind them."""
    return [longest_wait(job, fault.at) for job in streaming_at(jobs, fault)]


def streaming_at(jobs: list[Job], fault: Fault) -> list[Job]:
    out = []
    for job in jobs:
        if fault.target and job.worker != fault.target:
            continue
        if job.end_at is not None and job.end_at < fault.at:
            continue
        if any(fault.at - RECOVERY_WINDOW_S <= t < fault.at for t in job.tokens):
            out.append(job)
    return out


def longest_wait(job: Job, at: float) -> float:
    begin, end = longest_wait_span(job, at)
    return end - begin


def longest_wait_span(job: Job, at: float) -> tuple[float, float]:
    """(from, to) of `longest_wait`: `to` is inf for a job that never ended."""
    arrivals = sorted(job.tokens + ([job.end_at] if job.end_at is not None else []))
    before = [t for t in arrivals if t < at]
    after = [t for t in arrivals if t >= at]
    if not after:
        return (at, float("inf"))
    spans, previous = [], before[-1] if before else at
    for t in after:
        if previous >= at + DRAIN_S:
            break
        spans.append((max(previous, at), t))
        previous = t
    return max(spans, key=lambda span: span[1] - span[0])


def slowest_recovery(client: redis.Redis, ns: str, jobs: list[Job], fault: Fault,
                     wall_minus_mono: float) -> dict[str, Any] | None:
    """Where the fault's longest wait went, for the report: the consumer's SSE tries around
    it, and whether the token that ended it was late to be written (the engine or its
    worker stalled) or late to arrive (the API or the consumer did): the worker stamps
    each stream entry with its write time."""
    streaming = streaming_at(jobs, fault)
    if not streaming:
        return None
    job = max(streaming, key=lambda j: longest_wait(j, fault.at))
    begin, end = longest_wait_span(job, fault.at)
    out: dict[str, Any] = {
        "job_id": job.job_id, "worker": job.worker, "wait_s": round(end - begin, 2),
        "from_s": round(begin - fault.at, 2), "to_s": round(end - fault.at, 2),
        "sse_tries": [(round(t - fault.at, 2), what) for t, what in job.connects
                      if begin - 1 <= t <= end + 1][:20]}
    if end in job.tokens:
        seq = job.token_seqs[job.tokens.index(end)]
        entries: Any = client.xrange(keys.job_events(ns, str(job.job_id)),
                                     keys.stream_id(seq), keys.stream_id(seq))
        if entries and b"t" in entries[0][1]:
            written = float(entries[0][1][b"t"]) - wall_minus_mono
            out["next_token_written_s"] = round(written - fault.at, 2)
    return out


def stored_outputs(db_url: str, jobs: list[Job]) -> dict[str, tuple[str, str, int | None]]:
    from store import Store

    store, out = Store(db_url), {}
    for job in jobs:
        if job.job_id and (row := store.jobs.get_job(job.job_id)) is not None:
            out[job.job_id] = (row.status, row.output_text or "", row.completion_tokens)
    return out


def figures(jobs: list[Job], faults: list[Fault], stored: dict[str, Any]) -> dict[str, Any]:
    accepted = [j for j in jobs if j.job_id]
    mismatches = [j for j in accepted if j.end == "done"
                  and (j.job_id not in stored or stored[j.job_id][1] != j.text)]
    per_fault = [(f, recoveries(jobs, f)) for f in faults]
    every = [r for _, rs in per_fault for r in rs]
    return {
        "jobs": len(accepted), "done": sum(j.end == "done" for j in accepted),
        "lost": sum(j.end is None for j in accepted),
        "errors": sum(1 for j in accepted if j.end and j.end != "done"),
        "error_ends": sorted({str(j.end) for j in accepted if j.end and j.end != "done"}),
        "refused": sum(1 for j in jobs if j.refused),
        "never_accepted": sum(1 for j in jobs if not j.job_id and not j.refused),
        "bench_errors": sum(1 for j in jobs if j.bench_error),
        "duplicates": sum(j.duplicates for j in accepted), "gaps": sum(j.gaps for j in accepted),
        "text_mismatches": len(mismatches),
        "mismatched": [j.job_id for j in mismatches],
        "max_recovery_s": round(max(every), 2) if every else None,
        "p99_recovery_s": round(percentile(every, 99), 2) if every else None,
        "faults": [{"fault": f.name, "target": f.target, "jobs_streaming": len(rs),
                    "max_recovery_s": round(max(rs), 2) if rs else None,
                    "p50_recovery_s": round(percentile(rs, 50), 2) if rs else None,
                    "recoveries_s": sorted(round(r, 2) for r in rs)}
                   for f, rs in per_fault],
    }


def table(fig: dict[str, Any], faults: list[Fault], t0: float) -> str:
    nan = float("nan")
    rows = [[f["fault"] + (f" ({f['target'].split('@')[0]})" if f["target"] else ""),
             fmt(fault.at - t0), str(f["jobs_streaming"]),
             fmt(nan if f["p50_recovery_s"] is None else f["p50_recovery_s"], 2),
             fmt(nan if f["max_recovery_s"] is None else f["max_recovery_s"], 2)]
            for f, fault in zip(fig["faults"], faults, strict=True)]
    faults_md = markdown_table(["fault", "at s", "jobs streaming", "p50 recovery s",
                                "max recovery s"], rows)
    totals = markdown_table(
        ["jobs", "done", "lost", "errors", "duplicates", "gaps", "text mismatches",
         "max recovery s", "p99 recovery s"],
        [[str(fig[k]) for k in ("jobs", "done", "lost", "errors", "duplicates", "gaps",
                                "text_mismatches", "max_recovery_s", "p99_recovery_s")]])
    return totals + "\n\n" + faults_md


def plot(path: Path, jobs: list[Job], faults: list[Fault], t0: float) -> None:
    """Tokens received per second over the run, a line at each fault."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = sorted(t - t0 for j in jobs for t in j.tokens)
    end = int(times[-1]) + 1 if times else 1
    bins = [0] * end
    for t in times:
        bins[int(t)] += 1
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot(range(end), bins, lw=1, color="tab:blue", label="token events received / s")
    for f in faults:
        ax.axvline(f.at - t0, color="tab:red", lw=1, ls="--")
        ax.text(f.at - t0, max(bins or [1]) * 0.95, f.name, rotation=90, va="top", ha="right",
                fontsize=8, color="tab:red")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("token events / s")
    ax.set_title(f"chaos: token flow through {len(faults)} faults")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


@contextlib.contextmanager
def chaos_stack(tmp: Path, pg: PgCluster) -> Iterator[Stack]:
    from store import Store, upgrade

    upgrade(pg.url)
    _, key = Store(pg.url).tenants.create_tenant("chaos", [LANE])
    redis_port = free_port()
    env = {**tidegate_env(pg.url, slots=64),
           "TIDEGATE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "TIDEGATE_HEARTBEAT_S": "1", "CHAOS_KEY": key,
           # One tenant carries the whole load, and after an outage its backlog holds more
           # streams than the default per-tenant cap (100): the bench measures faults, not
           # the cap, so the cap is raised to the API's whole one.
           "TIDEGATE_SSE_MAX_STREAMS_PER_TENANT": "1000"}
    stack = Stack(tmp, env, redis_port, free_port())
    try:
        stack.redis = start_redis(redis_port, stack.logs)
        for name in WORKERS:
            stack.start_worker(name)
        stack.start_scheduler()
        stack.start_api()
        wait_until(stack.whole, 300, "the API and both workers", stack.procs(), poll_s=1)
        yield stack
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="at least this many jobs")
    parser.add_argument("--faults", default=",".join(PLAN),
                        help="faults to apply, in order, from: " + ", ".join(FAULTS)
                        + "; a run other than the default writes chaos-<faults>.*")
    args = parser.parse_args()
    plan = [key.strip() for key in args.faults.split(",") if key.strip()]
    if unknown := [key for key in plan if key not in FAULTS]:
        parser.error(f"--faults: unknown {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    stem = "chaos" if tuple(plan) == PLAN else "chaos-" + "-".join(plan)
    exit_cleanly_on_signals()
    tmp = Path(tempfile.mkdtemp(prefix="tidegate-chaos-"))
    log(f"chaos: logs in {tmp / 'logs'}; model {MODEL}")
    pg = PgCluster(Path(tempfile.mkdtemp(prefix="tidegate-chaos-pg-")))
    pg.start()
    pg_restart_fn.append(pg.restart)
    try:
        with chaos_stack(tmp, pg) as stack:
            log("stack whole; load and faults start")
            jobs, faults, t0 = asyncio.run(run_load(stack, args.jobs, plan))
            died = [p.name for p in stack.procs() if not p.alive()]
            wall_minus_mono = time.time() - time.monotonic()
            slowest = [slowest_recovery(stack.client(), stack.env["TIDEGATE_NAMESPACE"], jobs,
                                        fault, wall_minus_mono) for fault in faults]
        stored = stored_outputs(pg.url, jobs)
    finally:
        pg.stop()
    fig = figures(jobs, faults, stored)
    fig["died_at_end"] = died
    for entry, fault, detail in zip(fig["faults"], faults, slowest, strict=True):
        entry["applied_in_s"] = round(fault.took_s, 2)  # a restart's start included
        entry["slowest"] = detail
    report(fig, jobs, faults, t0, tmp, stem)
    return 0 if fig["lost"] == fig["duplicates"] == fig["gaps"] == fig["text_mismatches"] == 0 \
        else 1


def report(fig: dict[str, Any], jobs: list[Job], faults: list[Fault], t0: float,
           tmp: Path, stem: str) -> None:
    setup = {**machine(), "lane": LANE, "workers": ", ".join(WORKERS),
             "max_tokens": MAX_TOKENS, "arrivals": f"one job every {SUBMIT_EVERY_S} s",
             "store": "PostgreSQL (a private cluster)", "logs": str(tmp / "logs")}
    notes = [f"{job.job_id}: {job.end or 'never ended'} {job.bench_error or ''}".rstrip()
             for job in jobs if job.job_id and job.end != "done"][:20]
    notes += [f"refused: {job.refused}" for job in jobs if job.refused][:5]
    notes += [f"{job.job_id} on {job.worker}, first token at {job.tokens[0] - t0:.1f} s: "
              f"{'; '.join(job.faults_seen)}"
              for job in jobs if job.faults_seen and job.tokens][:20]
    notes += [f"{job.job_id} on {job.worker}: text differs from the store ({len(job.text)} "
              f"characters received, {job.completion_tokens} tokens)"
              for job in jobs if job.job_id in fig.get("mismatched", [])]
    write_report(RESULTS / f"{stem}.md", f"Chaos: {len(faults)} faults under a streaming load",
                 table(fig, faults, t0), setup, notes)
    plot(RESULTS / f"{stem}.png", jobs, faults, t0)
    write_json(RESULTS / f"{stem}.json", {**fig, "setup": setup})
    print(table(fig, faults, t0))
    print_json_last({k: v for k, v in fig.items() if k not in ("faults", "mismatched")})


if __name__ == "__main__":
    sys.exit(main())
