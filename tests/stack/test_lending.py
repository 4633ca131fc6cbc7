"""Work-conserving lanes on real workers: the `lender` lane's worker lends its idle slot to
the `borrower` lane's jobs while the borrower's own worker is full, and takes it back for
its own lane's arrival at once (vLLM preempts the borrowed job, which then goes on). The
router's half runs end to end; the lending worker's pull (a job queued while the lender
was busy, taken once a slot is idle) runs on a real Redis with the worker's counts given.

Two vLLM workers of one slot each (tests/lanes.toml: `lender` lends to `borrower`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import redis
from tidegate_client import Client

from api.fleet import FLEET_CACHE_S
from tests.helpers import Stack, make_tenant
from tidegate import keys
from tidegate.lanes import load_lanes
from tidegate.records import WorkerState
from tidegate_tools.procs import Proc, start_worker, wait_until
from workers.lending import MOVE, Lender, move_keys
from workers.vllm_patches.kvcache import ALLOC_DELAY_ENV

WORKERS = {"lender": "lender-test@tidegate", "borrower": "borrower-test@tidegate"}
# Each engine step slowed by this (vLLM's allocation, workers/vllm_patches/kvcache.py's
# fault injection): the test model makes thousands of tokens a second, and a long job must
# still run when the next arrives. LONG tokens then take seconds.
STEP_DELAY_MS = "5"
LONG = 1000


def test_the_move_takes_the_most_urgent_oldest_message_only_when_nothing_of_its_own_waits(
        redis_server: str) -> None:
    """The lender's script (workers/lending.py) on a real Redis: lists as kombu keeps them
    (pushed left, popped right; sub-list `q|N` for priority step N, 0 served first)."""
    client = redis.Redis.from_url(redis_server)
    own, direct, src = "lendtest.own", "lendtest.direct", "lendtest.src"
    lists = [sub for q in (own, direct, src) for sub in keys.queue_sublists(q)]
    client.delete(*lists)
    script = client.register_script(MOVE)
    argv = move_keys([own, direct], [src], direct)
    own_lists = len(keys.queue_sublists(own)) * 2
    try:
        step = keys.queue_sublists(src)

        def move(most: int) -> int:
            reply = script(keys=argv, args=[own_lists, most])
            assert len(reply) == 1 + max(0, int(reply[0]))  # the count, then each message
            return int(reply[0])

        def taken() -> list[bytes]:
            got = [m for sub in keys.queue_sublists(direct) for m in client.lrange(sub, 0, -1)]
            client.delete(*keys.queue_sublists(direct))
            return got

        client.lpush(step[5], "old-5", "new-5")
        client.lpush(step[2], "old-2", "new-2")
        assert move(0) == -1  # a look only: one waits, nothing moves
        assert client.llen(step[2]) == 2
        client.lpush(keys.queue_sublists(own)[3], "own job")
        assert move(2) == 0  # its own lane's job waits
        client.delete(keys.queue_sublists(own)[3])
        assert move(1) == 1
        assert client.lrange(keys.queue_sublists(direct)[2], 0, -1) == [b"old-2"]
        assert move(1) == 0  # the taken one is not consumed yet
        assert taken() == [b"old-2"]
        assert move(2) == 2  # most urgent step first, oldest first within it
        assert sorted(taken()) == [b"new-2", b"old-5"]
        assert move(5) == 1 and taken() == [b"new-5"]
        assert move(0) == 0  # nothing left
    finally:
        client.delete(*lists)


@pytest.fixture(scope="module")
def lanes(stack: Stack, tmp_root: object) -> Iterator[tuple[str, dict[str, Proc]]]:
    """A key of a tenant on both lanes, and the two workers (one slot each)."""
    _, key = make_tenant(stack.store, "lending-tenant", ["lender", "borrower"], max_priority=9)
    env = {**os.environ, "TIDEGATE_ENGINE_SLOTS": "1", ALLOC_DELAY_ENV: STEP_DELAY_MS}
    procs: dict[str, Proc] = {}
    try:
        for lane, name in WORKERS.items():
            procs[lane] = start_worker(env, lane, name, tmp_root / "logs")  # type: ignore[operator]
        wait_until(lambda: all(beat(stack, n).get("state") == "active" for n in WORKERS.values()),
                   240, "both lending workers to be active", list(procs.values()), poll_s=0.5)
        yield key, procs
    finally:
        try:
            _end_all(stack, key)  # before the workers go: later modules wait for no job
        finally:
            for proc in procs.values():
                proc.stop()


def _unended(client: Client) -> list[str]:
    return [job.id for job in client.jobs() if job.status in ("queued", "running")]


def _end_all(stack: Stack, key: str) -> None:
    """Cancels what a failed test left running or queued here, and waits for the ends."""
    with Client(stack.base_url, key) as client:
        for job_id in _unended(client):
            client.cancel(job_id)
        wait_until(lambda: not _unended(client), 60, "this module's jobs to end")


def beat(stack: Stack, name: str) -> dict:
    raw = stack.redis.get(keys.worker_heartbeat(stack.namespace, name))
    return json.loads(raw) if raw else {}


def running(stack: Stack, name: str, record: dict | None = None) -> int:
    stats = (beat(stack, name) if record is None else record).get("stats") or {}
    return int(stats.get("running", 0)) + int(stats.get("waiting", 0))


def settled(stack: Stack, name: str, jobs: int) -> None:
    """Waits for two beats in a row showing `jobs` in the worker's engine: the API's view of
    the fleet (cached FLEET_CACHE_S, under a beat period) then shows it too."""
    seen: list[float] = []

    def twice() -> bool:
        now = beat(stack, name)
        if running(stack, name, now) != jobs:
            seen.clear()
        elif not seen or now.get("ts") != seen[-1]:
            seen.append(now.get("ts", 0.0))
        return len(seen) >= 2

    assert float(os.environ["TIDEGATE_HEARTBEAT_S"]) > FLEET_CACHE_S
    wait_until(twice, 60, f"two beats of {name} showing {jobs} jobs", poll_s=0.02)


def test_a_full_lane_borrows_an_idle_slot_and_the_owner_takes_it_back(
        stack: Stack, lanes: tuple[str, dict[str, Proc]]) -> None:
    key, _ = lanes
    with Client(stack.base_url, key) as client:
        # The borrower's own worker busy with its one slot, as its beat says.
        own = client.submit("borrower", prompt="Where is my parcel?", max_tokens=LONG)
        settled(stack, WORKERS["borrower"], 1)
        settled(stack, WORKERS["lender"], 0)

        lent = client.submit("borrower", prompt="And my refund?", max_tokens=LONG)
        assert lent["queue"] == keys.direct_queue(stack.namespace, WORKERS["lender"])
        row = stack.store.jobs.get_job(lent["job_id"])
        assert row is not None and "borrowed an idle slot of " + WORKERS["lender"] in (
            row.route_reason or "")
        # Its first token is in the row: it runs in the lender's engine (the row is written
        # at the first token; the client's stream may show it later).
        wait_until(lambda: stack.store.jobs.get_job(lent["job_id"]).first_token_at is not None, 60,
                   "the borrowed job's first token", poll_s=0.01)
        # The lender's own arrival: its one slot is the borrowed job's, yet it runs now.
        mine = client.submit("lender", prompt="Revenue this quarter?", max_tokens=8)
        assert list(client.stream(mine["job_id"]))[-1].kind == "done"
        lent_events = list(client.stream(lent["job_id"]))
        list(client.stream(own["job_id"]))
    ours = stack.store.jobs.get_job(mine["job_id"])
    theirs = stack.store.jobs.get_job(lent["job_id"])
    assert ours is not None and theirs is not None and theirs.finished_at is not None
    assert ours.enqueued_at < theirs.finished_at, (
        "the setup failed: the borrowed job had ended", theirs.started_at,
        theirs.first_token_at, theirs.finished_at)
    assert ours.completion_tokens == 8
    assert ours.finished_at < theirs.finished_at, "the lender's job waited for the borrowed one"
    # The borrowed job went on after its preemption: every token, once, in order.
    assert lent_events and lent_events[-1].kind == "done"
    seqs = [e.seq for e in lent_events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for job_id in (lent["job_id"], own["job_id"]):
        row = stack.store.jobs.get_job(job_id)
        assert row is not None and row.status.value == "done"
        assert row.completion_tokens == LONG


def test_a_lender_takes_waiting_jobs_for_its_idle_slots_only_after_a_look(
        redis_server: str) -> None:
    """The lending worker's loop (workers/lending.py `Lender.tick`) on a real Redis, with
    the worker's counts given: nothing while its slots are taken; a waiting job only at the
    look after the one that saw it (the borrower's own idle workers take theirs first); no
    more than its idle slots, counting jobs moved whose task has not started."""
    client = redis.Redis.from_url(redis_server)
    state = {"in_flight": 0}
    lanes = load_lanes(os.environ["TIDEGATE_LANES_FILE"])
    worker = SimpleNamespace(
        settings=SimpleNamespace(engine_slots=2, lanes=lanes), lane="lender",
        pool="lendtest", pool_queue="lender.lendtest", direct_queue="lendtest.direct.lender",
        redis=client, ctx=SimpleNamespace(borrowed=0), stopped=False,
        state=lambda: WorkerState.ACTIVE, counts=lambda: (state["in_flight"], {}))
    lists = [sub for q in ("lender.lendtest", "borrower.lendtest", worker.direct_queue)
             for sub in keys.queue_sublists(q)]
    client.delete(*lists)
    lender = Lender(worker)  # type: ignore[arg-type]
    waiting = keys.queue_sublists("borrower.lendtest")[5]  # a pool no real worker has
    direct = keys.queue_sublists(worker.direct_queue)[5]
    try:
        for i in range(3):
            client.lpush(waiting, json.dumps({"headers": {"id": f"job-{i}"}}))
        state["in_flight"] = 2
        assert lender.tick() == 0 and client.llen(waiting) == 3  # both slots taken
        state["in_flight"] = 0
        assert lender.tick() == 0  # a look: seen waiting, left for the borrower's workers
        assert lender.tick() == 2 and client.llen(direct) == 2  # one per idle slot
        client.delete(direct)  # its consumer took them; their tasks have not started
        assert lender.tick() == 0 and client.llen(waiting) == 1
        lender.started("job-0")  # a slot's worth came free: a look, then the move
        assert lender.tick() == 0 and lender.tick() == 1 and client.llen(waiting) == 0
    finally:
        client.delete(*lists)
