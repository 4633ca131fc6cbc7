"""Activation reaches the routers at once: a standby worker whose heartbeat period is long
(30 s) is activated, and a job submitted right after is routed to it and served by it,
by an API that reads the heartbeats again only every 30 s. Without the worker's
announcement (keys.fleet_channel), the API would still see it in standby until its next
beat and its own next read, and refuse the lane's job with 503.

A stack of its own (API, one standby worker) on its own Redis database, beside the session's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from tidegate_client import Client, TidegateError

from scheduler import control
from store import Store, upgrade
from tasks.app import make_app
from tests.helpers import own_db
from tidegate.fleet import read_fleet, read_heartbeat
from tidegate.settings import Settings
from tidegate_tools.procs import start_worker, wait_until
from tidegate_tools.stack import running_stack

LANE, POOL = "standby", "vllm"
NAME = "activation@tidegate"
REDIS_DB, NAMESPACE = own_db(__name__, "35"), "tgactivation"
# Both far longer than the test takes from activation to the job's route: neither the
# worker's next beat nor the API's next read of the heartbeats comes in between.
HEARTBEAT_S = FLEET_CACHE_S = "30"


@dataclass
class Floor:
    base_url: str
    key: str
    redis: redis.Redis
    settings: Settings


def state_of(floor: Floor, name: str) -> str | None:
    hb = read_heartbeat(floor.redis, NAMESPACE, name)
    return hb.state if hb else None


@pytest.fixture(scope="module")
def floor(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Floor]:
    db_url = f"sqlite:///{tmp_root / 'activation.db'}"
    upgrade(db_url)
    _, key = Store(db_url).tenants.create_tenant("activation-tenant", [LANE])
    redis_url = redis_server.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    env = {**os.environ, "TIDEGATE_REDIS_URL": redis_url, "TIDEGATE_DATABASE_URL": db_url,
           "TIDEGATE_NAMESPACE": NAMESPACE, "TIDEGATE_FLEET_CACHE_S": FLEET_CACHE_S}
    client = redis.Redis.from_url(redis_url)
    logs = tmp_root / "logs" / "activation"
    try:
        with running_stack(env, [], logs) as stack:
            floor = Floor(stack.base_url, key, client, Settings(
                redis_url=redis_url, database_url=db_url, namespace=NAMESPACE))
            worker = start_worker({**env, "TIDEGATE_HEARTBEAT_S": HEARTBEAT_S}, LANE, NAME,
                                  logs, standby=True)
            try:
                # Its first beat after the engine loaded says standby: within a period.
                wait_until(lambda: state_of(floor, NAME) == "standby", 300,
                           "the worker to load its engine and report standby", [worker],
                           poll_s=0.5)
                yield floor
            finally:
                worker.stop()
    finally:
        client.flushdb()


def test_a_submit_right_after_activation_is_routed_to_the_activated_worker(
        floor: Floor) -> None:
    app, settings = make_app(floor.settings), floor.settings
    assert [hb.name for hb in read_fleet(floor.redis, NAMESPACE)] == [NAME]
    with Client(floor.base_url, floor.key, retries=0) as client:
        with pytest.raises(TidegateError) as refused:  # the API sees no active worker yet
            client.submit(LANE, prompt="Where is my parcel?", max_tokens=4)
        assert refused.value.status == 503

        assert control.activate(app, floor.redis, settings, NAME, LANE, POOL,
                                warm_prompts=settings.lanes[LANE].warm_prompts)
        # Confirmed by the heartbeat the worker wrote on activation, not its next beat.
        assert state_of(floor, NAME) == "active"
        job = client.submit(LANE, prompt="Where is my parcel?", max_tokens=4)
        events = list(client.stream(job["job_id"]))
        row = client.job(job["job_id"])
    assert events[-1].kind == "done"
    assert row["status"] == "done" and row["worker"] == NAME
    assert control.deactivate(app, floor.redis, settings, NAME, LANE, POOL)
