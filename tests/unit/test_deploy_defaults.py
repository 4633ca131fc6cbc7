"""Defaults that fit a deployment, the pure parts: CUDA graphs by lane, the one beat's
settings (celery-redbeat on the deployment's Redis), the fleet report behind /fleetz, and
the deploy files' defaults: no password has a default anywhere under deploy/, compose
refuses to start without each one (as `docker-compose config` reads the file), publishes
every port on 127.0.0.1 unless asked, and gives Redis a password that every client's URL
carries. The processes themselves are tests/stack/test_deploy_defaults.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from redbeat import RedBeatScheduler

from api.fleet import active_workers, fleet_report
from scheduler.beat import BEAT_LOCK_S, OneBeat, beat_config, redbeat_redis
from tidegate.lanes import DEFAULT_LANES_FILE, LanesConfigError, load_lanes
from tidegate.records import Heartbeat, WorkerState
from tidegate.settings import Settings
from tidegate_tools.flower import flower_auth_problem
from workers.vllm_engine import enforce_eager


def test_cuda_graphs_run_on_a_gpu_unless_the_lane_turns_them_off_and_never_on_a_cpu() -> None:
    assert enforce_eager(cuda_graphs=True, on_cpu=False) is False
    assert enforce_eager(cuda_graphs=False, on_cpu=False) is True
    assert enforce_eager(cuda_graphs=True, on_cpu=True) is True
    assert enforce_eager(cuda_graphs=False, on_cpu=True) is True


def test_a_lane_has_cuda_graphs_unless_its_file_says_false(tmp_path: Path) -> None:
    assert all(lane.cuda_graphs for lane in load_lanes(DEFAULT_LANES_FILE).values())
    lanes = tmp_path / "lanes.toml"
    lanes.write_text('[lanes.debug]\nqueue = "debug"\ncuda_graphs = false\n'
                     '[lanes.chat]\nqueue = "chat"\n')
    loaded = load_lanes(lanes)
    assert loaded["debug"].cuda_graphs is False and loaded["chat"].cuda_graphs is True
    lanes.write_text('[lanes.debug]\nqueue = "debug"\ncuda_graphs = "sometimes"\n')
    with pytest.raises(LanesConfigError, match="debug.*cuda_graphs"):
        load_lanes(lanes)


def test_the_beat_is_redbeats_under_the_namespace_with_no_schedule_file() -> None:
    conf = beat_config(Settings(namespace="shop", reconcile_s=2, scheduler_tick_s=10))
    assert conf["beat_scheduler"] == "scheduler.beat.OneBeat"
    assert conf["redbeat_redis_url"] == Settings().redis_url
    assert conf["redbeat_key_prefix"] == "shop:beat:"
    assert conf["redbeat_lock_key"].startswith("shop:beat:")
    # The holder renews its lock each loop: it outlives many of them, and a failover.
    assert conf["beat_max_loop_interval"] == 2
    assert conf["redbeat_lock_timeout"] >= max(BEAT_LOCK_S, 5 * 2)
    assert not any("schedule_filename" in name for name in conf)
    assert issubclass(OneBeat, RedBeatScheduler)


def test_a_sentinel_url_becomes_redbeats_sentinel_options() -> None:
    assert redbeat_redis("redis://10.0.0.5:6379/2") == ("redis://10.0.0.5:6379/2", {})
    url, options = redbeat_redis(
        "sentinel://app:pw@s1:26379;s2/3?master=tide&sentinel_password=spw")
    assert url.startswith("redis-sentinel")
    assert options == {"sentinels": [("s1", 26379), ("s2", 26379)], "service_name": "tide",
                       "db": 3, "password": "pw", "username": "app",
                       "sentinel_kwargs": {"password": "spw"}}


def beat(name: str, lane: str, state: WorkerState, pool: str = "vllm") -> Heartbeat:
    return Heartbeat(name=name, state=state, lanes=(lane,), pool=pool, slots=4)


def test_the_fleet_is_ready_when_every_lane_that_needs_a_worker_has_an_active_one(
        tmp_path: Path) -> None:
    lanes_file = tmp_path / "lanes.toml"
    lanes_file.write_text('[lanes.chat]\nqueue = "chat"\n'
                          '[lanes.batch]\nqueue = "chat"\nruns_on = "chat"\n'
                          '[lanes.finance]\nqueue = "finance"\n'
                          '[lanes.night]\nqueue = "night"\nmin_workers = 0\n')
    lanes = load_lanes(lanes_file)
    fleet = [beat("c1", "chat", WorkerState.ACTIVE), beat("c2", "chat", WorkerState.DRAINING),
             beat("f1", "finance", WorkerState.STANDBY, pool="trtllm")]
    report = fleet_report(fleet, lanes)
    assert report["ready"] is False
    assert report["lanes"]["chat"]["active"] == {"vllm": ["c1"]}
    assert report["lanes"]["chat"]["draining"] == {"vllm": ["c2"]}
    assert report["lanes"]["batch"]["runs_on"] == "chat" and report["lanes"]["batch"]["ready"]
    assert report["lanes"]["finance"]["ready"] is False
    assert report["lanes"]["finance"]["standby"] == {"trtllm": ["f1"]}
    assert report["lanes"]["night"]["ready"] is True  # needs no worker
    assert report["workers"]["active"] == 1 and report["workers"]["standby"] == 1
    assert active_workers(report) == {"c1"}
    ready = fleet_report([*fleet, beat("f2", "finance", WorkerState.ACTIVE, pool="trtllm")],
                         lanes)
    assert ready["ready"] is True and active_workers(ready) == {"c1", "f2"}


def test_a_worker_started_on_a_runs_on_lane_is_in_the_fleet(tmp_path: Path) -> None:
    """`tidegate worker --lane batch` heartbeats lane `batch` only: it shows under its lane
    and among the active workers (the stack launcher waits for it there)."""
    lanes_file = tmp_path / "lanes.toml"
    lanes_file.write_text('[lanes.chat]\nqueue = "chat"\n'
                          '[lanes.batch]\nqueue = "chat"\nruns_on = "chat"\n')
    report = fleet_report([beat("c1", "chat", WorkerState.ACTIVE),
                           beat("b1", "batch", WorkerState.ACTIVE)], load_lanes(lanes_file))
    assert report["lanes"]["batch"]["active"] == {"vllm": ["b1", "c1"]}
    assert report["lanes"]["chat"]["active"] == {"vllm": ["c1"]}
    assert active_workers(report) == {"b1", "c1"}


# ---- the deploy files: no default password, nothing published beyond this machine --------

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yml"
# The compose file's passwords: each one refuses to start without it.
PASSWORDS = {"POSTGRES_PASSWORD": "pg-Pw1", "REDIS_PASSWORD": "redis-Pw2",
             "TIDEGATE_FLOWER_PASSWORD": "flower-Pw3", "GRAFANA_ADMIN_PASSWORD": "grafana-Pw4"}
# What the examples (never applied as they are) put where a server's password goes.
PLACEHOLDER = "CHANGE-ME"
# Published ports and the variable that moves each off 127.0.0.1.
PUBLISHED = {"api": ("TIDEGATE_BIND_ADDRESS", 8000), "flower": ("TIDEGATE_OPS_BIND_ADDRESS", 5555),
             "prometheus": ("TIDEGATE_OPS_BIND_ADDRESS", 9090),
             "grafana": ("TIDEGATE_OPS_BIND_ADDRESS", 3000)}
PASSWORD_KEY = re.compile(r"^\s*(\w*PASSWORD\w*|REDISCLI_AUTH)\s*[:=]\s*(.*)$")
URL_PASSWORD = re.compile(r"\b[a-z][a-z0-9+]*://[^:/@\s]*:(\$\{[^}]*\}|[^@\s]*)@")
REQUIRED = re.compile(r"^\$\{\w+:\?[^}]*\}$")  # compose: `${NAME:?message}`, no default


def deploy_text_files() -> list[Path]:
    return [p for p in sorted(DEPLOY.rglob("*")) if p.is_file()
            and p.suffix in (".yml", ".yaml", ".example", ".service", ".json", ".toml", "")]


def credentials(path: Path) -> list[tuple[int, str]]:
    """(line number, value) of every password a deploy file sets: a PASSWORD-named key's
    value, and the password of a URL with credentials."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        key = PASSWORD_KEY.search(line)
        if key:
            found.append((number, key.group(2).split(" #")[0].strip().strip("\"'")))
        found += [(number, m.group(1)) for m in URL_PASSWORD.finditer(line)]
    return found


def test_no_password_has_a_default_anywhere_under_deploy() -> None:
    """Compose asks for each one (`${NAME:?...}`); an example file holds the placeholder
    where a server's password goes, and nothing where tidegate's own (Flower's) goes, which
    Flower refuses."""
    seen = 0
    for path in deploy_text_files():
        example = ".example" in path.name
        for number, value in credentials(path):
            seen += 1
            where = f"{path.relative_to(ROOT)}:{number}: {value!r}"
            if path == COMPOSE:
                assert REQUIRED.match(value), f"{where} is not `${{NAME:?...}}`"
            else:
                assert example and value in ("", PLACEHOLDER), \
                    f"{where}: a password outside an example, or a real-looking one"
    assert seen >= 8
    compose_text = COMPOSE.read_text()
    assert not re.search(r"\$\{\w*PASSWORD\w*:?-", compose_text), "a password with a default"
    for path in DEPLOY.rglob("*.example*"):
        for name, value in example_values(path).items():
            if name == "TIDEGATE_FLOWER_PASSWORD":
                assert flower_auth_problem("admin", value) is not None, path


def example_values(path: Path) -> dict[str, str]:
    if path.suffix == ".yaml":
        return {k: str(v) for doc in yaml.safe_load_all(path.read_text()) if doc
                for k, v in (doc.get("stringData") or {}).items()}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def test_the_systemd_example_keeps_every_process_but_the_api_off_the_network() -> None:
    """The API takes a key on every route; /metrics and Flower are for operators."""
    values = example_values(DEPLOY / "systemd" / "tidegate.env.example")
    hosts = {name: value for name, value in values.items() if name.endswith("_HOST")}
    assert hosts.pop("TIDEGATE_API_HOST") == "0.0.0.0"
    assert hosts and set(hosts.values()) == {"127.0.0.1"}, hosts
    defaults = Settings.model_fields
    assert defaults["metrics_host"].default == defaults["flower_host"].default == "127.0.0.1"


