"""Defaults that fit a deployment, each on processes of its own (no vLLM worker):

- an API pod holds the tokenizer's files, not the weights: started with TIDEGATE_TOKENIZER
  and a TIDEGATE_MODEL that does not exist here, it is ready, counts a prompt's tokens (a
  422 naming the field for a long one, a queued job for another) and names the model by
  its path's last part;
- Flower binds the address TIDEGATE_FLOWER_HOST names (127.0.0.1 was hard-coded);
- of two scheduler replicas on one Redis, one beat sends the schedule (celery-redbeat's
  lock), the other takes over when the first stops and keeps sending when Redis loses the
  lock, and neither writes a schedule file.

Each on a SQLite database and a Redis DB of its own (14: the API, 15: the schedulers; emptied
on the way out): a scheduler's reconciler acts on every job of its database.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from store import Store, upgrade
from tests.helpers import advertise, answers
from tidegate import keys
from tidegate_tools.procs import (
    Proc,
    free_port,
    start_api,
    start_scheduler,
    tidegate_argv,
    wait_until,
)
from tidegate_tools.stack import api_ready

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
SENT = "Sending due task"  # celery beat's log line for each task it sends


def own_redis(redis_server: str, db: int) -> str:
    return redis_server.rsplit("/", 1)[0] + f"/{db}"


def own_database(tmp_root: Path, name: str) -> str:
    url = f"sqlite:///{tmp_root / f'{name}.db'}"
    upgrade(url)
    return url


@pytest.fixture
def tokenizer_only(model_path: Path, tmp_root: Path) -> Path:
    """A folder with the test checkpoint's tokenizer files and nothing else."""
    folder = tmp_root / "tokenizer-only"
    folder.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_path / name).is_file():
            shutil.copy(model_path / name, folder / name)
    assert not (folder / "model.safetensors").exists() and not (folder / "config.json").exists()
    return folder


def test_an_api_with_only_the_tokenizer_files_is_ready_and_counts_tokens(
        redis_server: str, tokenizer_only: Path, tmp_root: Path) -> None:
    url, ns = own_redis(redis_server, 14), "tgtokenizer"
    db = own_database(tmp_root, "tokenizer-only")
    env = {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_NAMESPACE": ns,
           "TIDEGATE_DATABASE_URL": db,
           "TIDEGATE_TOKENIZER": str(tokenizer_only),
           "TIDEGATE_MODEL": str(tmp_root / "not-here" / "llama-test-70b")}
    _, key = Store(db).create_tenant("tokenizer-only", ["chat"])
    client = redis.Redis.from_url(url)
    port = free_port()
    api = start_api(env, port, tmp_root / "logs")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: api_ready(base, []), 90, "the API's /readyz", [api])
        ready = httpx.get(f"{base}/readyz", timeout=10).json()
        assert ready["checks"]["tokenizer"] == {"ok": True}  # with no worker anywhere
        models = httpx.get(f"{base}/v1/models", headers=bearer(key), timeout=10).json()
        assert "llama-test-70b" in [m["id"] for m in models["data"]]
        long = {"lane": "chat", "max_tokens": 8,
                "messages": [{"role": "user", "content": "refund " * 2000}]}
        resp = httpx.post(f"{base}/v1/jobs", json=long, headers=bearer(key), timeout=30)
        assert resp.status_code == 422, resp.text
        assert resp.json()["error"]["field"] == "messages"
        assert "tokens; lane 'chat' allows" in resp.json()["error"]["message"]
        advertise(client, ns, "chat-advertised@tokenizer", "chat", "vllm")
        short = {**long, "messages": [{"role": "user", "content": "Is my refund on its way?"}]}
        resp = httpx.post(f"{base}/v1/jobs", json=short, headers=bearer(key), timeout=30)
        assert resp.status_code == 202, resp.text
        job = httpx.get(f"{base}/v1/jobs/{resp.json()['job_id']}", headers=bearer(key),
                        timeout=10).json()
        assert job["status"] == "queued" and job["prompt_tokens"] > 0
    finally:
        api.stop()
        client.flushdb()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_flower_binds_the_address_its_setting_names(redis_server: str, tmp_root: Path) -> None:
    port = free_port()
    env = {**os.environ, "TIDEGATE_FLOWER_PASSWORD": "s3cret", "TIDEGATE_FLOWER_HOST": "127.0.0.2"}
    proc = Proc("flower-host", tidegate_argv("flower", "--port", str(port)),
                tmp_root / "logs" / "flower-host.log", env)
    try:
        wait_until(lambda: answers(f"http://127.0.0.2:{port}/healthcheck"), 60,
                   "Flower on 127.0.0.2", [proc])
        assert not answers(f"http://127.0.0.1:{port}/healthcheck")
    finally:
        proc.stop()



@pytest.fixture
def beat_env(redis_server: str, tmp_root: Path) -> Iterator[dict[str, str]]:
    data_dir = tmp_root / "beat-data"
    data_dir.mkdir(exist_ok=True)
    url = own_redis(redis_server, 15)
    yield {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_NAMESPACE": "tgbeat",
           "TIDEGATE_DATA_DIR": str(data_dir),
           "TIDEGATE_DATABASE_URL": own_database(tmp_root, "beat"),
           "TIDEGATE_SCHEDULER_TICK_S": "1", "TIDEGATE_RECONCILE_S": "0.5"}
    redis.Redis.from_url(url).flushdb()


def test_of_two_schedulers_one_beat_sends_and_the_other_takes_over(
        beat_env: dict[str, str], tmp_root: Path) -> None:
    ns = beat_env["TIDEGATE_NAMESPACE"]
    client = redis.Redis.from_url(beat_env["TIDEGATE_REDIS_URL"])
    logs = tmp_root / "logs"
    for name in ("scheduler-a", "scheduler-b"):
        (logs / f"{name}.log").unlink(missing_ok=True)
    first = start_scheduler(beat_env, logs, "scheduler-a")
    procs = [first]
    try:
        wait_until(lambda: ticks(client, ns) >= 1, 90, "the first scheduler's first tick", procs)
        second = start_scheduler(beat_env, logs, "scheduler-b")
        procs.append(second)
        wait_until(lambda: "beat: Starting" in log_of(second), 90, "the second beat's start",
                   procs)
        seen = ticks(client, ns)
        wait_until(lambda: ticks(client, ns) >= seen + 3, 30, "three more ticks", procs)
        assert SENT in log_of(first) and SENT not in log_of(second)
        assert client.get(keys.beat_lock(ns)) is not None
        first.stop()  # a rolling restart: the lock is released, the other beat takes it
        seen = ticks(client, ns)
        wait_until(lambda: ticks(client, ns) >= seen + 2, 60, "ticks from the second beat",
                   [second])
        assert SENT in log_of(second)
        # Redis loses the lock (a failover that lost the last writes): the beat takes it
        # again and sends on (redbeat's own would end, leaving its worker with no beat).
        client.delete(keys.beat_lock(ns))
        seen = ticks(client, ns)
        wait_until(lambda: ticks(client, ns) >= seen + 2, 30, "ticks after the lock's loss",
                   [second])
        assert client.get(keys.beat_lock(ns)) is not None
    finally:
        for proc in reversed(procs):
            proc.stop()
    schedule_files = [p.name for p in Path(beat_env["TIDEGATE_DATA_DIR"]).iterdir()]
    assert schedule_files == []
    assert not list(Path.cwd().glob("celerybeat-schedule*"))


def ticks(client: Any, ns: str) -> int:
    """Tick actions the schedulers recorded (one per period that acted)."""
    entries = client.xrange(keys.scheduler_actions(ns))
    return sum(b'"action": "tick"' in fields[b"a"] for _, fields in entries)


def log_of(proc: Proc) -> str:
    return proc.log_path.read_text(errors="replace")

