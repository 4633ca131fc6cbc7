"""Many workers on one machine, started as the README shows (`tidegate worker --lane ...`,
no port flag): each takes a /metrics port of its own (the setting's port plus its --gpu
index, or the next free one), announces it in its heartbeat and `tidegate status`,
serves jobs and exports its metrics there; a port taken by another process stops nothing.

Four `sim` workers (many-worker runs are what the sim engine is for), and two vLLM workers
on CPU: the engine path. Their own Redis database and namespace."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from store import Store
from tests.helpers import make_tenant, metric, own_db
from tidegate.fleet import read_fleet
from tidegate.records import Heartbeat, WorkerState
from tidegate.settings import Settings
from tidegate_tools.procs import Proc, free_port, start_api, tidegate_argv, wait_until
from tidegate_tools.stack import api_ready

REDIS_DB = own_db(__name__, "17")
NAMESPACE = "tgmany"
BASE_PORT = Settings.model_fields["worker_metrics_port"].default  # 9400: no flag, no setting
SIM_START_S = 300.0  # four worker processes starting at once on a shared 2-core machine
VLLM_START_S = 420.0  # two vLLM engines loading at once on a shared 2-core machine

pytestmark = pytest.mark.timeout(VLLM_START_S + 300)


@pytest.fixture
def env(redis_server: str, migrated_db: str) -> Iterator[dict[str, str]]:
    """The stack's environment on a Redis database of its own, emptied after, with the worker
    metrics port left to its default (the session turns it off: tests/conftest.py)."""
    url = redis_server.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    environ = {k: v for k, v in os.environ.items() if k != "TIDEGATE_WORKER_METRICS_PORT"}
    environ.update(TIDEGATE_REDIS_URL=url, TIDEGATE_NAMESPACE=NAMESPACE,
                   TIDEGATE_SIM_PROFILE="fast")
    try:
        yield environ
    finally:
        redis.Redis.from_url(url).flushdb()


@contextlib.contextmanager
def started(procs: list[Proc]) -> Iterator[list[Proc]]:
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def worker(env: dict[str, str], logs: Path, tag: str, *args: str) -> Proc:
    """`tidegate worker <args>`, as the README writes it: no --name, no --metrics-port."""
    return Proc(f"worker:{tag}", tidegate_argv("worker", *args), logs / f"worker-{tag}.log", env)


def fleet(env: dict[str, str]) -> list[Heartbeat]:
    return read_fleet(redis.Redis.from_url(env["TIDEGATE_REDIS_URL"]), NAMESPACE)


def wait_active(env: dict[str, str], count: int, procs: list[Proc],
                timeout_s: float) -> list[Heartbeat]:
    def ready() -> bool:
        return sum(hb.state == WorkerState.ACTIVE for hb in fleet(env)) == count

    wait_until(ready, timeout_s, f"{count} active workers", procs, poll_s=0.5)
    return fleet(env)


def scrape(port: int) -> str:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    return response.text


def jobs_done(hb: Heartbeat) -> float:
    return metric(scrape(hb.metrics_port), "tidegate_jobs_finished_total", worker=hb.name,
                  status="done")


def submit(http: httpx.Client, lane: str) -> str:
    response = http.post("/v1/jobs", json={"lane": lane, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Where is my order?"}]})
    assert response.status_code == 202, response.text
    return str(response.json()["job_id"])


def status_lines(env: dict[str, str]) -> str:
    done = subprocess.run(tidegate_argv("status"), env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


def test_four_sim_workers_on_one_machine_serve_and_export_metrics(
        env: dict[str, str], migrated_db: str, tmp_root: Path) -> None:
    logs = tmp_root / "logs" / "many-sim"
    _, key = make_tenant(Store(migrated_db), "many-sim", ["chat"])
    with started([]) as procs:
        # Four times README's line: `tidegate worker --lane chat --engine sim --pool vllm`.
        procs += [worker(env, logs, f"sim{i}", "--lane", "chat", "--engine", "sim",
                         "--pool", "vllm") for i in range(4)]
        api_port = free_port()
        procs.append(start_api(env, api_port, logs))
        base = f"http://127.0.0.1:{api_port}"
        beats = wait_active(env, 4, procs, SIM_START_S)
        wait_until(lambda: api_ready(base, []), 60, "the API", procs)

        ports = [hb.metrics_port for hb in beats]
        assert len(set(ports)) == 4 and min(ports) >= BASE_PORT, ports
        for hb in beats:  # each port is its own worker's
            assert metric(scrape(hb.metrics_port), "tidegate_worker_state", worker=hb.name,
                          state="active") == 1
        shown = status_lines(env)
        for hb in beats:
            row = next(line for line in shown.splitlines() if line.startswith(hb.name[:32]))
            assert f":{hb.metrics_port}" in row

        # Jobs until each worker has done one, as its own /metrics counts them.
        with httpx.Client(base_url=base, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as http:
            def each_served() -> bool:
                for _ in range(4):
                    submit(http, "chat")
                return all(jobs_done(hb) >= 1 for hb in beats)

            wait_until(each_served, 120, "a job done by each of the four workers", procs,
                       poll_s=0.5)


def test_a_taken_port_moves_the_worker_up_before_its_engine_loads(
        env: dict[str, str], tmp_root: Path) -> None:
    """The port another process holds is skipped at start, the one taken announced."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        env = {**env, "TIDEGATE_WORKER_METRICS_PORT": str(taken)}
        logs = tmp_root / "logs" / "many-taken"
        with started([worker(env, logs, "taken", "--lane", "chat", "--engine", "sim",
                             "--pool", "vllm")]) as procs:
            (hb,) = wait_active(env, 1, procs, SIM_START_S)
            assert taken < hb.metrics_port < taken + 100
            assert metric(scrape(hb.metrics_port), "tidegate_worker_state", worker=hb.name,
                          state="active") == 1
            assert f"metrics port {taken} is taken" in procs[0].tail(200)


def test_two_vllm_workers_by_gpu_index_serve_and_export_metrics(
        env: dict[str, str], migrated_db: str, model_path: Path, tmp_root: Path) -> None:
    """README's `tidegate worker --lane finance --gpu 0` and `--lane chat --gpu 1` (with
    --cpus, the CPU build's pinning): ports 9400 + 0 and 9400 + 1, or the next free ones
    where this machine has them taken."""
    logs = tmp_root / "logs" / "many-vllm"
    _, key = make_tenant(Store(migrated_db), "many-vllm", ["finance", "chat"])
    with started([]) as procs:
        procs += [worker(env, logs, "finance", "--lane", "finance", "--gpu", "0", "--cpus", "0"),
                  worker(env, logs, "chat", "--lane", "chat", "--gpu", "1", "--cpus", "1")]
        api_port = free_port()
        procs.append(start_api(env, api_port, logs))
        base = f"http://127.0.0.1:{api_port}"
        beats = {hb.lane: hb for hb in wait_active(env, 2, procs, VLLM_START_S)}
        wait_until(lambda: api_ready(base, []), 60, "the API", procs)
        assert beats["finance"].metrics_port >= BASE_PORT
        assert beats["chat"].metrics_port >= BASE_PORT + 1
        assert beats["finance"].metrics_port != beats["chat"].metrics_port

        with httpx.Client(base_url=base, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as http:
            ids = {lane: submit(http, lane) for lane in beats}

            def ended() -> bool:
                return all(http.get(f"/v1/jobs/{i}").json()["status"] == "done"
                           for i in ids.values())

            wait_until(ended, 180, "both jobs done", procs, poll_s=0.5)
        for hb in beats.values():
            assert jobs_done(hb) == 1
            # vLLM's own metrics beside tidegate's, on the same announced port.
            assert metric(scrape(hb.metrics_port), "vllm:request_success_total") >= 1


def test_the_port_rule_in_process() -> None:
    """workers/metrics.py: the GPU index moves the first port; a taken port is skipped
    unless named exactly, which stops the worker naming it."""
    from workers import metrics

    assert metrics.preferred_port(9400, None) == 9400
    assert metrics.preferred_port(9400, "3") == 9403
    assert metrics.preferred_port(9400, "2,3") == 9402
    assert metrics.preferred_port(9400, "GPU-5d2c") == 9400
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(SystemExit, match=f"127.0.0.1:{taken} .*--metrics-port"):
            metrics.reserve("127.0.0.1", taken, exact=True)
        moved = metrics.reserve("127.0.0.1", taken, exact=False)
        try:
            assert taken < moved < taken + metrics.PORT_SCAN
            with pytest.raises(SystemExit):  # held, listening: a second worker cannot have it
                metrics.reserve("127.0.0.1", moved, exact=True)
        finally:
            assert metrics._reserved is not None
            metrics._reserved.close()
            metrics._reserved = None
