"""workers/broker.py on a redis-server of the test's own, through kombu's Redis transport:
a delivered message is in the `unacked` hash (what the recovery sweep hands back) until
it is acked, and acks, batched, leave nothing there."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from tidegate_tools.procs import Proc, free_port, start_redis
from workers import broker

WAIT_S = 10.0
DB = 24  # this task's range (24, 25)


@pytest.fixture()
def url(tmp_root: Path) -> Iterator[str]:
    port = free_port()
    proc: Proc = start_redis(port, tmp_root / "logs")
    try:
        yield f"redis://127.0.0.1:{port}/{DB}"
    finally:
        proc.stop()


def _until(check: Any) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_delivered_messages_wait_in_unacked_until_their_batched_acks(url: str) -> None:
    broker.install()
    queue = Queue("tg-acks", Exchange("tg-acks", type="direct"), routing_key="tg-acks")
    with Connection(url) as conn:
        producer = conn.Producer(serializer="json")
        for i in range(20):
            producer.publish({"job": i, "text": "caf\u00e9"}, exchange=queue.exchange,
                             routing_key="tg-acks", declare=[queue])
        channel = conn.default_channel
        assert isinstance(channel.qos, broker.BatchedAckQoS)
        got: list[Any] = []
        with conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)],
                           accept=["json"]):
            deadline = time.monotonic() + WAIT_S
            while len(got) < 20 and time.monotonic() < deadline:
                conn.drain_events(timeout=1)
        assert sorted(m.payload["job"] for m in got) == list(range(20))
        client = channel.client
        unacked = channel.qos.unacked_key
        # Delivered, not acked: each in the hash a dead worker's messages are restored from.
        assert client.hlen(unacked) == 20
        assert channel.qos.unacked_index_key and client.zcard(channel.qos.unacked_index_key) == 20
        entry = broker.fast_loads(client.hget(unacked, got[0].delivery_tag))
        assert entry[0]["properties"]["delivery_tag"] == got[0].delivery_tag
        assert entry[2] == "tg-acks"  # the routing key it is restored with
        for message in got[:15]:
            message.ack()
        assert broker.ACKS.flush()
        assert _until(lambda: client.hlen(unacked) == 5)
        assert client.zcard(channel.qos.unacked_index_key) == 5
        for message in got[15:]:
            message.ack()
        assert broker.ACKS.flush()
        assert client.hlen(unacked) == 0 and client.zcard(channel.qos.unacked_index_key) == 0
