"""Token streams on a Redis Cluster (`TIDEGATE_STREAMS_URL=redis+cluster://...`), apart
from the broker: jobs' streams, leases and cancel keys spread over three masters by their
hash tags (tidegate/keys.py), and the jobs in flight when one master is SIGKILLed finish
on the replica the cluster promotes, their consumers hearing every event once, in order.

The module starts its own cluster (three masters, a replica each), a private redis-server
for the broker, and its own stack: the API, the scheduler's reconciler and ONE worker of
the chat lane. Cost: one vLLM worker start, then about 30 s.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from store import Store, upgrade
from tests.helpers import tool_or_skip
from tests.stack.test_sentinel import LANE, assert_heard_and_stored_done, start_jobs
from tidegate import keys, redisconn
from tidegate.events import Event
from tidegate_tools.procs import (
    Proc,
    RedisClusterProcs,
    free_port,
    redis_cluster,
    start_redis,
    tidegate_argv,
    wait_until,
)
from tidegate_tools.stack import RunningStack, WorkerSpec, running_stack

WORKER = "chat-cluster@tidegate"
NAMESPACE = "tgcluster"
JOBS = 12  # each of MAX_TOKENS (test_sentinel.py): seconds for the kill to land in
pytestmark = pytest.mark.timeout(600)


@dataclass
class ClusterStack:
    cluster: RedisClusterProcs
    running: RunningStack
    store: Store
    key: str  # an API key of a tenant allowed the lane
    procs: list[Proc]  # every process of the stack, the broker's Redis and the scheduler


@pytest.fixture(scope="module")
def cluster_stack(model_path: Path, tmp_root: Path) -> Iterator[ClusterStack]:
    tool_or_skip("redis-cli", "Debian's redis-tools: make ops-tools")
    logs = tmp_root / "logs" / "streams-cluster"
    db = f"sqlite:///{tmp_root / 'streams-cluster.db'}"
    upgrade(db)
    store = Store(db)
    _, key = store.tenants.create_tenant("cluster-tenant", [LANE])
    broker_port = free_port()
    with redis_cluster(logs, masters=3, replicas=1) as cluster:
        broker = start_redis(broker_port, logs)
        env = {**os.environ, "TIDEGATE_REDIS_URL": f"redis://127.0.0.1:{broker_port}/0",
               "TIDEGATE_STREAMS_URL": cluster.url, "TIDEGATE_DATABASE_URL": db,
               "TIDEGATE_NAMESPACE": NAMESPACE}
        scheduler = Proc("scheduler-cluster", tidegate_argv("scheduler"),
                         logs / "scheduler.log",
                         {**env, "TIDEGATE_SCHEDULER_TICK_S": "3600", "TIDEGATE_RECONCILE_S": "1"})
        try:
            with running_stack(env, [WorkerSpec(LANE, WORKER, cpus="1")], logs) as running:
                yield ClusterStack(cluster, running, store, key,
                                   [*running.procs, scheduler, broker])
        finally:
            scheduler.stop()
            broker.stop()


def master_of(stack: ClusterStack, job_id: str) -> int:
    return stack.cluster.master_of_slot(key_slot(keys.job_events(NAMESPACE, job_id).encode()))


def streamed(client: Any, job_id: str) -> int:
    return int(client.xlen(keys.job_events(NAMESPACE, job_id)))


def ended(client: Any, job_id: str) -> bool:
    last = client.xrevrange(keys.job_events(NAMESPACE, job_id), count=1)
    return bool(last) and Event.from_json(last[0][1][b"e"]).terminal


def test_jobs_streams_spread_over_the_shards_and_survive_a_master_s_failover(
        cluster_stack: ClusterStack) -> None:
    stack, cluster = cluster_stack, cluster_stack.cluster
    client = redisconn.sync_streams_client(cluster.url)
    readers = start_jobs(stack, JOBS)
    by_master = Counter(master_of(stack, r.job_id) for r in readers)
    assert len(by_master) == 3, f"12 jobs' tags fell on {len(by_master)} of 3 masters"
    # Mid-load: the kill lands on the master of most jobs as soon as one of them streamed.
    victim = by_master.most_common(1)[0][0]
    on_victim = [r for r in readers if master_of(stack, r.job_id) == victim]
    wait_until(lambda: any(streamed(client, r.job_id) > 1 for r in on_victim), 120,
               "the first tokens on the master to kill", stack.procs, poll_s=0.05)
    unfinished = sum(not ended(client, r.job_id) for r in on_victim)
    killed_at = cluster.kill_master(victim)
    assert unfinished, "every job on that master ended before the kill: none was in flight"
    wait_until(lambda: all(r.ended() for r in readers), 180,
               f"the jobs to end ({unfinished} in flight on the killed master)", stack.procs)
    recovered_s = time.monotonic() - killed_at
    for reader in readers:
        assert_heard_and_stored_done(stack, reader)
    assert all(proc.alive() for proc in stack.procs), "a process died with the master"
    assert recovered_s < 120
    # The jobs after the failover run as before.
    for reader in start_jobs(stack, 3):
        wait_until(reader.ended, 120, "a job after the failover to end", stack.procs)
        assert_heard_and_stored_done(stack, reader)
    client.close()
