"""Cold start against standby activation, same model and machine, one run.

- cold start: a worker process is started, and a job is submitted as soon as the API
  accepts one for the lane; measured from the process start to the first token served.
- standby activation: a worker started with `--standby` has loaded and warmed its engine
  but consumes no lane queue; the scheduler's `activate` (warm the lane's prompts, which
  the worker skips while they are still cached; `tidegate_consume`, confirmed by the
  heartbeat the worker writes and announces once it consumes the queue) runs, then a job
  is submitted; measured from the activation call to the first token served. The API
  routes to the worker as soon as it announces itself (api/fleet.py), not at its next
  heartbeat.

Writes bench/results/coldstart.{md,png,json}; the last stdout line is the JSON with
"activation_speedup" (cold / standby, medians).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/coldstart.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.coldstart, then exits

import os
import sys
import tempfile
import time
from pathlib import Path

from tidegate_client import Client, TidegateError

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
from bench.stack import NAMESPACE, exit_cleanly_on_signals, tidegate_env
from tidegate_tools.procs import start_worker, wait_until
from tidegate_tools.stack import running_stack

LANE, POOL = "chat", "vllm"
COLD_RUNS, STANDBY_RUNS = 2, 3
PROMPT = [{"role": "user", "content": "Where is my order? It has not arrived yet."}]


def first_token_s(base: str, key: str, t0: float, timeout_s: float = 300) -> float:
    """Submits (retrying while no worker serves the lane) and waits for the first token;
    seconds since t0."""
    with Client(base, key, timeout_s=30, retries=0) as client:  # it times the 503s itself
        end = time.monotonic() + timeout_s
        while True:
            try:
                job = client.submit(LANE, messages=PROMPT, max_tokens=8)
                break
            except TidegateError as exc:
                if exc.status != 503 or time.monotonic() > end:
                    raise
                time.sleep(0.05)
        for event in client.stream(job["job_id"]):
            if event.kind == "token":
                return time.monotonic() - t0
    raise RuntimeError("the job ended without a token")


def heartbeat_state(redis_url: str, name: str) -> str | None:
    import redis

    from tidegate.fleet import read_heartbeat

    hb = read_heartbeat(redis.Redis.from_url(redis_url), NAMESPACE, name)
    return hb.state if hb else None


def cold_start(env: dict[str, str], base: str, key: str, logs: Path, i: int) -> float:
    t0 = time.monotonic()
    proc = start_worker(env, LANE, f"cold-{i}@bench", logs)
    try:
        return first_token_s(base, key, t0)
    finally:
        proc.stop()


def standby_runs(env: dict[str, str], base: str, key: str, logs: Path) -> list[float]:
    from scheduler import control
    from tasks.app import make_app
    from tidegate.settings import Settings

    settings = Settings(redis_url=env["TIDEGATE_REDIS_URL"], namespace=NAMESPACE,
                        lanes_file=Path(env["TIDEGATE_LANES_FILE"]))
    app, client = make_app(settings), __import__("redis").Redis.from_url(settings.redis_url)
    name = "standby@bench"
    proc = start_worker(env, LANE, name, logs, standby=True)
    times = []
    try:
        wait_until(lambda: heartbeat_state(settings.redis_url, name) == "standby", 300,
                   "the standby worker to load its engine", [proc], poll_s=0.5)
        for _ in range(STANDBY_RUNS):
            t0 = time.monotonic()
            assert control.activate(app, client, settings, name, LANE, POOL,
                                    warm_prompts=settings.lanes[LANE].warm_prompts)
            times.append(first_token_s(base, key, t0))
            assert control.deactivate(app, client, settings, name, LANE, POOL)
            wait_until(lambda: heartbeat_state(settings.redis_url, name) == "standby", 30,
                       "the worker to be back in standby", [proc])
    finally:
        proc.stop()
    return times


def main() -> int:
    exit_cleanly_on_signals()
    from store import Store, upgrade

    tmp = Path(tempfile.mkdtemp(prefix="tidegate-coldstart-"))
    logs = tmp / "logs"
    started = time.monotonic()
    db_url = f"sqlite:///{tmp / 'tidegate.db'}"
    upgrade(db_url)
    _, key = Store(db_url).tenants.create_tenant("bench", [LANE])
    env = tidegate_env(db_url, slots=16)
    with running_stack(env, [], logs, private_redis=True, timeout_s=60) as stack:
        env["TIDEGATE_REDIS_URL"] = stack.redis_url or ""
        base = stack.base_url
        cold = []
        for i in range(COLD_RUNS):
            cold.append(cold_start(env, base, key, logs, i))
            log(f"cold start {i + 1}: {cold[-1]:.1f} s")
        warm = standby_runs(env, base, key, logs)
        log(f"standby activations: {', '.join(f'{t:.2f} s' for t in warm)}")
    return report(cold, warm, time.monotonic() - started)


def report(cold: list[float], warm: list[float], wall_s: float) -> int:
    speedup = median(cold) / median(warm)
    table = markdown_table(
        ["path", "runs", "median to first token (s)", "min (s)", "max (s)"],
        [["cold start (process start)", str(len(cold)), fmt(median(cold), 2),
          fmt(min(cold), 2), fmt(max(cold), 2)],
         ["standby activation (tidegate_consume)", str(len(warm)), fmt(median(warm), 2),
          fmt(min(warm), 2), fmt(max(warm), 2)],
         ["speedup (cold / standby)", "", fmt(speedup, 1), "", ""]])
    setup = {**machine(), "model": "data/models/tidegate-test", "lane": LANE,
             "what activation includes": "warm the lane's prompts (skipped while cached), "
             "tidegate_consume, the worker's announced heartbeat, submit, first token",
             "wall time (s)": round(wall_s, 1)}
    write_report(RESULTS / "coldstart.md", "Cold start against standby activation", table,
                 setup)
    _plot(cold, warm)
    figures = {"benchmark": "coldstart", "activation_speedup": speedup,
               "cold_start_s": cold, "activation_s": warm,
               "cold_start_median_s": median(cold), "activation_median_s": median(warm)}
    write_json(RESULTS / "coldstart.json", figures)
    print(table)
    print_json_last(figures)
    return 0


def _plot(cold: list[float], warm: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(["cold start", "standby activation"], [median(cold), median(warm)],
            color=["#c44e52", "#4c72b0"])
    for y, values in enumerate((cold, warm)):
        ax.plot(values, [y] * len(values), "k.", label="runs" if y == 0 else None)
    ax.set_xlabel("seconds to the first token served (log scale)")
    ax.set_xscale("log")
    ax.set_title("tidegate: cold start vs standby activation (same model and machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "coldstart.png", dpi=120)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
