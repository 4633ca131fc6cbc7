"""The API when a dependency is down, in-process (FastAPI's TestClient) on a Redis DB and a
database of its own. Each case points one dependency of the settings at nothing: `/readyz`
answers 503 naming it while `/healthz` stays 200; a submit the broker cannot take answers
503 and leaves no job row. Workers are no dependency of the API: `/readyz` is 200 with none,
and `/fleetz` reports them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.errors import ApiError
from store import Store, upgrade
from tasks.app import make_app, queue_lengths
from tests.helpers import own_redis_url
from tidegate import keys
from tidegate.settings import Settings
from tidegate_tools.procs import free_port

WORKER = "chat-deps@test"
OK = {"lane": "chat", "messages": [{"role": "user", "content": "Is my refund on its way?"}],
      "max_tokens": 8}


@pytest.fixture(scope="module")
def settings(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Settings]:
    url = f"sqlite:///{tmp_root / 'dependencies.db'}"
    upgrade(url)
    up = Settings(redis_url=own_redis_url(redis_server, __name__, "3"), database_url=url)
    yield up
    redis.Redis.from_url(up.redis_url).flushdb()


def advertise(settings: Settings, state: str, name: str = WORKER, lane: str = "chat") -> None:
    """The heartbeat a worker of `lane` in `state` would write (no worker runs here)."""
    body = {"name": name, "state": state, "lanes": [lane], "pool": "vllm",
            "engine": "vllm", "slots": 4, "kv_cache_dtype": "fp8", "dtype": "float16",
            "stats": {}}
    redis.Redis.from_url(settings.redis_url).set(
        keys.worker_heartbeat(settings.namespace, name), json.dumps(body))


def dead_redis() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # a port nothing listens on


def dead_database() -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"


def down(settings: Settings, dependency: str, tmp_root: Path | None = None) -> Settings:
    """The settings with one dependency pointed at nothing."""
    if dependency == "tokenizer":  # a model folder with no tokenizer in it
        assert tmp_root is not None
        (tmp_root / "no-model").mkdir(exist_ok=True)
        return settings.model_copy(update={"model": str(tmp_root / "no-model")})
    if dependency == "redis":
        return settings.model_copy(update={"redis_url": dead_redis()})
    assert dependency == "database", dependency
    return settings.model_copy(update={"database_url": dead_database()})


@pytest.mark.parametrize(("dependency", "failing"), [
    ("redis", {"redis"}),
    ("database", {"database"}),
    ("tokenizer", {"tokenizer"}),
])
def test_readyz_is_503_naming_the_dependency_down_and_healthz_stays_up(
        settings: Settings, dependency: str, failing: set[str], tmp_root: Path) -> None:
    advertise(settings, "active")
    with TestClient(create_app(settings)) as http:  # the control: everything up
        loaded(http)
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
    with TestClient(create_app(down(settings, dependency, tmp_root))) as http:
        loaded(http)
        resp = http.get("/readyz")
        assert resp.status_code == 503, resp.text
        body = resp.json()
        assert body["ready"] is False
        assert {name for name, check in body["checks"].items() if not check["ok"]} == failing
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_readyz_needs_no_worker_and_fleetz_says_which_lane_lacks_one(
        settings: Settings) -> None:
    """A rolling worker restart leaves no worker active for a while: the API stays in its
    load balancer (/readyz 200) and /fleetz names the lanes without an active worker."""
    forget_workers(settings)
    with TestClient(create_app(settings)) as http:
        loaded(http)
        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        fleet = http.get("/fleetz")
        assert fleet.status_code == 200 and fleet.json()["ready"] is False
        assert fleet.json()["workers"]["active"] == 0
        advertise(settings, "active")
        advertise(settings, "standby", "finance-deps@test", "finance")
        body = http.get("/fleetz").json()
        assert body["lanes"]["chat"]["ready"] is True
        assert body["lanes"]["chat"]["active"] == {"vllm": [WORKER]}
        assert body["lanes"]["batch"] == {**body["lanes"]["chat"], "runs_on": "chat"}
        assert body["lanes"]["finance"]["ready"] is False
        assert body["lanes"]["finance"]["standby"] == {"vllm": ["finance-deps@test"]}
        for lane in settings.lanes:
            advertise(settings, "active", f"{lane}-deps@test", lane)
        every = http.get("/fleetz")
        assert every.status_code == 200 and every.json()["ready"] is True
    forget_workers(settings)


def forget_workers(settings: Settings) -> None:
    """No worker heartbeats (the other cases advertise their own)."""
    client = redis.Redis.from_url(settings.redis_url)
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern(settings.namespace)):
        client.delete(key)


def loaded(http: TestClient) -> None:
    """Waits for the API's tokenizer, which loads on a thread of its own (api/prompts.py)."""
    with contextlib.suppress(ApiError):  # one that failed to load is a case of the test
        http.app.state.deps.prompts.tokenizer  # type: ignore[attr-defined]  # noqa: B018


def test_a_submit_without_a_tokenizer_is_503_naming_it_and_enqueues_nothing(
        settings: Settings, tmp_root: Path) -> None:
    store = Store(settings.db_url)
    _, key = store.tenants.create_tenant("deps-tokenizer", ["chat"])
    advertise(settings, "active")
    jobs = store.jobs.count_jobs()
    with TestClient(create_app(down(settings, "tokenizer", tmp_root))) as http:
        resp = http.post("/v1/jobs", json=OK, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["Retry-After"]) > 0
    assert "tokenizer failed to load" in resp.json()["error"]["message"]
    assert store.jobs.count_jobs() == jobs
    queues = queue_lengths(redis.Redis.from_url(settings.redis_url), ["chat.vllm"])
    assert queues == {"chat.vllm": 0}


def test_a_submit_the_broker_refuses_is_503_and_leaves_no_row(settings: Settings) -> None:
    """Redis answers (the fleet, the backlogs, the limits) but the publish fails: the job
    row written before it is taken back and the caller told to retry."""
    store = Store(settings.db_url)
    _, key = store.tenants.create_tenant("deps-broker", ["chat"])
    advertise(settings, "active")
    jobs = store.jobs.count_jobs()
    with TestClient(create_app(settings)) as http:
        http.app.state.deps.celery = make_app(  # type: ignore[attr-defined]
            settings.model_copy(update={"redis_url": dead_redis()}))
        resp = http.post("/v1/jobs", json=OK, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["Retry-After"]) > 0
    assert resp.json()["error"]["type"] == "unavailable"
    assert "queue is unavailable" in resp.json()["error"]["message"]
    assert store.jobs.count_jobs() == jobs
    client = redis.Redis.from_url(settings.redis_url)
    assert queue_lengths(client, ["chat.vllm"]) == {"chat.vllm": 0}


@pytest.mark.parametrize("dependency", ["redis", "database"])
def test_a_submit_with_a_dependency_down_is_503_not_500(settings: Settings,
                                                        dependency: str) -> None:
    store = Store(settings.db_url)
    _, key = store.tenants.create_tenant(f"deps-no-{dependency}", ["chat"])
    advertise(settings, "active")
    jobs = store.jobs.count_jobs()
    app = create_app(down(settings, dependency))
    with TestClient(app, raise_server_exceptions=False) as http:
        resp = http.post("/v1/jobs", json=OK, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 503, resp.text
    assert "Retry-After" in resp.headers
    assert resp.json()["error"]["type"] == "unavailable"
    assert store.jobs.count_jobs() == jobs
