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

import asyncio
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed

from api.client import AsyncClient  # noqa: E402
from bench.common import (  # noqa: E402
    RESULTS,
    fmt,
    log,
    machine,
    markdown_table,
    median,
    percentile,
    plot_distributions,
    print_json_last,
    ratio,
    write_json,
    write_report,
)
from tidegate.procs import (  # noqa: E402
    Proc,
    free_port,
    start_api,
    start_redis,
    start_worker,
    wait_until,
)

MODEL = ROOT / "data" / "models" / "tidegate-test"
LANE = "finance"  # FP16 weights and KV cache: the same precision as the peer below
DTYPE = "float16"
CONCURRENCY = 64  # = tidegate's engine slots and the peer's --max-num-seqs
MAX_TOKENS = 32  # the test checkpoint never emits EOS: every request yields exactly this
ROUNDS = 3
WARMUP = 8
TEMPERATURE = 0.8  # no per-request seed: see NOTES (vLLM CPU crash with seeds)
MAX_MODEL_LEN = 2048
KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE for both engines
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 60.0
WORKER = "finance-bench@tidegate"
NAMESPACE = "tgbench"

TOPICS = ["quarter-end ledger", "refund backlog", "invoice disputes", "cash position",
          "vendor payments", "expense claims", "currency exposure", "audit findings"]


@dataclass(frozen=True)
class RequestSpec:
    prompt: str


@dataclass
class Sample:
    """One request as the client saw it."""

    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    tokens: int = 0
    error: str | None = None
    submit_ms: float = math.nan  # tidegate only: POST /v1/jobs until its 202
    server: dict[str, float] = field(default_factory=dict)  # what the server reported


@dataclass
class Round:
    samples: list[Sample]
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s


class Arrivals:
    """Token arrival times of one request, from its submit start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.tokens = 0

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
        error = None if self.tokens == MAX_TOKENS else f"{self.tokens} tokens, not {MAX_TOKENS}"
        return Sample((self.first - self.start) * 1000, tpot, self.tokens, error)


RequestFn = Callable[[RequestSpec], Awaitable[Sample]]
# A fresh HTTP client per round: a keep-alive connection left idle between rounds can be
# closed by the server (uvicorn: 5 s) just as it is reused, which fails that request.
Session = Callable[[], AbstractAsyncContextManager[RequestFn]]


def prompt(round_no: int, i: int) -> str:
    # Distinct per round so later rounds do not ride on whole-prompt cache hits from earlier
    # ones; the shared tail is what business traffic looks like. Same text for both systems.
    topic = TOPICS[i % len(TOPICS)]
    return (f"Round {round_no}, request {i}. Summarise the {topic} for account {1000 + i} "
            "in three short points for the finance team.")


# ---------------------------------------------------------------- load generation


async def guarded(fn: RequestFn, spec: RequestSpec) -> Sample:
    """A failed or hung request becomes a sample with an error, never a crashed round."""
    try:
        return await asyncio.wait_for(fn(spec), REQUEST_TIMEOUT_S)
    except TimeoutError:
        return Sample(error=f"no answer within {REQUEST_TIMEOUT_S:.0f} s")
    except Exception as exc:  # noqa: BLE001 - reported per request
        return Sample(error=f"{type(exc).__name__}: {exc}"[:300])


async def run_round(session: Session, round_no: int, n: int) -> Round:
    specs = [RequestSpec(prompt(round_no, i)) for i in range(n)]
    async with session() as fn:
        start = time.perf_counter()
        samples = await asyncio.gather(*(guarded(fn, s) for s in specs))
        return Round(list(samples), time.perf_counter() - start)


async def run_load(name: str, session: Session) -> list[Round]:
    warm = await run_round(session, 0, WARMUP)
    log(f"{name}: warm-up {WARMUP} requests in {warm.wall_s:.2f} s, "
        f"{sum(s.error is not None for s in warm.samples)} errors")
    rounds = []
    for round_no in range(1, ROUNDS + 1):
        r = await run_round(session, round_no, CONCURRENCY)
        ok = [s.ttft_ms for s in r.samples if s.error is None]
        log(f"{name}: round {round_no}: {r.tokens_per_s:,.0f} tokens/s, wall {r.wall_s:.2f} s, "
            f"TTFT p50 {fmt(median(ok))} ms, {len(r.samples) - len(ok)} errors")
        rounds.append(r)
    return rounds


# ---------------------------------------------------------------- tidegate


async def tidegate_request(client: AsyncClient, spec: RequestSpec) -> Sample:
    clock = Arrivals()
    job = await client.submit(LANE, prompt=spec.prompt, max_tokens=MAX_TOKENS,
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
    sample = _check_done(clock.sample(), done)
    sample.submit_ms = submit_ms
    return sample


def _check_done(sample: Sample, done: dict[str, Any] | None) -> Sample:
    if done is None:
        sample.error = sample.error or "stream ended without a done event"
        return sample
    reported = (done.get("usage") or {}).get("completion_tokens")
    if reported != sample.tokens:
        sample.error = sample.error or f"received {sample.tokens} tokens, usage says {reported}"
    sample.server = {k: float(done[k]) for k in ("ttft_ms", "tpot_ms", "queue_wait_ms")
                     if done.get(k) is not None}
    return sample


def tidegate_env(tmp: Path, redis_port: int, db_url: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path,
            "TIDEGATE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "TIDEGATE_DATABASE_URL": db_url, "TIDEGATE_DATA_DIR": str(ROOT / "data"),
            "TIDEGATE_MODEL": str(MODEL), "TIDEGATE_NAMESPACE": NAMESPACE,
            "TIDEGATE_LANES_FILE": str(ROOT / "tidegate" / "lanes.toml"),
            "TIDEGATE_ENGINE_SLOTS": str(CONCURRENCY),
            "TIDEGATE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "TIDEGATE_KV_CACHE_GIB": KV_CACHE_GIB, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}


def tidegate_ready(base: str) -> bool:
    try:
        resp = httpx.get(f"{base}/readyz", timeout=2)
    except httpx.HTTPError:
        return False
    active = resp.json().get("checks", {}).get("workers", {}).get("active", [])
    return resp.status_code == 200 and WORKER in active


def stop_all(procs: list[Proc]) -> None:
    for proc in reversed(procs):  # API, then worker, then Redis
        proc.stop()


@contextmanager
def tidegate_stack(tmp: Path) -> Iterator[tuple[str, str, list[Proc]]]:
    """Private Redis and SQLite, one finance worker, the API; all stopped on the way out."""
    from store import Store, upgrade

    logs, procs = tmp / "logs", []
    db_url = f"sqlite:///{tmp / 'tidegate.db'}"
    try:
        redis_port = free_port()
        procs.append(start_redis(redis_port, logs))
        upgrade(db_url)
        _, key = Store(db_url).create_tenant("bench", [LANE])
        env = tidegate_env(tmp, redis_port, db_url)
        procs.append(start_worker(env, LANE, WORKER, logs))
        port = free_port()
        procs.append(start_api(env, port, logs))
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: tidegate_ready(base), START_TIMEOUT_S,
                   f"tidegate's /readyz with worker {WORKER} active", procs, poll_s=0.5)
        yield base, key, procs
    finally:
        stop_all(procs)


def tidegate_session(base: str, key: str) -> Session:
    @asynccontextmanager
    async def session() -> AsyncIterator[RequestFn]:
        client = AsyncClient(base, key, timeout_s=60)  # the SDK, as a producer would use it
        try:
            yield lambda spec: tidegate_request(client, spec)
        finally:
            await client.aclose()

    return session


def measure_tidegate(tmp: Path) -> tuple[list[Round], dict[str, str]]:
    log("tidegate: starting Redis, SQLite, one finance worker (FP16) and the API")
    start = time.monotonic()
    with tidegate_stack(tmp) as (base, key, procs):
        log(f"tidegate: ready in {time.monotonic() - start:.0f} s")
        load = load_average()
        rounds = asyncio.run(run_load("tidegate", tidegate_session(base, key)))
        alive = {p.name: p.alive() for p in procs}
        worker_log = next(p.log_path for p in procs if p.name.startswith("worker:"))
    if not all(alive.values()):
        log(f"tidegate: processes that died during the load: {alive}")
    return rounds, {"prefix_caching": prefix_caching(worker_log), "load_before": load}


# ---------------------------------------------------------------- vLLM's OpenAI server


def _chunk_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if choice.get("text") else 0  # a server without return_token_ids


async def peer_request(http: httpx.AsyncClient, spec: RequestSpec) -> Sample:
    body = {"model": str(MODEL), "prompt": spec.prompt, "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    clock, usage = Arrivals(), None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or data == "[DONE]":
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                clock.add(_chunk_tokens(choice))
    return _check_done(clock.sample(), {"usage": usage} if usage else None)


def peer_healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def peer_server(tmp: Path) -> Iterator[tuple[str, Proc]]:
    """`vllm serve` fails with the vllm-cpu distribution; the module entry point works."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
            "--dtype", DTYPE, "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(CONCURRENCY), "--host", "127.0.0.1", "--port", str(port),
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


def peer_session(base: str) -> Session:
    @asynccontextmanager
    async def session() -> AsyncIterator[RequestFn]:
        limits = httpx.Limits(max_connections=CONCURRENCY * 2)
        timeout = httpx.Timeout(60.0, read=None)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
            yield lambda spec: peer_request(http, spec)

    return session


def measure_peer(tmp: Path) -> tuple[list[Round], dict[str, str]]:
    log("vLLM server: starting python -m vllm.entrypoints.openai.api_server (FP16)")
    start = time.monotonic()
    with peer_server(tmp) as (base, proc):
        log(f"vLLM server: ready in {time.monotonic() - start:.0f} s")
        load = load_average()
        rounds = asyncio.run(run_load("vLLM server", peer_session(base)))
    return rounds, {"prefix_caching": prefix_caching(proc.log_path), "load_before": load}


def load_average() -> str:
    """Other work on the machine skews both systems: recorded so a noisy run shows."""
    return f"{os.getloadavg()[0]:.2f}"


def prefix_caching(log_path: Path) -> str:
    """The setting the engine printed at start: both systems must run with the same one."""
    try:
        found = re.findall(r"enable_prefix_caching=(\w+)", log_path.read_text(errors="replace"))
    except OSError:
        return "unknown"
    return found[-1] if found else "unknown"


# ---------------------------------------------------------------- report


def summarize(rounds: list[Round]) -> dict[str, Any]:
    samples = [s for r in rounds for s in r.samples]
    ok = [s for s in samples if s.error is None]
    ttft, tpot = [s.ttft_ms for s in ok], [s.tpot_ms for s in ok]
    return {
        "tokens_per_s": median([r.tokens_per_s for r in rounds]),
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
        "requests": len(samples), "errors": len(samples) - len(ok),
        "tokens": sum(s.tokens for s in samples),
        "round_tokens_per_s": [r.tokens_per_s for r in rounds],
        "round_wall_s": [r.wall_s for r in rounds],
        "error_examples": sorted({s.error for s in samples if s.error})[:5],
    }


def tidegate_phases(rounds: list[Round]) -> dict[str, float]:
    """Where a tidegate request's time goes: the client's submit (POST until 202) and the
    worker's own TTFT and queue wait from the done events, to set beside the client TTFT."""
    samples = [s for r in rounds for s in r.samples if s.error is None]
    series = {"submit": [s.submit_ms for s in samples]}
    for key in ("ttft_ms", "queue_wait_ms"):
        series[f"server_{key.removesuffix('_ms')}"] = [s.server[key] for s in samples
                                                       if key in s.server]
    return {f"{name}_p{q}_ms": percentile(values, q)
            for name, values in series.items() for q in (50, 99)}


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


def setup(tide_info: dict[str, str], peer_info: dict[str, str], wall_s: float) -> dict[str, Any]:
    import vllm

    m = machine()
    return {"model": f"{MODEL.relative_to(ROOT)} (Qwen2 arch, 2 layers, hidden 256, CPU)",
            "dtype": f"{DTYPE} weights and KV cache (tidegate lane `{LANE}`)",
            "concurrency": CONCURRENCY, "tokens per request": MAX_TOKENS,
            "temperature": TEMPERATURE, "warm-up requests": WARMUP, "rounds": ROUNDS,
            "machine cores": m["cores"], "cpu": m["cpu"], "date": m["date"],
            "vllm": vllm.__version__, "VLLM_CPU_KVCACHE_SPACE (GiB)": KV_CACHE_GIB,
            "tidegate store / broker": "private SQLite file (WAL) / private redis-server",
            "tidegate worker": f"1 Celery worker, lane `{LANE}`, {CONCURRENCY} engine slots",
            "prefix caching (tidegate / vLLM server)":
                f"{tide_info['prefix_caching']} / {peer_info['prefix_caching']}",
            "1-min load average before the load (tidegate / vLLM server)":
                f"{tide_info['load_before']} / {peer_info['load_before']}",
            "wall time of the whole benchmark (s)": round(wall_s, 1)}


NOTES = [
    "Requests carry no seed: on this vLLM CPU build a seeded request whose prefill gets "
    "chunked kills the engine core ('CPU Generator does not use offset'), which 64 prompts "
    "arriving at once trigger on vLLM's server.",
    "Client-side timing: TTFT = first token received - submit start (tidegate: POST /v1/jobs "
    "then SSE; vLLM: streamed POST /v1/completions); TPOT = (last token - first token) / "
    "(tokens - 1); tokens/s = tokens received / wall time of the round, median of the rounds.",
    "Latency percentiles pool all measured requests; errored requests are left out of them.",
    "The two systems ran one after the other on the same machine; the load client shared the "
    "same cores with each.",
]


def phases_note(tide: dict[str, Any]) -> str:
    return ("tidegate, inside the client TTFT: submit (POST /v1/jobs until 202) p50 "
            f"{fmt(tide['submit_p50_ms'])} ms, p99 {fmt(tide['submit_p99_ms'])} ms; the "
            f"worker's own TTFT (done event) p50 {fmt(tide['server_ttft_p50_ms'])} ms, p99 "
            f"{fmt(tide['server_ttft_p99_ms'])} ms; queue wait p50 "
            f"{fmt(tide['server_queue_wait_p50_ms'])} ms, p99 "
            f"{fmt(tide['server_queue_wait_p99_ms'])} ms.")


def figures(tide: dict[str, Any], peer: dict[str, Any], setup_: dict[str, Any],
            wall_s: float) -> dict[str, Any]:
    ratios = {f"{key.removesuffix('_ms')}_ratio": ratio(tide[key], peer[key])
              for _, key, _ in METRICS[1:]}
    return {"benchmark": "e2e", "throughput_ratio": ratio(tide["tokens_per_s"],
                                                          peer["tokens_per_s"]),
            **ratios, "tidegate": tide, "vllm_server": peer, "setup": setup_,
            "wall_s": round(wall_s, 1)}


def report(tide_rounds: list[Round], peer_rounds: list[Round], tide_info: dict[str, str],
           peer_info: dict[str, str], wall_s: float) -> dict[str, Any]:
    tide = {**summarize(tide_rounds), **tidegate_phases(tide_rounds)}
    peer = summarize(peer_rounds)
    setup_ = setup(tide_info, peer_info, wall_s)
    notes = [*NOTES, phases_note(tide)]
    if tide_info["prefix_caching"] != peer_info["prefix_caching"]:
        notes.append("WARNING: prefix caching differs between the two systems.")
    write_report(RESULTS / "e2e.md", "End to end: tidegate vs vLLM's OpenAI server",
                 table(tide, peer), setup_, notes)
    ttfts = {name: [s.ttft_ms for r in rounds for s in r.samples if s.error is None]
             for name, rounds in (("tidegate", tide_rounds), ("vLLM server", peer_rounds))}
    plot_distributions(RESULTS / "e2e.png", ttfts,
                       f"TTFT, {CONCURRENCY} concurrent requests x {MAX_TOKENS} tokens, "
                       f"{ROUNDS} rounds pooled ({DTYPE}, {setup_['machine cores']} cores)",
                       "time to first token (ms)")
    out = figures(tide, peer, setup_, wall_s)
    write_json(RESULTS / "e2e.json", out)
    return out


# ---------------------------------------------------------------- main


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop processes


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # Ctrl-C already raises KeyboardInterrupt
        signal.signal(sig, _exit_on_signal)
    started = time.monotonic()
    from tidegate.testmodel import build_test_model

    build_test_model(MODEL)  # reuses an identical build
    tmp = Path(tempfile.mkdtemp(prefix="tidegate-bench-"))
    log(f"logs under {tmp / 'logs'}")
    tide_rounds, tide_info = measure_tidegate(tmp)
    peer_rounds, peer_info = measure_peer(tmp)
    wall_s = time.monotonic() - started
    out = report(tide_rounds, peer_rounds, tide_info, peer_info, wall_s)
    log(f"wrote {RESULTS / 'e2e.md'}, e2e.png, e2e.json in {wall_s:.0f} s")
    print((RESULTS / "e2e.md").read_text(), flush=True)
    print_json_last(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
