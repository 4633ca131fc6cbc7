"""What the benchmarks that race tidegate against vLLM's own OpenAI server share: starting
each system on this machine (and stopping it on the way out), one request as the client
times it, the load loop, and the per-request summary.

Timing is on the client: TTFT = first token received - submit start; TPOT = (last token -
first token) / (tokens - 1). A failed or hung request becomes a sample with an error.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tidegate_client import AsyncClient

from bench.common import (
    RESULTS,
    ROOT,
    fmt,
    log,
    machine,
    median,
    percentile,
    plot_distributions,
    print_json_last,
    write_json,
    write_report,
)
from tidegate_tools.pg import private_database
from tidegate_tools.procs import Proc, free_port, wait_until
from tidegate_tools.stack import WorkerSpec, running_stack

MODEL = ROOT / "data" / "models" / "tidegate-test"
DTYPE = "float16"
MAX_TOKENS = 32  # the test checkpoint never emits EOS: every request yields exactly this
TEMPERATURE = 0.8  # no per-request seed: see SEED_NOTE
MAX_MODEL_LEN = 2048
KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE for every engine
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 180.0  # a hang guard: a queued 256-token request on 2 cores waits long
NAMESPACE = "tgbench"

SEED_NOTE = ("Requests carry no seed: on this vLLM CPU build a seeded request whose prefill "
             "gets chunked kills the engine core ('CPU Generator does not use offset'), which "
             "many prompts arriving at once trigger on vLLM's server.")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    lane: str  # tidegate's lane; the peer has none and ignores it
    max_tokens: int = MAX_TOKENS  # generated to the end: the checkpoint emits no EOS


@dataclass
class Sample:
    """One request as the client saw it."""

    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    tokens: int = 0
    error: str | None = None
    submit_ms: float = math.nan  # tidegate only: POST /v1/jobs until its 202
    server: dict[str, float] = field(default_factory=dict)  # what the server reported
    lane: str = ""


@dataclass
class Round:
    samples: list[Sample]
    wall_s: float

    def tokens_per_s(self, lane: str | None = None) -> float:
        return sum(s.tokens for s in self.samples if lane in (None, s.lane)) / self.wall_s


class Arrivals:
    """Token arrival times of one request, from its submit start."""

    def __init__(self, expected: int = MAX_TOKENS) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0
        self.expected = expected

    def add(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        self.first = now if self.first is None else self.first
        self.last, self.tokens = now, self.tokens + n

    def sample(self) -> Sample:
        if self.first is None:
            return Sample(error="no token received")
        tpot = (self.last - self.first) * 1000 / (self.tokens - 1) if self.tokens > 1 else math.nan
        error = (None if self.tokens == self.expected
                 else f"{self.tokens} tokens, not {self.expected}")
        return Sample((self.first - self.start) * 1000, tpot, self.tokens, error)


RequestFn = Callable[[RequestSpec], Awaitable[Sample]]
# A fresh HTTP client per round: a keep-alive connection left idle between rounds can be
# closed by the server (uvicorn: 5 s) just as it is reused, which fails that request.
Session = Callable[[], AbstractAsyncContextManager[RequestFn]]
Plan = Callable[[int], list[RequestSpec]]  # round number (0 = warm-up) -> its requests


# ---------------------------------------------------------------- load generation


async def guarded(fn: RequestFn, spec: RequestSpec, delay_s: float = 0.0) -> Sample:
    """A failed or hung request becomes a sample with an error, never a crashed round."""
    await asyncio.sleep(delay_s)  # before the clock starts: TTFT counts from its own submit
    try:
        sample = await asyncio.wait_for(fn(spec), REQUEST_TIMEOUT_S)
    except TimeoutError:
        sample = Sample(error=f"no answer within {REQUEST_TIMEOUT_S:.0f} s")
    except Exception as exc:  # noqa: BLE001 - reported per request
        sample = Sample(error=f"{type(exc).__name__}: {exc}"[:300])
    sample.lane = spec.lane
    return sample


async def run_round(session: Session, specs: Sequence[RequestSpec], pace_s: float) -> Round:
    """All `specs` in flight together, launched in order, evenly spread over `pace_s`."""
    step = pace_s / len(specs) if specs else 0.0
    async with session() as fn:
        start = time.perf_counter()
        samples = await asyncio.gather(*(guarded(fn, s, i * step) for i, s in enumerate(specs)))
        return Round(list(samples), time.perf_counter() - start)


async def run_load(name: str, session: Session, plan: Plan, rounds: int,
                   pace_s: float = 0.0) -> list[Round]:
    """A warm-up round (plan(0)), not kept, then `rounds` measured rounds."""
    warm = await run_round(session, plan(0), pace_s)
    log(f"{name}: warm-up {len(warm.samples)} requests in {warm.wall_s:.2f} s, "
        f"{sum(s.error is not None for s in warm.samples)} errors")
    measured = []
    for round_no in range(1, rounds + 1):
        r = await run_round(session, plan(round_no), pace_s)
        ok = [s.ttft_ms for s in r.samples if s.error is None]
        log(f"{name}: round {round_no}: {r.tokens_per_s():,.0f} tokens/s, wall {r.wall_s:.2f} s, "
            f"TTFT p50 {fmt(median(ok))} ms, {len(r.samples) - len(ok)} errors")
        measured.append(r)
    return measured


LoadFn = Callable[[Session], Coroutine[Any, Any, list[Round]]]


# ---------------------------------------------------------------- tidegate


async def tidegate_request(client: AsyncClient, spec: RequestSpec) -> Sample:
    clock = Arrivals(spec.max_tokens)
    job = await client.submit(spec.lane, prompt=spec.prompt, max_tokens=spec.max_tokens,
                              temperature=TEMPERATURE)
    submit_ms = (time.perf_counter() - clock.start) * 1000
    expected_seq, done = 0, None
    async for event in client.stream(job["job_id"]):
        if event.seq != expected_seq:  # the API promises contiguous seqs, exactly once
            raise RuntimeError(f"event seq {event.seq}, expected {expected_seq}")
        expected_seq += 1
        if event.kind == "token":
            clock.add(len(event.token_ids))
        elif event.kind == "error":
            raise RuntimeError(f"error event: {event.data}")
        elif event.kind == "done":
            done = event.data
    sample = check_done(clock.sample(), done)
    sample.submit_ms = submit_ms
    return sample


def check_done(sample: Sample, done: dict[str, Any] | None) -> Sample:
    """The server's own count must match what arrived: a lost or doubled token is an error."""
    if done is None:
        sample.error = sample.error or "stream ended without a done event"
        return sample
    reported = (done.get("usage") or {}).get("completion_tokens")
    if reported != sample.tokens:
        sample.error = sample.error or f"received {sample.tokens} tokens, usage says {reported}"
    sample.server = {k: float(done[k]) for k in ("ttft_ms", "tpot_ms", "queue_wait_ms")
                     if done.get(k) is not None}
    return sample


def tidegate_env(db_url: str, slots: int) -> dict[str, str]:
    """The benchmark's settings; the stack launcher adds its private Redis."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path,
            "TIDEGATE_DATABASE_URL": db_url, "TIDEGATE_DATA_DIR": str(ROOT / "data"),
            "TIDEGATE_MODEL": str(MODEL), "TIDEGATE_NAMESPACE": NAMESPACE,
            "TIDEGATE_LANES_FILE": str(ROOT / "tidegate" / "lanes.toml"),
            "TIDEGATE_ENGINE_SLOTS": str(slots),
            "TIDEGATE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "TIDEGATE_KV_CACHE_GIB": KV_CACHE_GIB, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}


@contextmanager
def bench_database(tmp: Path, postgresql: bool) -> Iterator[str]:
    """A private database for one run: a SQLite file, or with `postgresql` a database of its
    own on the PostgreSQL at 127.0.0.1:5432 (dropped afterwards), as production runs."""
    if not postgresql:
        yield f"sqlite:///{tmp / 'tidegate.db'}"
        return
    from sqlalchemy.exc import OperationalError

    try:
        with private_database("tidegate_bench") as url:
            yield url
    except OperationalError as exc:
        raise SystemExit(f"this benchmark needs PostgreSQL at 127.0.0.1:5432: {exc}") from None


@contextmanager
def tidegate_stack(tmp: Path, workers: Mapping[str, str] | Sequence[tuple[str, str]],
                   slots: int, env: Mapping[str, str] | None = None, pin: bool = False,
                   postgresql: bool = False, lanes: Sequence[str] = (),
                   ) -> Iterator[tuple[str, str, list[Proc]]]:
    """Private Redis and database, the workers (lane -> worker name, or (lane, name) pairs
    for several workers of a lane) with `slots` engine slots each, the API; all stopped on
    the way out. `env`: settings on top of the benchmark's own (TIDEGATE_*). `pin`: each
    worker's engine on a core of its own, round robin (left alone, all bind to core 0).
    `postgresql`: the store on PostgreSQL (bench_database), else a SQLite file. The tenant
    may use the workers' lanes and `lanes` (lanes served by other lanes' workers)."""
    from store import Store, upgrade

    pairs = list(workers.items()) if isinstance(workers, Mapping) else list(workers)
    cores = os.cpu_count() or 1
    specs = [WorkerSpec(lane, name, cpus=str(i % cores) if pin else None)
             for i, (lane, name) in enumerate(pairs)]
    with bench_database(tmp, postgresql) as db_url:
        upgrade(db_url)
        _, key = Store(db_url).tenants.create_tenant(
            "bench", sorted({lane for lane, _ in pairs} | set(lanes)))
        full_env = {**tidegate_env(db_url, slots), **(env or {})}
        with running_stack(full_env, specs, tmp / "logs", private_redis=True,
                           timeout_s=START_TIMEOUT_S) as stack:
            yield stack.base_url, key, stack.procs


def tidegate_session(base: str, key: str) -> Session:
    @asynccontextmanager
    async def session() -> AsyncIterator[RequestFn]:
        client = AsyncClient(base, key, timeout_s=60)  # the SDK, as a producer would use it
        try:
            yield lambda spec: tidegate_request(client, spec)
        finally:
            await client.aclose()

    return session


def measure_tidegate(tmp: Path, workers: Mapping[str, str], slots: int, load: LoadFn,
                     postgresql: bool = False,
                     session: Callable[[str, str], Session] | None = None,
                     env: Mapping[str, str] | None = None, lanes: Sequence[str] = (),
                     ) -> tuple[list[Round], dict[str, str]]:
    """The load on a tidegate stack; `session` (base URL, API key -> a Session): how the
    requests go in (default: the SDK, POST /v1/jobs and SSE); `env`: settings on top."""
    store = "PostgreSQL" if postgresql else "SQLite"
    log(f"tidegate: starting Redis, {store}, workers {dict(workers)} ({slots} slots each), API")
    start = time.monotonic()
    with tidegate_stack(tmp, workers, slots, env=env, postgresql=postgresql,
                        lanes=lanes) as (base, key, procs):
        log(f"tidegate: ready in {time.monotonic() - start:.0f} s")
        info = {"load_before": load_average()}
        rounds = asyncio.run(watched(load((session or tidegate_session)(base, key)), info))
        alive = {p.name: p.alive() for p in procs}
        worker_logs = [p.log_path for p in procs if p.name.startswith("worker:")]
    if not all(alive.values()):
        log(f"tidegate: processes that died during the load: {alive}")
    info |= engines_printed(worker_logs)
    info["died"] = ", ".join(name for name, ok in alive.items() if not ok)
    return rounds, info


# ---------------------------------------------------------------- vLLM's OpenAI server


def _chunk_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if choice.get("text") else 0  # a server without return_token_ids


async def completion_chunks(http: httpx.AsyncClient,
                            body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed POST /v1/completions (OpenAI's wire format)."""
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data != "[DONE]":
                yield json.loads(data)


async def peer_request(http: httpx.AsyncClient, spec: RequestSpec) -> Sample:
    body = {"model": str(MODEL), "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": TEMPERATURE, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    clock, usage = Arrivals(spec.max_tokens), None
    async for chunk in completion_chunks(http, body):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            clock.add(_chunk_tokens(choice))
    return check_done(clock.sample(), {"usage": usage} if usage else None)


def peer_healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def peer_server(tmp: Path, max_num_seqs: int) -> Iterator[tuple[str, Proc]]:
    """`vllm serve` fails with the vllm-cpu distribution; the module entry point works.
    Default scheduling: first come, first served."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
            "--dtype", DTYPE, "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    proc = Proc("vllm-server", argv, tmp / "logs" / "vllm-server.log", env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: peer_healthy(base), START_TIMEOUT_S,
                   f"vLLM's OpenAI server GET {base}/health to answer 200", [proc], poll_s=0.5)
        yield base, proc
    finally:
        proc.stop()


def peer_session(base: str, max_connections: int) -> Session:
    @asynccontextmanager
    async def session() -> AsyncIterator[RequestFn]:
        limits = httpx.Limits(max_connections=max_connections)
        timeout = httpx.Timeout(60.0, read=None)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
            yield lambda spec: peer_request(http, spec)

    return session


def measure_peer(tmp: Path, max_num_seqs: int, max_connections: int,
                 load: LoadFn) -> tuple[list[Round], dict[str, str]]:
    log(f"vLLM server: starting python -m vllm.entrypoints.openai.api_server ({DTYPE}, "
        f"--max-num-seqs {max_num_seqs})")
    start = time.monotonic()
    with peer_server(tmp, max_num_seqs) as (base, proc):
        log(f"vLLM server: ready in {time.monotonic() - start:.0f} s")
        info = {"load_before": load_average()}
        rounds = asyncio.run(watched(load(peer_session(base, max_connections)), info))
        info["died"] = "" if proc.alive() else proc.name
    info |= engines_printed([proc.log_path])
    return rounds, info


def load_average() -> str:
    """Other work on the machine skews both systems: recorded so a noisy run shows."""
    return f"{os.getloadavg()[0]:.2f}"


NEIGHBOUR_MARKS = ("pytest", "bench/e2e.py", "bench/lanes.py")  # work that loads every core


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # ppid; the name may hold spaces
    return pids


def busy_neighbours() -> list[str]:
    """Test suites and benchmarks run by others on this machine right now (not this one or
    the shell that started it): a run that overlapped one is noted in its report."""
    mine, found = _ancestors(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in argv for mark in NEIGHBOUR_MARKS):
            found.append(f"pid {entry.name}: {argv.strip()[:80]}")
    return found


async def watched(load: Awaitable[list[Round]], info: dict[str, str]) -> list[Round]:
    """Runs `load`, noting in `info` any neighbour seen before or after it."""
    before = busy_neighbours()
    rounds = await load
    seen = sorted(set(before) | set(busy_neighbours()))
    info["neighbours"] = "; ".join(seen)
    return rounds


def _printed(log_path: Path, pattern: str) -> str:
    try:
        found = re.findall(pattern, log_path.read_text(errors="replace"))
    except OSError:
        return "unknown"
    return found[-1] if found else "unknown"


def prefix_caching(log_path: Path) -> str:
    """The setting the engine printed at start: both systems must run with the same one."""
    return _printed(log_path, r"enable_prefix_caching=(\w+)")


def engine_cores(log_path: Path) -> str:
    """The cores vLLM's CPU backend bound the engine's OpenMP threads to (it keeps one core
    for the rest by default): engines bound to the same core share it."""
    return _printed(log_path, r"core ids=\[([^\]]*)\]")


def engines_printed(logs: Sequence[Path]) -> dict[str, str]:
    return {"prefix_caching": " / ".join(sorted({prefix_caching(p) for p in logs})),
            "engine_cores": " / ".join(engine_cores(p) for p in logs)}


# ---------------------------------------------------------------- summaries


def summarize(rounds: list[Round], lane: str | None = None) -> dict[str, Any]:
    """Latency percentiles pool every measured request (of `lane`, or all); errored ones are
    counted, not timed. tokens/s: the median over rounds of tokens received / round wall."""
    samples = [s for r in rounds for s in r.samples if lane in (None, s.lane)]
    ok = [s for s in samples if s.error is None]
    ttft, tpot = [s.ttft_ms for s in ok], [s.tpot_ms for s in ok]
    per_round = [r.tokens_per_s(lane) for r in rounds]
    return {
        "tokens_per_s": median(per_round),
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
        "requests": len(samples), "errors": len(samples) - len(ok),
        "tokens": sum(s.tokens for s in samples),
        "round_tokens_per_s": per_round,
        "round_wall_s": [r.wall_s for r in rounds],
        "error_examples": sorted({s.error for s in samples if s.error})[:5],
    }


def ttfts(rounds: list[Round], lane: str | None = None) -> list[float]:
    return [s.ttft_ms for r in rounds for s in r.samples
            if s.error is None and lane in (None, s.lane)]


def tidegate_phases(rounds: list[Round], lane: str | None = None) -> dict[str, float]:
    """Where a tidegate request's time goes: the client's submit (POST until 202) and the
    worker's own TTFT and queue wait from the done events, to set beside the client TTFT."""
    samples = [s for r in rounds for s in r.samples
               if s.error is None and lane in (None, s.lane)]
    series = {"submit": [s.submit_ms for s in samples],
              "after_202": [s.ttft_ms - s.submit_ms for s in samples]}  # 202 to first token
    for key in ("ttft_ms", "queue_wait_ms"):
        series[f"server_{key.removesuffix('_ms')}"] = [s.server[key] for s in samples
                                                       if key in s.server]
    return {f"{name}_p{q}_ms": percentile(values, q)
            for name, values in series.items() for q in (50, 99)}


def phases_note(phases: Mapping[str, float], who: str = "tidegate") -> str:
    def p50_p99(name: str) -> str:
        return (f"p50 {fmt(phases[f'{name}_p50_ms'])} ms, "
                f"p99 {fmt(phases[f'{name}_p99_ms'])} ms")

    return (f"{who}, inside the client TTFT: submit (POST /v1/jobs until 202) "
            f"{p50_p99('submit')}; from the 202 to the first token on the SSE stream "
            f"{p50_p99('after_202')}; the worker's own TTFT (done event) "
            f"{p50_p99('server_ttft')}; queue wait {p50_p99('server_queue_wait')}.")


# ---------------------------------------------------------------- run and report


@dataclass
class Measured:
    """Both systems' measured rounds and what was recorded around them."""

    tide: list[Round]
    peer: list[Round]
    tide_info: dict[str, str]
    peer_info: dict[str, str]
    wall_s: float


MeasureFn = Callable[[Path], tuple[list[Round], dict[str, str]]]  # temp dir -> rounds, info


def shared_setup(m: Measured) -> dict[str, Any]:
    """The setup lines every tidegate-vs-vLLM report carries, after its own."""
    import vllm

    host = machine()
    return {"model": f"{MODEL.relative_to(ROOT)} (Qwen2 arch, 2 layers, hidden 256, CPU)",
            "tokens per request": MAX_TOKENS, "temperature": TEMPERATURE,
            "machine cores": host["cores"], "cpu": host["cpu"], "date": host["date"],
            "vllm": vllm.__version__, "VLLM_CPU_KVCACHE_SPACE (GiB, each engine)": KV_CACHE_GIB,
            "prefix caching (tidegate / vLLM server)":
                f"{m.tide_info['prefix_caching']} / {m.peer_info['prefix_caching']}",
            "engine OpenMP cores (tidegate workers / vLLM server)":
                f"{m.tide_info['engine_cores']} / {m.peer_info['engine_cores']}",
            "1-min load average before the load (tidegate / vLLM server)":
                f"{m.tide_info['load_before']} / {m.peer_info['load_before']}",
            "wall time of the whole benchmark (s)": round(m.wall_s, 1)}


TIMING_NOTE = ("Client-side timing: TTFT = first token received - submit start (tidegate: "
               "POST /v1/jobs then SSE; vLLM: streamed POST /v1/completions); TPOT = (last token "
               "- first token) / (tokens - 1); tokens/s = tokens received / wall time of the "
               "round, median of the rounds.")


def shared_notes(m: Measured) -> list[str]:
    """The notes every report carries, and warnings about this run."""
    notes = [SEED_NOTE, TIMING_NOTE, "The two systems ran one after the other on the same "
             "machine; the load client shared the same cores with each."]
    if m.tide_info["prefix_caching"] != m.peer_info["prefix_caching"]:
        notes.append("WARNING: prefix caching differs between the two systems.")
    notes += [f"WARNING: processes that died during the load ({who}): {info['died']}"
              for who, info in (("tidegate", m.tide_info), ("vLLM server", m.peer_info))
              if info.get("died")]
    notes += [f"WARNING: other test suites or benchmarks ran during the {who} load, so its "
              f"figures are skewed: {info['neighbours']}"
              for who, info in (("tidegate", m.tide_info), ("vLLM server", m.peer_info))
              if info.get("neighbours")]
    return notes


def publish(name: str, title: str, table: str, setup: Mapping[str, Any], notes: Sequence[str],
            series: Mapping[str, Sequence[float]], plot_title: str, figures: Mapping[str, Any],
            **plot_options: Any) -> None:
    """bench/results/NAME.md (table, setup, notes), NAME.png (TTFT) and NAME.json."""
    write_report(RESULTS / f"{name}.md", title, table, setup, notes)
    plot_distributions(RESULTS / f"{name}.png", series, plot_title, "time to first token (ms)",
                       **plot_options)
    write_json(RESULTS / f"{name}.json", figures)


def run_benchmark(name: str, tidegate: MeasureFn, peer: MeasureFn,
                  report: Callable[[Measured], dict[str, Any]]) -> int:
    """Builds the checkpoint if needed, measures tidegate then the peer (never together: the
    client shares the cores), reports, prints the markdown and the JSON line last."""
    exit_cleanly_on_signals()
    started = time.monotonic()
    from tidegate_tools.testmodel import build_test_model

    build_test_model(MODEL)  # reuses an identical build
    tmp = Path(tempfile.mkdtemp(prefix=f"tidegate-{name}-"))
    log(f"logs under {tmp / 'logs'}")
    tide_rounds, tide_info = tidegate(tmp)
    peer_rounds, peer_info = peer(tmp)
    wall_s = time.monotonic() - started
    out = report(Measured(tide_rounds, peer_rounds, tide_info, peer_info, wall_s))
    log(f"wrote {RESULTS / name}.md, {name}.png, {name}.json in {wall_s:.0f} s")
    print((RESULTS / f"{name}.md").read_text(), flush=True)
    print_json_last(out)
    return 0


# ---------------------------------------------------------------- process


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop processes


def exit_cleanly_on_signals() -> None:
    """SIGTERM/SIGHUP stop the started processes like Ctrl-C (KeyboardInterrupt) does."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
