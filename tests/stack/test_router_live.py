"""Routing on real workers: the `support` lane is served by two vLLM workers standing as
two pools, `primary` (preferred) and `fallback` (one slot, and the LoRA adapter).

The tests run in file order: the last ones stop the primary worker.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from tidegate_client import Client

from tests.helpers import Stack, engine_stats, hold
from tidegate import keys
from tidegate_tools.procs import Proc, start_worker, wait_until

PROMPT = "Please check the status of my refund"


@dataclass
class Pools:
    primary: str
    fallback: str
    procs: dict[str, Proc]


@pytest.fixture(scope="module")
def lora_path(model_path: Path) -> Path:
    from tidegate_tools.testlora import build_test_lora

    return build_test_lora(model_path, model_path.parent / "tidegate-test-lora")


@pytest.fixture(scope="module")
def pools(stack: Stack, lora_path: Path, tmp_root: Path) -> Iterator[Pools]:
    names = {"primary": "support-primary@tidegate", "fallback": "support-fallback@tidegate"}
    envs = {"primary": dict(os.environ),
            "fallback": {**os.environ, "TIDEGATE_ENGINE_SLOTS": "1",
                         "TIDEGATE_LORA_ADAPTERS": f"support={lora_path}"}}
    procs: dict[str, Proc] = {}
    try:
        for pool, name in names.items():
            procs[pool] = start_worker(envs[pool], "support", name, tmp_root / "logs", pool=pool)
        wait_until(lambda: all(_active(stack, n) for n in names.values()), 240,
                   "both support workers to be active", list(procs.values()), poll_s=0.5)
        yield Pools(names["primary"], names["fallback"], procs)
    finally:
        for proc in procs.values():
            proc.stop()


def _active(stack: Stack, name: str) -> bool:
    import json

    raw = stack.redis.get(keys.worker_heartbeat(stack.namespace, name))
    return raw is not None and json.loads(raw)["state"] == "active"


def run_job(stack: Stack, **options: object) -> tuple[dict, list]:
    with Client(stack.base_url, stack.api_key) as client:
        job_id = client.submit("support", prompt=PROMPT, **options)["job_id"]
        events = list(client.stream(job_id))
        return client.job(job_id), events


def test_jobs_go_to_the_primary_pool(stack: Stack, pools: Pools) -> None:
    for _ in range(3):
        job, events = run_job(stack, max_tokens=4)
        assert events[-1].kind == "done"
        assert job["worker"] == pools.primary
        assert job["queue"] == "support.primary"
        assert job["route_reason"].startswith("preferred pool primary")


def test_a_lora_job_goes_to_the_worker_with_the_adapter(stack: Stack, pools: Pools) -> None:
    plain, plain_events = run_job(stack, max_tokens=24, temperature=0.0)
    tuned, tuned_events = run_job(stack, max_tokens=24, temperature=0.0, lora="support")
    assert plain["worker"] == pools.primary
    assert tuned["worker"] == pools.fallback and tuned["lora"] == "support"
    assert "LoRA adapter 'support'" in tuned["route_reason"]

    def ids(events: list) -> list[int]:
        return [i for e in events if e.kind == "token" for i in e.token_ids]

    assert len(ids(tuned_events)) == 24 and ids(tuned_events) != ids(plain_events)


def backlog_on_fallback(stack: Stack, pools: Pools, priorities: list[int],
                        **options: object) -> tuple[list[tuple[int, str]], dict]:
    """A first job holds the fallback worker's one slot (the worker's fault hold keeps it
    there after its first token, however fast the engine) while jobs of `priorities`
    arrive in that order; then the slot is released and every job streams to its end.
    Returns the arrivals as (priority, job_id) and every job's row."""
    hold([pools.fallback], 1)
    try:
        with Client(stack.base_url, stack.api_key) as client:
            blocker = client.submit("support", prompt=PROMPT, max_tokens=64,
                                    **options)["job_id"]
            wait_until(lambda: engine_stats(pools.fallback)["held"] == blocker, 60,
                       "the fallback worker to hold the first job in its slot",
                       [pools.procs["fallback"]], poll_s=0.1)
            arrivals = [(priority, client.submit("support", prompt=PROMPT, max_tokens=2,
                                                 priority=priority, **options)["job_id"])
                        for priority in priorities]
            hold([pools.fallback], 0)
            for job_id in [blocker, *(j for _, j in arrivals)]:
                assert list(client.stream(job_id))[-1].kind == "done"
            rows = {j: client.job(j) for j in [blocker, *(j for _, j in arrivals)]}
    finally:
        hold([pools.fallback], 0)
    # The backlog was real: every job arrived while the first one held the slot.
    assert max(at(rows, j, "enqueued_at") for _, j in arrivals) < at(rows, blocker,
                                                                     "finished_at")
    return arrivals, rows


def at(rows: dict, job_id: str, name: str) -> datetime:
    value = rows[job_id][name]  # the SDK's Job: a datetime
    assert isinstance(value, datetime)
    return value


def test_higher_priority_starts_first_under_a_backlog(stack: Stack, pools: Pools) -> None:
    """LoRA jobs go to the fallback worker, whose one slot is held: the urgent ones,
    arrived last, are started before the others."""
    arrivals, rows = backlog_on_fallback(stack, pools, [1, 1, 1, 8, 8, 8], lora="support")
    assert {rows[j]["worker"] for _, j in arrivals} == {pools.fallback}
    started = {p: [at(rows, j, "started_at") for q, j in arrivals if q == p] for p in (1, 8)}
    assert max(started[8]) < min(started[1])


def test_a_session_sticks_to_its_worker_then_moves_when_it_dies(stack: Stack,
                                                                 pools: Pools) -> None:
    first, _ = run_job(stack, max_tokens=4, session_id="crm-session-1")
    second, _ = run_job(stack, max_tokens=4, session_id="crm-session-1")
    assert first["worker"] == second["worker"] == pools.primary
    assert second["route_reason"].startswith("session affinity")

    heartbeat = keys.worker_heartbeat(stack.namespace, pools.primary)
    ttl = stack.redis.ttl(heartbeat)
    assert 0 < ttl <= keys.heartbeat_ttl_s(0.5)  # how long a crashed worker could be chosen
    # A crash, not a clean stop (which removes the record at once): its last heartbeat
    # stays behind and the router must stop choosing it when that heartbeat lapses.
    primary = pools.procs["primary"]
    os.killpg(primary.popen.pid, signal.SIGKILL)
    primary.popen.wait(10)
    assert stack.redis.exists(heartbeat), "a killed worker removed its own heartbeat"
    wait_until(lambda: not stack.redis.exists(heartbeat), keys.heartbeat_ttl_s(0.5) + 5,
               "the killed worker's heartbeat to lapse")

    third, events = run_job(stack, max_tokens=4, session_id="crm-session-1")
    assert events[-1].kind == "done" and third["worker"] == pools.fallback
    assert "session's worker support-primary@tidegate unavailable" in third["route_reason"]
    assert "pool primary: no healthy active worker" in third["route_reason"]


def test_new_jobs_go_to_the_fallback_once_the_primary_is_gone(stack: Stack,
                                                              pools: Pools) -> None:
    job, events = run_job(stack, max_tokens=4)
    assert events[-1].kind == "done"
    assert job["worker"] == pools.fallback and job["queue"] == "support.fallback"
    assert job["route_reason"].startswith("fallback pool fallback")


def test_the_lane_queue_serves_priority_first_then_arrival_order(stack: Stack,
                                                                 pools: Pools) -> None:
    """Plain jobs now go to the fallback pool's queue, which its one-slot worker takes one
    at a time. Jobs of two priorities arrive interleaved while its slot is held: the
    urgent ones start first, and each priority starts in its arrival order."""
    arrivals, rows = backlog_on_fallback(stack, pools, [1, 8] * 3)
    assert {r["queue"] for r in rows.values()} == {"support.fallback"}
    started = sorted((j for _, j in arrivals), key=lambda j: at(rows, j, "started_at"))
    assert started == [j for p, j in arrivals if p == 8] + [j for p, j in arrivals if p == 1]
