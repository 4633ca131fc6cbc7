"""Defaults that fit a deployment, each on processes of its own (a vLLM worker only where a
job runs end to end):

- an API pod holds the tokenizer's files, not the weights: started with TIDEGATE_TOKENIZER
  and a TIDEGATE_MODEL that does not exist here, it is ready, counts a prompt's tokens (a
  422 naming the field for a long one, a queued job for another) and names the model by
  its path's last part;
- Flower binds the address TIDEGATE_FLOWER_HOST names (127.0.0.1 was hard-coded);
- of two scheduler replicas on one Redis, one beat sends the schedule (celery-redbeat's
  lock), the other takes over when the first stops and keeps sending when Redis loses the
  lock, and neither writes a schedule file;
- the compose file's Redis, started as its `command` says, refuses a client without the
  password and passes its health check only with it, while an API and a worker on the
  compose file's Redis URL (which carries the password) run a job from submit to its end.

Each on a SQLite database and a Redis DB of its own (14: the API, 15: the schedulers; emptied
on the way out): a scheduler's reconciler acts on every job of its database.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from store import Store, upgrade
from tests.helpers import advertise, answers, own_db
from tidegate import keys
from tidegate_tools.procs import (
    Proc,
    free_port,
    redis_server_binary,
    start_api,
    start_scheduler,
    start_worker,
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
    url, ns = own_redis(redis_server, own_db(__name__, "14")), "tgtokenizer"
    db = own_database(tmp_root, "tokenizer-only")
    env = {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_NAMESPACE": ns,
           "TIDEGATE_DATABASE_URL": db,
           "TIDEGATE_TOKENIZER": str(tokenizer_only),
           "TIDEGATE_MODEL": str(tmp_root / "not-here" / "llama-test-70b")}
    _, key = Store(db).tenants.create_tenant("tokenizer-only", ["chat"])
    client = redis.Redis.from_url(url)
    port = free_port()
    api = start_api(env, port, tmp_root / "logs")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: api_ready(base, []), 90, "the API's /readyz", [api])
        ready = httpx.get(f"{base}/readyz", timeout=10).json()
        assert ready["checks"]["tokenizer"] == {"ok": True}  # with no worker anywhere
        # A worker's heartbeat before the first read of the fleet, which the API caches for
        # a moment (GET /v1/models reads it for the adapters the workers serve).
        advertise(client, ns, "chat-advertised@tokenizer", "chat", "vllm")
        models = httpx.get(f"{base}/v1/models", headers=bearer(key), timeout=10).json()
        assert "llama-test-70b" in [m["id"] for m in models["data"]]
        long = {"lane": "chat", "max_tokens": 8,
                "messages": [{"role": "user", "content": "refund " * 2000}]}
        resp = httpx.post(f"{base}/v1/jobs", json=long, headers=bearer(key), timeout=30)
        assert resp.status_code == 422, resp.text
        assert resp.json()["error"]["field"] == "messages"
        assert "tokens; lane 'chat' allows" in resp.json()["error"]["message"]
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
    url = own_redis(redis_server, own_db(__name__, "15"))
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



# ---- the compose file's Redis: a password, and every client's URL carries it -------------

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose.yml"
COMPOSE_ENV = {"REDIS_PASSWORD": "redis-Pw-7f3a", "POSTGRES_PASSWORD": "pg-Pw",
               "TIDEGATE_FLOWER_PASSWORD": "flower-Pw", "GRAFANA_ADMIN_PASSWORD": "grafana-Pw"}
VARIABLE = re.compile(r"\$\{(\w+)(?::[?-]([^}]*))?\}")


def interpolated(value: Any) -> Any:
    """A compose value with its `${NAME}`, `${NAME:?message}` and `${NAME:-default}` filled
    from COMPOSE_ENV, as compose fills them (a missing required one fails the test)."""
    if isinstance(value, list):
        return [interpolated(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolated(v) for k, v in value.items()}

    def fill(match: re.Match[str]) -> str:
        name, rest = match.group(1), match.group(0)
        if name in COMPOSE_ENV:
            return COMPOSE_ENV[name]
        assert ":?" not in rest, f"compose would refuse: {name} unset"
        return match.group(2) or ""

    return VARIABLE.sub(fill, value) if isinstance(value, str) else value


def compose_redis(port: int, folder: Path) -> Proc:
    """redis-server with the compose service's arguments, on 127.0.0.1:`port`, its files in
    `folder` (the container's /data)."""
    service = interpolated(yaml.safe_load(COMPOSE.read_text())["services"]["redis"])
    argv = service["command"]
    assert argv[0] == "redis-server"
    folder.mkdir(parents=True, exist_ok=True)
    return Proc(f"compose-redis:{port}", [redis_server_binary(), *argv[1:], "--port", str(port),
                "--bind", "127.0.0.1", "--dir", str(folder)],
                folder / "redis.log", dict(os.environ))


def on_port(url: str, port: int) -> str:
    """A compose client URL (host `redis`, its port 6379) pointed at 127.0.0.1:`port`."""
    assert "@redis:6379/" in url, url
    return url.replace("@redis:6379/", f"@127.0.0.1:{port}/")


def health_check(port: int, env: dict[str, str]) -> int:
    """The compose service's health check command, as its container runs it, against our
    port; its exit code."""
    service = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
    kind, command = service["healthcheck"]["test"]
    assert kind == "CMD-SHELL"
    command = command.replace("redis-cli", f"redis-cli -p {port}")
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    return subprocess.run(["sh", "-c", command], env={**env, "PATH": path}, timeout=30,
                          capture_output=True).returncode


def test_the_compose_redis_takes_only_its_password_and_tidegate_runs_on_its_url(
        model_path: Path, tmp_root: Path) -> None:
    port = free_port()
    server = compose_redis(port, tmp_root / "compose-redis")
    procs = [server]
    try:
        open_url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: refuses_without_password(open_url), 15, "the compose Redis", procs)
        redis_env = interpolated(yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
                                 .get("environment") or {})
        assert health_check(port, {**os.environ, **redis_env}) == 0
        assert health_check(port, {k: v for k, v in os.environ.items()
                                   if k != "REDISCLI_AUTH"}) != 0
        url = on_port(interpolated(
            yaml.safe_load(COMPOSE.read_text())["x-tidegate-env"]["TIDEGATE_REDIS_URL"]), port)
        procs += runs_a_job_on(url, tmp_root)
    finally:
        for proc in reversed(procs):
            proc.stop()


def refuses_without_password(url: str) -> bool:
    """Redis answers, and refuses a client that sends no password (a poll: False while it
    starts)."""
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.AuthenticationError:
        return True
    except redis.ConnectionError:
        return False
    return False  # it answered without a password: the test's assert names it


def runs_a_job_on(url: str, tmp_root: Path) -> list[Proc]:
    """An API and a worker (vLLM on CPU) on `url`: a submit runs to `done` and its events
    stream back, so the broker, the token streams, the heartbeats and the API's clients all
    reached Redis with the password. Returns the processes, for the caller to stop."""
    db = own_database(tmp_root, "compose-redis")
    _, key = Store(db).tenants.create_tenant("compose-redis", ["chat"])
    env = {**os.environ, "TIDEGATE_REDIS_URL": url, "TIDEGATE_NAMESPACE": "tgcomposeredis",
           "TIDEGATE_DATABASE_URL": db}
    port, name = free_port(), "chat-pw@compose"
    procs = [start_api(env, port, tmp_root / "logs")]
    procs.append(start_worker(env, "chat", name, tmp_root / "logs", pool="vllm"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: api_ready(base, [name]), 600, "the API and the worker", procs)
        body = {"lane": "chat", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Where is my parcel?"}]}
        resp = httpx.post(f"{base}/v1/jobs", json=body, headers=bearer(key), timeout=30)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_id"]
        with httpx.stream("GET", f"{base}/v1/jobs/{job_id}/events", headers=bearer(key),
                          timeout=60) as events:
            kinds = [line.removeprefix("event: ") for line in events.iter_lines()
                     if line.startswith("event: ")]
        assert kinds[0] == "started" and kinds[-1] == "done", kinds
        job = httpx.get(f"{base}/v1/jobs/{job_id}", headers=bearer(key), timeout=10).json()
        assert job["status"] == "done" and job["completion_tokens"] > 0
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise
    return procs
