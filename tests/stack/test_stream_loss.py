"""A Redis that restarts empty loses the event streams of the jobs running; the attempt
running a job writes back the events it knows of before its next one, so a consumer that
reconnects after the last event it kept gets exactly what it missed (issue "every
accepted job ends", finding 2). A redis-server of the test's own, SIGKILLed and started
again empty on its port; the publisher and lease are the worker's own."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tidegate import keys
from tidegate.events import Event
from tidegate_tools.procs import Proc, free_port, start_redis
from workers.lease import Lease
from workers.publisher import EventPublisher

NS, JOB = "tgloss", "job-1"


@pytest.fixture()
def server(tmp_root: Path) -> Iterator[list[Proc]]:
    port = free_port()
    procs = [start_redis(port, tmp_root / "logs")]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def restart_empty(procs: list[Proc], tmp_root: Path) -> None:
    port = int(procs[-1].name.split(":")[1])
    os.killpg(procs[-1].popen.pid, signal.SIGKILL)
    procs[-1].popen.wait()
    procs.append(start_redis(port, tmp_root / "logs"))


def seqs(client: redis.Redis) -> list[int]:
    entries = client.xrange(keys.job_events(NS, JOB))
    return [Event.from_json(fields[b"e"]).seq for _, fields in entries]


def test_a_stream_lost_with_redis_is_written_back_before_the_next_event(
        server: list[Proc], tmp_root: Path) -> None:
    port = int(server[0].name.split(":")[1])
    client = redis.Redis(port=port)
    publisher = EventPublisher(client, NS, maxlen=10_000, ttl_s=60)
    lease = Lease(client, keys.job_lease(NS, JOB), "worker-a", ttl_s=30)
    assert lease.take()
    history = [Event(job_id=JOB, seq=0, kind="started", data={"worker": "worker-a"})]
    history += [Event(job_id=JOB, seq=i, kind="token", text=f"t{i} ", token_ids=[i])
                for i in range(1, 6)]
    for i, event in enumerate(history):
        assert publisher.publish(event, lease, history[:i])

    restart_empty(server, tmp_root)
    client = redis.Redis(port=port)  # the old connection died with the server
    publisher = EventPublisher(client, NS, maxlen=10_000, ttl_s=60)
    lease = Lease(client, keys.job_lease(NS, JOB), "worker-a", ttl_s=30)  # a lapsed lease
    live = client.pubsub(ignore_subscribe_messages=True)
    live.subscribe(keys.job_live(NS, JOB))
    assert live.get_message(timeout=1) is None  # subscribed

    nxt = Event(job_id=JOB, seq=6, kind="token", text="t6 ", token_ids=[6])
    assert publisher.publish(nxt, lease, history)

    assert seqs(client) == list(range(7))  # a consumer after seq 3 reads 4, 5, 6
    state = publisher.state(JOB)
    assert state.text == "".join(f"t{i} " for i in range(1, 7))
    heard = [live.get_message(timeout=0.5) for _ in range(2)]
    # Only the new event goes out live: the written-back ones were heard before.
    assert [Event.from_json(m["data"]).seq for m in heard if m] == [6]
