"""Weighted fair queuing of tenants within a lane (tidegate/fairq.py), on a real Redis:
the order a lane's workers would take its waiting jobs in is the order kombu's list gives
them (its consumer pops on the right), read here with the same RPOP.

Through the API: jobs submitted through APIs whose lane has a worker's heartbeat and no
worker behind it (tests/helpers.py `api_of_its_own`), so the jobs stay queued and the
list shows their order. Two API apps on one Redis database stand for two API processes:
the fair order lives in Redis, not in a process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis

from tests.helpers import api_of_its_own, own_db
from tidegate import keys
from tidegate.fairq import TAGS_TTL_S, FairPush, cost
from tidegate_tools.procs import free_port, start_redis
from workers.lending import task_id

QUEUE = "chat.vllm"  # the chat lane's pool queue of the advertised worker's pool


def _taken_order(client: redis.Redis, queue: str = QUEUE) -> list[str]:
    """The job ids in the order a consumer takes them: each priority step's list from its
    right end, the most urgent step first (kombu's Redis transport)."""
    order = []
    for sublist in keys.queue_sublists(queue):
        while (message := client.rpop(sublist)) is not None:
            order.append(task_id(message))
    return order


def _take(client: redis.Redis, n: int) -> list[str]:
    """What a consumer popping `n` messages of the chat pool queue's one list took."""
    (sublist,) = [s for s in keys.queue_sublists(QUEUE) if client.llen(s)]
    return [task_id(client.rpop(sublist)) for _ in range(n)]


def _submit(base_url: str, key: str, n: int, text: str) -> list[str]:
    ids = []
    for i in range(n):
        body = {"lane": "chat", "max_tokens": 16, "prompt": f"{text} {i}"}
        answer = httpx.post(f"{base_url}/v1/jobs", json=body, timeout=30,
                            headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["job_id"])
    return ids


@contextlib.contextmanager
def _apis(redis_server: str, tmp_root: Path, name: str, part: str,
          **settings: object) -> Iterator[tuple[str, str, object]]:
    """Two API apps sharing one SQLite database and one Redis database."""
    db = own_db(__name__, part)
    with api_of_its_own(redis_server, tmp_root, name, db, [("chat", "vllm")],
                        **settings) as one, \
            api_of_its_own(redis_server, tmp_root, name, db, [("chat", "vllm")],
                           **settings) as two:
        yield one.base_url, two.base_url, one


def _flood_then_quiet(redis_server: str, tmp_root: Path, name: str,
                      **settings: object) -> tuple[list[str], list[str], list[str], list[str]]:
    """The flood submits 8 through one API, a worker takes 4 (the flood is backlogged),
    the quiet tenant submits 2 through the other API: (flood, taken, quiet, the order
    the rest is taken in)."""
    with _apis(redis_server, tmp_root, name, name, **settings) as (first, second, own):
        _, flood_key = own.store.tenants.create_tenant("flood", ["chat"])
        _, quiet_key = own.store.tenants.create_tenant("quiet", ["chat"])
        flood = _submit(first, flood_key, 8, "Flood")
        taken = _take(own.redis, 4)
        quiet = _submit(second, quiet_key, 2, "Quiet")
        return flood, taken, quiet, _taken_order(own.redis)


def test_a_quiet_tenants_job_goes_ahead_of_a_flooding_tenants_backlog(
        redis_server: str, tmp_root: Path) -> None:
    flood, taken, quiet, order = _flood_then_quiet(redis_server, tmp_root, "fairq")
    assert taken == flood[:4]
    # A tenant below its share starts a few jobs' cost (TIDEGATE_FAIR_BURST_JOBS, 4) before
    # the lane's virtual time: both its jobs go ahead of the flood's backlog.
    assert order == [*quiet, *flood[4:]]


def test_without_burst_credit_a_quiet_job_starts_at_the_lanes_virtual_time(
        redis_server: str, tmp_root: Path) -> None:
    flood, _, quiet, order = _flood_then_quiet(redis_server, tmp_root, "fairsfq",
                                               fair_burst_jobs=0)
    # Equal to the head's start tag (after it: arrival order), then its own cost later.
    assert order == [flood[4], quiet[0], flood[5], quiet[1], *flood[6:]]


def test_backlogged_tenants_are_served_in_proportion_to_their_weights(
        redis_server: str, tmp_root: Path) -> None:
    from store.tenants import Tenants

    with _apis(redis_server, tmp_root, "fairw", "weights", fair_burst_jobs=0) as (
            first, second, own):
        _, light_key = own.store.tenants.create_tenant("light", ["chat"])
        _, heavy_key = own.store.tenants.create_tenant("heavy", ["chat"])
        Tenants(own.store).update("heavy", fair_weight=3)
        light = _submit(first, light_key, 8, "Light")
        heavy = _submit(second, heavy_key, 8, "Heavy")  # all of light's queued first
        order = _taken_order(own.redis)
    first_eight = order[:8]
    assert sum(job in heavy for job in first_eight) == 6, first_eight
    assert sum(job in light for job in first_eight) == 2, first_eight
    assert sorted(order) == sorted(light + heavy)  # nothing lost or doubled


def test_with_fair_queuing_off_jobs_wait_in_arrival_order(redis_server: str,
                                                          tmp_root: Path) -> None:
    with _apis(redis_server, tmp_root, "fifo", "fifo", fair_queuing=False) as (
            first, second, own):
        _, flood_key = own.store.tenants.create_tenant("flood", ["chat"])
        _, quiet_key = own.store.tenants.create_tenant("quiet", ["chat"])
        flood = _submit(first, flood_key, 4, "Flood")
        quiet = _submit(second, quiet_key, 1, "Quiet")
        assert _taken_order(own.redis) == [*flood, *quiet]


def test_a_broker_that_forgot_the_script_still_gets_the_job_once(tmp_root: Path) -> None:
    """A broker restarted (or flushed) since the API's last push has no script: the push
    loads it and goes on; the submit is a 202 and its message is queued once. A
    redis-server of its own: SCRIPT FLUSH empties every database's scripts."""
    port = free_port()
    private = start_redis(port, tmp_root / "logs")
    try:
        url = f"redis://127.0.0.1:{port}/0"
        with _apis(url, tmp_root, "fairnoscript", "noscript") as (first, _, own):
            _, key = own.store.tenants.create_tenant("solo", ["chat"])
            before = _submit(first, key, 1, "Before")
            own.redis.script_flush()
            after = _submit(first, key, 1, "After")
            assert _taken_order(own.redis) == [*before, *after]
    finally:
        private.stop()


def test_jobs_taken_since_the_last_push_and_untagged_messages_keep_the_order(
        redis_server: str) -> None:
    """Workers pop without telling the tags; the reconciler's resends and kombu's restores
    push without a tag. The next push trims what was taken and places around the rest."""
    client = redis.Redis.from_url(redis_server.rsplit("/", 1)[0] + f"/{own_db(__name__, 'raw')}")
    fair = FairPush(client, "tgfairraw", burst=0)
    sublist = "raw.queue"

    def push(job: str, tenant: int) -> int:
        message = f'{{"headers": {{"id": "{job}"}}}}'
        return fair.push(sublist, message, job, tenant, cost(10, 10, 1))

    try:
        for i in range(4):
            push(f"a{i}", 1)
        assert task_id(client.rpop(sublist)) == "a0"  # a worker took two
        assert task_id(client.rpop(sublist)) == "a1"
        assert push("b0", 2) == 1  # ahead of a3 only: it starts at a2's tag, after a2
        assert client.zcard(keys.fair_tags("tgfairraw", sublist)) == 3  # a0, a1 trimmed
        # A worker's direct queue ends with the worker: its tags go a day after.
        assert 0 < client.ttl(keys.fair_finish("tgfairraw", sublist)) <= TAGS_TTL_S
        client.rpush(sublist, '{"headers": {"id": "restored"}}')  # kombu's restore: the head
        assert push("c0", 3) == 1
        order = [task_id(m) for m in reversed(client.lrange(sublist, 0, -1))]
        assert order == ["restored", "a2", "b0", "c0", "a3"]
        client.delete(sublist)
        assert push("c0", 3) == 0  # an emptied list starts afresh
        assert client.zcard(keys.fair_tags("tgfairraw", sublist)) == 1
    finally:
        client.flushdb()
