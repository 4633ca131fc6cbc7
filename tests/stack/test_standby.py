"""Standby pool on real workers (lane `standby`, pool `vllm`): `a` starts active, `b` starts
in standby with its engine loaded. The scheduler steers them with Celery control commands.

The tests run in file order and share the two workers.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from tidegate_client import Client

from scheduler import autoscale, control, health
from tasks.app import make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.helpers import Stack
from tidegate import keys
from tidegate.fleet import read_heartbeat
from tidegate.records import Heartbeat
from tidegate.settings import get_settings
from tidegate_tools.procs import Proc, start_worker, tidegate_argv, wait_until

LANE, QUEUE = "standby", "standby.vllm"
PROMPT = "Where is my parcel?"
# Long enough to fill several KV blocks, whatever the engine's block size.
PARCEL_DESK = "You are the parcel desk of the shop. Answer about parcels and deliveries. " * 8


@dataclass
class Pair:
    a: str
    b: str
    logs: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self, which: str, standby: bool) -> None:
        # One core each: a restarted engine bound to the core a busy engine spins on took
        # minutes to start here.
        name, core = (self.a, "0") if which == "a" else (self.b, "1")
        self.procs[which] = start_worker(dict(os.environ), LANE, name, self.logs,
                                         standby=standby, cpus=core)


def heartbeat(stack: Stack, name: str) -> Heartbeat | None:
    return read_heartbeat(stack.redis, stack.namespace, name)


def state_of(stack: Stack, name: str) -> str | None:
    hb = heartbeat(stack, name)
    return hb.state if hb else None


def boot_of(stack: Stack, name: str) -> str | None:
    hb = heartbeat(stack, name)
    return hb.boot if hb else None


def alloc_latency_ms(stack: Stack, name: str) -> float | None:
    hb = heartbeat(stack, name)
    return hb.stats.avg_cache_allocation_latency_ms if hb and hb.stats else None


@pytest.fixture(scope="module")
def pair(stack: Stack, tmp_root: Path) -> Iterator[Pair]:
    p = Pair("standby-a@tidegate", "standby-b@tidegate", tmp_root / "logs")
    _, key = stack.store.tenants.create_tenant("standby-tenant", [LANE])
    p.key = key  # type: ignore[attr-defined]
    try:
        p.start("a", standby=False)
        p.start("b", standby=True)
        wait_until(lambda: state_of(stack, p.a) == "active" and state_of(stack, p.b) == "standby",
                   240, "worker a active and worker b in standby", list(p.procs.values()),
                   poll_s=0.5)
        yield p
    finally:
        for proc in p.procs.values():
            proc.stop()


def send_direct(stack: Stack, worker: str, prompt: str, max_tokens: int = 4) -> str:
    """A job straight to one worker's direct queue, so that no other worker can take it;
    the stack's tenant owns it. Returns its id."""
    job_id, queue = str(uuid.uuid4()), keys.direct_queue(stack.namespace, worker)
    stack.store.jobs.create_job(job_id, stack.tenant_id, LANE, queue, 5, None,
                                {"max_tokens": max_tokens}, 4)
    payload = GeneratePayload(job_id=job_id, lane=LANE, prompt=prompt, prompt_tokens=4,
                              sampling=Sampling(max_tokens=max_tokens))
    send_generate(make_app(get_settings()), payload, queue, 5)
    return job_id


def cached_tokens(stack: Stack, worker: str, prompt: str) -> int:
    """One job of `prompt` on `worker`: the prompt tokens it found in the prefix cache."""
    job_id = send_direct(stack, worker, prompt)
    with Client(stack.base_url, stack.api_key) as client:
        assert list(client.stream(job_id))[-1].kind == "done"
    job = stack.store.jobs.get_job(job_id)
    assert job is not None and job.worker == worker
    return job.cached_tokens or 0


def run(stack: Stack, key: str, n: int = 1, **options: object) -> list[dict]:
    with Client(stack.base_url, key) as client:
        ids = [client.submit(LANE, prompt=PROMPT, **{"max_tokens": 4, **options})["job_id"]
               for _ in range(n)]
        for job_id in ids:
            assert list(client.stream(job_id))[-1].kind == "done"
        return [client.job(job_id) for job_id in ids]


def test_a_standby_worker_takes_no_lane_job_until_activated(stack: Stack, pair: Pair) -> None:
    app, settings = make_app(get_settings()), get_settings()
    jobs = run(stack, pair.key, n=6)  # type: ignore[attr-defined]
    assert {j["worker"] for j in jobs} == {pair.a}
    assert not control.consumes(app, pair.b, QUEUE)

    assert control.activate(app, stack.redis, settings, pair.b, LANE, "vllm",
                            warm_prompts=settings.lanes[LANE].warm_prompts)
    wait_until(lambda: state_of(stack, pair.b) == "active", 10, "b to report active")
    # With a returned to standby, only the activated worker can take the lane's jobs.
    assert control.deactivate(app, stack.redis, settings, pair.a, LANE, "vllm")
    wait_until(lambda: state_of(stack, pair.a) == "standby", 10, "a to report standby")
    jobs = run(stack, pair.key, n=4)  # type: ignore[attr-defined]
    assert {j["worker"] for j in jobs} == {pair.b}


def test_activation_survives_a_worker_restart(stack: Stack, pair: Pair) -> None:
    app, settings = make_app(get_settings()), get_settings()
    old_boot = boot_of(stack, pair.b)
    pair.procs["b"].stop()
    pair.start("b", standby=True)  # comes back consuming its direct queue only
    wait_until(lambda: boot_of(stack, pair.b) not in (None, old_boot)
               and state_of(stack, pair.b) == "standby", 240, "b to come back in standby",
               [pair.procs["b"]], poll_s=0.5)
    actions = control.reconcile(app, stack.redis, settings)
    assert actions == [f"re-activated {pair.b} on {QUEUE}"]
    assert control.consumes(app, pair.b, QUEUE)
    wait_until(lambda: state_of(stack, pair.b) == "active", 10, "b to report active again")
    jobs = run(stack, pair.key, n=2)  # type: ignore[attr-defined]
    assert {j["worker"] for j in jobs} == {pair.b}


def test_draining_finishes_every_in_flight_job(stack: Stack, pair: Pair) -> None:
    app, settings = make_app(get_settings()), get_settings()
    with Client(stack.base_url, pair.key) as client:  # type: ignore[attr-defined]
        ids = [client.submit(LANE, prompt=PROMPT, max_tokens=1800)["job_id"] for _ in range(3)]
        wait_until(lambda: all(client.job(j)["started_at"] for j in ids), 60,
                   "the long jobs to start on b")
        assert control.deactivate(app, stack.redis, settings, pair.b, LANE, "vllm")
        # deactivate returned: the worker stopped consuming and has nothing in flight.
        rows = [client.job(j) for j in ids]
        events = [list(client.stream(j)) for j in ids]
    assert all(r["status"] == "done" and r["completion_tokens"] == 1800 for r in rows)
    for evs in events:
        assert [e.seq for e in evs] == list(range(len(evs)))
        assert sum(len(e.token_ids) for e in evs) == 1800
    assert not control.consumes(app, pair.b, QUEUE)


def test_the_scheduler_prewarms_a_standby_worker_ahead_of_forecast_traffic(
        stack: Stack, pair: Pair) -> None:
    app, settings = make_app(get_settings()), get_settings()
    assert control.activate(app, stack.redis, settings, pair.a, LANE, "vllm")
    wait_until(lambda: state_of(stack, pair.a) == "active", 10, "a to report active")
    # b drained in the test before; its heartbeat says so at its next beat, which may come
    # after a's.
    wait_until(lambda: state_of(stack, pair.b) == "standby", 10, "b to report standby")
    system = {"role": "system", "content": PARCEL_DESK}
    with Client(stack.base_url, pair.key) as client:  # type: ignore[attr-defined]
        job = client.submit(LANE, messages=[system, {"role": "user", "content": PROMPT}],
                            max_tokens=4)
        assert list(client.stream(job["job_id"]))[-1].kind == "done"
    hot = [p for p in autoscale.hot_prefixes(stack.redis, settings, LANE)
           if system["content"] in p]
    assert len(hot) == 1  # recorded by the API, rendered with the chat template

    now = datetime.now(UTC)

    def this_lanes(actions: list[dict]) -> list[dict]:
        # Another lane's worker whose heartbeat lapsed under load gets an action of its
        # own (a CI run's chat worker was re-activated here): not this test's business.
        return [a for a in actions if a["lane"] == LANE]

    assert this_lanes(autoscale.autoscale(app, stack.redis, stack.store, settings,
                                          now=now)) == []
    # Yesterday this lane had far more traffic than one worker carries, from about now
    # on (today being quiet halves it: the trend is clamped at 0.5).
    for minute in range(-30, 45):
        at = now - timedelta(days=1) + timedelta(minutes=minute)
        stack.store.traffic.record_arrivals(LANE, at, 1_000_000)
    actions = this_lanes(autoscale.autoscale(app, stack.redis, stack.store, settings, now=now))
    assert [(a["action"], a["worker"], a["verified"]) for a in actions] == [
        ("activate", pair.b, True)]
    assert actions[0]["want_active"] >= 2 and actions[0]["forecast_rps"] > 100
    wait_until(lambda: state_of(stack, pair.b) == "active", 10, "b to report active")
    # b never served the parcel desk, yet its next request starting with it finds it in
    # the cache; one starting with a prefix of the same length it never saw does not.
    warmed = cached_tokens(stack, pair.b, hot[0] + PROMPT)
    unseen = cached_tokens(stack, pair.b, hot[0].replace("parcel", "invoice") + PROMPT)
    assert warmed > unseen, (warmed, unseen)


def force_latency(stack: Stack, worker: str, latency_ms: float | None) -> None:
    """The worker reports this allocation latency (None: its engine's own again)."""
    make_app(get_settings()).control.broadcast(
        "tidegate_fault", arguments={"alloc_latency_ms": latency_ms}, destination=[worker],
        reply=True, timeout=5)
    if latency_ms is not None:
        wait_until(lambda: alloc_latency_ms(stack, worker) == latency_ms, 10,
                   f"{worker} to report the forced latency")


def test_a_restart_that_would_leave_the_lane_below_its_minimum_is_deferred(
        stack: Stack, pair: Pair) -> None:
    """With b the lane's only active worker (its minimum is 1), its slow allocator gets
    the cheap fix and then no restart: b keeps its process and keeps serving."""
    app, settings = make_app(get_settings()), get_settings()
    assert control.activate(app, stack.redis, settings, pair.b, LANE, "vllm")
    assert control.deactivate(app, stack.redis, settings, pair.a, LANE, "vllm")
    wait_until(lambda: state_of(stack, pair.a) == "standby" and state_of(stack, pair.b)
               == "active", 10, "a in standby and b active")
    old_boot = boot_of(stack, pair.b)
    try:
        force_latency(stack, pair.b, 900.0)
        checks = [health.check(app, stack.redis, settings) for _ in range(3)]
    finally:
        force_latency(stack, pair.b, None)
        stack.redis.delete(keys.health_strikes(stack.namespace, pair.b))
    assert checks[0] == []
    assert [(a["action"], a["worker"]) for a in checks[1]] == [("reset_prefix_cache", pair.b)]
    assert [(a["action"], a["worker"]) for a in checks[2]] == [("restart_deferred", pair.b)]
    assert "below its minimum" in checks[2][0]["reason"]
    assert boot_of(stack, pair.b) == old_boot and state_of(stack, pair.b) == "active"
    assert {j["worker"] for j in run(stack, pair.key, n=2)} == {pair.b}  # type: ignore[attr-defined]


class Load(threading.Thread):
    """Submits one lane job after another until stopped; records each finished row and
    anything that went wrong (a job not finished in time is a failure, not a hang)."""

    def __init__(self, stack: Stack, key: str) -> None:
        super().__init__(name="load", daemon=True)
        self.stack, self.key = stack, key
        self.served: list[dict] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with Client(self.stack.base_url, self.key) as client:
            while not self.stop.is_set():
                try:
                    self.served.append(self.one(client))
                except Exception as exc:  # recorded and asserted on by the test
                    self.failures.append(repr(exc))

    @staticmethod
    def one(client: Client) -> dict:
        job_id = client.submit(LANE, prompt=PROMPT, max_tokens=4)["job_id"]
        rows = []

        def ended() -> bool:
            rows.append(client.job(job_id))
            return rows[-1]["status"] not in ("queued", "running")

        wait_until(ended, 60, f"job {job_id} to end")
        return rows[-1]


@pytest.mark.timeout(900)  # a restart loads a new engine while the other worker is busy
def test_high_allocation_latency_gets_the_cheap_fix_then_a_rolling_restart(
        stack: Stack, pair: Pair) -> None:
    """The health sequence on a worker whose allocation latency stays over the threshold:
    first its prefix cache is reset; when that does not help, it is drained (the jobs it
    runs finish), its process restarts with a fresh engine, is warmed and reactivated.
    The lane's other worker serves every job throughout."""
    app, settings = make_app(get_settings()), get_settings()
    assert control.activate(app, stack.redis, settings, pair.a, LANE, "vllm")
    assert control.activate(app, stack.redis, settings, pair.b, LANE, "vllm")
    wait_until(lambda: state_of(stack, pair.b) == "active" == state_of(stack, pair.a), 10,
               "both workers active")
    old_boot = boot_of(stack, pair.b)
    force_latency(stack, pair.b, 900.0)
    # A prefix b holds, to show the reset: b finds it cached before, and not after.
    ticket = f"Ticket {uuid.uuid4().hex}: " + PARCEL_DESK
    cached_tokens(stack, pair.b, ticket + PROMPT)
    assert cached_tokens(stack, pair.b, ticket + "Is it insured?") > 0

    assert health.check(app, stack.redis, settings) == []  # strike one: watch only
    second = health.check(app, stack.redis, settings)  # strike two: the cheap fix
    assert [(a["action"], a["worker"]) for a in second] == [("reset_prefix_cache", pair.b)]
    assert cached_tokens(stack, pair.b, ticket + "Is it late?") == 0

    load = Load(stack, pair.key)  # type: ignore[attr-defined]
    load.start()
    # Jobs b runs when the restart begins: the drain lets them finish.
    running_on_b = [send_direct(stack, pair.b, PROMPT, max_tokens=1800) for _ in range(3)]
    wait_until(lambda: all(_started(stack, j) for j in running_on_b), 60,
               "the long jobs to start on b")
    try:
        third = health.check(app, stack.redis, settings)  # it did not help: restart
    finally:
        load.stop.set()
        load.join(timeout=120)
    assert [(a["action"], a["worker"], a["drained"], a["restarted"], a["reactivated"])
            for a in third] == [("rolling_restart", pair.b, True, True, True)]
    assert not load.is_alive() and load.failures == []
    assert load.served and all(j["status"] == "done" for j in load.served)
    for job_id in running_on_b:
        job = stack.store.jobs.get_job(job_id)
        assert job is not None and job.status == "done" and job.completion_tokens == 1800
    wait_until(lambda: state_of(stack, pair.b) == "active", 10, "b's heartbeat to say active")
    assert boot_of(stack, pair.b) != old_boot  # a new process, with a new engine, serves
    assert alloc_latency_ms(stack, pair.b) != 900.0  # the fault is gone
    assert state_of(stack, pair.a) == "active"
    assert run(stack, pair.key, n=4)  # type: ignore[attr-defined]  # the lane serves with both


def _started(stack: Stack, job_id: str) -> bool:
    job = stack.store.jobs.get_job(job_id)
    return job is not None and job.started_at is not None


def test_two_beats_running_together_act_once_per_period(stack: Stack, pair: Pair,
                                                        tmp_root: Path) -> None:
    """Two schedulers (two replicas): one beat holds redbeat's lock and sends the ticks,
    so no tick is even sent twice (none skipped by the per-period guard), and each
    period acts once."""
    env = {**os.environ, "TIDEGATE_SCHEDULER_TICK_S": "1"}
    beats = [Proc(f"scheduler-{i}", tidegate_argv("scheduler"), tmp_root / "logs" /
                  f"scheduler-{i}.log", env) for i in range(2)]
    stream = keys.scheduler_actions(stack.namespace)
    skipped_key = keys.scheduler_lock(stack.namespace, "skipped", 0)
    stack.redis.delete(skipped_key)
    try:
        def ticks() -> list[dict]:
            entries = stack.redis.xrange(stream)
            return [json.loads(f[b"a"]) for _, f in entries
                    if json.loads(f[b"a"])["action"] == "tick"]

        wait_until(lambda: len(ticks()) >= 5, 90, "five ticks acted on", beats)
    finally:
        for proc in beats:
            proc.stop()
    assert int(stack.redis.get(skipped_key) or 0) == 0  # the second beat sent none
    periods = [t["period"] for t in ticks()]
    assert len(periods) == len(set(periods))  # one acting tick per period, never two
