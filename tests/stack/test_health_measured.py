"""The health check acting on a real measurement (scheduler/health.py): a worker whose KV
allocations are slow for real, not one told what latency to report.

A `support` worker of the module's own (pool `primary`; the session stack serves no
support jobs) starts with the allocator fault (workers/vllm_patches/kvcache.py
TIDEGATE_VLLM_KV_ALLOC_DELAY_MS): in its vLLM engine core, each `allocate_slots` call
waits before it runs, inside the region the plugin times. So the whole path runs: the
plugin's timing in the engine core, the shared stats file, the adapter's `stats()`, the
worker's heartbeat, the scheduler's health pass and its control command. The session
stack's chat and finance workers, measured the same way with no fault, are the contrast:
the pass leaves them alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidegate_client import Client

from scheduler import health
from tasks.app import make_app
from tests.helpers import Stack
from tidegate import keys
from tidegate.fleet import read_heartbeat
from tidegate.records import WorkerState
from tidegate.settings import get_settings
from tidegate_tools.procs import Proc, start_worker, wait_until
from workers.vllm_patches.kvcache import ALLOC_DELAY_ENV

LANE, POOL = "support", "primary"
SLOW = "slow-alloc@tidegate"
DELAY_MS = 300.0  # per allocate_slots call; the default threshold is 200 ms per step
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def slow_worker(stack: Stack, tmp_root: Path) -> Iterator[Proc]:
    proc = start_worker({**os.environ, ALLOC_DELAY_ENV: str(DELAY_MS)}, LANE, SLOW,
                        tmp_root / "logs", pool=POOL, cpus="1")
    try:
        wait_until(lambda: state_of(stack, SLOW) == WorkerState.ACTIVE, 300,
                   f"{SLOW} to be active", [proc], poll_s=0.5)
        yield proc
    finally:
        proc.stop()
        stack.redis.delete(keys.health_strikes(stack.namespace, SLOW))


def state_of(stack: Stack, name: str) -> str | None:
    hb = read_heartbeat(stack.redis, stack.namespace, name)
    return hb.state if hb else None


def boot_of(stack: Stack, name: str) -> str | None:
    hb = read_heartbeat(stack.redis, stack.namespace, name)
    return hb.boot if hb else None


def measured_ms(stack: Stack, name: str) -> float | None:
    """The allocation latency the worker's heartbeat carries (None: none measured yet)."""
    hb = read_heartbeat(stack.redis, stack.namespace, name)
    return hb.stats.avg_cache_allocation_latency_ms if hb and hb.stats else None


def serve_one(stack: Stack, lane: str = LANE) -> str:
    """A job of `lane` through the API, to its end; returns the worker that ran it."""
    with Client(stack.base_url, stack.api_key) as client:
        job_id = client.submit(lane, prompt="Where is my parcel?", max_tokens=4)["job_id"]
        assert list(client.stream(job_id))[-1].kind == "done"
        return str(client.job(job_id)["worker"])


def test_slow_real_allocations_get_the_cheap_fix_then_a_restart_the_lane_cannot_spare(
        stack: Stack, slow_worker: Proc) -> None:
    """The worker's measured latency goes over the threshold once it allocates; two checks
    later its prefix cache is reset, and at the third the restart is deferred (it is the
    lane's only worker): it keeps its process and serves on. No other worker is touched."""
    app, settings = make_app(get_settings()), get_settings()
    threshold = settings.alloc_latency_threshold_ms
    chat = stack.workers["chat"]
    assert serve_one(stack, "chat") == chat  # measured too, with no fault
    assert serve_one(stack) == SLOW  # it allocates KV cache: its engine measures
    wait_until(lambda: (measured_ms(stack, SLOW) or 0) >= DELAY_MS
               and measured_ms(stack, chat) is not None, 30,
               "both workers' heartbeats to carry their measured allocation latency",
               [slow_worker])
    assert (measured_ms(stack, chat) or 0) < threshold
    old_boot = boot_of(stack, SLOW)

    checks = [health.check(app, stack.redis, settings) for _ in range(3)]

    assert checks[0] == []  # strike one: watched only
    assert [(a["action"], a["worker"]) for a in checks[1]] == [("reset_prefix_cache", SLOW)]
    assert checks[1][0]["alloc_latency_ms"] >= DELAY_MS  # the engine's own figure
    assert [(a["action"], a["worker"]) for a in checks[2]] == [("restart_deferred", SLOW)]
    assert "below its minimum" in checks[2][0]["reason"]
    assert boot_of(stack, SLOW) == old_boot and state_of(stack, SLOW) == WorkerState.ACTIVE
    assert serve_one(stack) == SLOW
