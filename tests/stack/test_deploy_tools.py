"""The deploy files as the tools that read them see them: promtool (Prometheus' config, the
alert rules and their unit tests), docker-compose's `config` (every password required,
ports published on 127.0.0.1 unless asked, Redis's password in every client's URL) and
systemd-analyze. Each starts a process, so these live here and not in tests/unit, which
starts none. Without promtool or compose they skip here and fail in CI (`CI=true`), where
`make ops-tools` installs both; systemd-analyze is optional everywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.helpers import compose_tool, missing_here, tool_or_skip
from tests.unit.test_dashboard import PROMETHEUS
from tests.unit.test_deploy import SYSTEMD
from tests.unit.test_deploy_defaults import COMPOSE, PASSWORDS, PUBLISHED


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    tool_or_skip("promtool", "Debian: apt-get install prometheus; `make ops-tools`")
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def test_promtool_accepts_the_config_and_the_rules() -> None:
    done = _promtool("check", "config", "prometheus.yml", cwd=PROMETHEUS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


def test_the_alerts_fire_on_their_unit_test_series() -> None:
    done = _promtool("test", "rules", "alerts_test.yml", cwd=PROMETHEUS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_config_as_docker_compose_reads_it() -> None:
    tool = needs_compose()
    argv = [*tool, "-f", str(COMPOSE), "config", "-q"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    # compose refuses the file without any of its passwords (tests/unit/test_deploy_defaults.py)
    others = {name: "a-password" for name in ("POSTGRES_PASSWORD", "REDIS_PASSWORD",
                                              "GRAFANA_ADMIN_PASSWORD")}
    refused = subprocess.run(argv, env={**env, **others}, capture_output=True, text=True)
    assert refused.returncode != 0
    assert "TIDEGATE_FLOWER_PASSWORD" in refused.stderr
    ok = subprocess.run(argv, env={**env, **others, "TIDEGATE_FLOWER_PASSWORD": "a-password"},
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def systemd_verify(units: list[Path], tmp_path: Path) -> str:
    """`systemd-analyze verify` on copies that run this checkout's `tidegate`; the worker
    template as its finance instance."""
    tidegate = shutil.which("tidegate", path=str(Path(sys.executable).parent))
    assert tidegate, "the tidegate command of this environment"
    copies = []
    for path in units:
        name = path.name.replace("@.", "@finance.")
        text = path.read_text().replace("/opt/tidegate/venv/bin/tidegate", tidegate)
        (tmp_path / name).write_text(text)
        copies.append(str(tmp_path / name))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", *copies],
                          capture_output=True, text=True, cwd=tmp_path)
    return done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_units_verify_with_systemd(tmp_path: Path) -> None:
    assert systemd_verify(sorted(SYSTEMD.glob("*.service")), tmp_path) == ""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tidegate-api.service").write_text(
        (SYSTEMD / "tidegate-api.service").read_text().replace("KillSignal", "KillSignall"))
    assert "KillSignall" in systemd_verify([broken / "tidegate-api.service"], broken)


def needs_compose() -> list[str]:
    """The compose command; skipped here without one, failed in CI (`make ops-tools`
    installs Debian's docker-compose)."""
    tool = compose_tool()
    if tool is None:
        missing_here("neither docker-compose nor the docker compose plugin is installed "
                     "(`make ops-tools` installs Debian's docker-compose)")
    assert tool is not None
    return tool


def compose_config(**env: str) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` of deploy/compose.yml with `env` as the only variables (a
    variable of this environment that the file reads would hide a missing one)."""
    tool = needs_compose()
    names = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    base = {k: v for k, v in os.environ.items() if k not in names}
    return subprocess.run([*tool, "-f", str(COMPOSE), "--profile", "monitoring", "config"],
                          env={**base, **env}, capture_output=True, text=True, timeout=60)


def resolved(**env: str) -> dict[str, Any]:
    done = compose_config(**env)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.mark.parametrize("missing", sorted(PASSWORDS))
def test_compose_refuses_to_start_without_each_password(missing: str) -> None:
    others = {k: v for k, v in PASSWORDS.items() if k != missing}
    refused = compose_config(**others)
    assert refused.returncode != 0
    assert missing in refused.stderr, refused.stderr
    assert compose_config(**PASSWORDS).returncode == 0


def published(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host address, published port) of a service, from either form compose prints
    (docker-compose 1.x: "127.0.0.1:8000:8000/tcp"; compose v2: mappings)."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", ""), int(port["published"])))
        else:
            parts = str(port).split("/")[0].rsplit(":", 2)
            out.append((parts[0] if len(parts) == 3 else "", int(parts[-2])))
    return out


def test_compose_publishes_every_port_on_127_0_0_1_unless_asked() -> None:
    services = resolved(**PASSWORDS)["services"]
    ports = {name: published(s) for name, s in services.items() if published(s)}
    assert ports == {name: [("127.0.0.1", port)] for name, (_, port) in PUBLISHED.items()}
    asked = resolved(**PASSWORDS, TIDEGATE_BIND_ADDRESS="10.1.2.3",
                     TIDEGATE_OPS_BIND_ADDRESS="10.4.5.6")["services"]
    for name, (variable, port) in PUBLISHED.items():
        address = "10.1.2.3" if variable == "TIDEGATE_BIND_ADDRESS" else "10.4.5.6"
        assert published(asked[name]) == [(address, port)], name


def test_compose_redis_takes_only_its_password_and_every_client_url_carries_it() -> None:
    services = resolved(**PASSWORDS)["services"]
    redis = services["redis"]
    command = redis["command"]
    assert "--requirepass" in command, command
    assert command[command.index("--requirepass") + 1] == PASSWORDS["REDIS_PASSWORD"]
    assert redis["environment"]["REDISCLI_AUTH"] == PASSWORDS["REDIS_PASSWORD"]
    assert not published(redis) and not published(services["postgres"])
    clients = {name: s["environment"]["TIDEGATE_REDIS_URL"] for name, s in services.items()
               if "TIDEGATE_REDIS_URL" in (s.get("environment") or {})}
    assert {"api", "scheduler", "webhooks", "flower", "migrate"} <= set(clients)
    for name, url in clients.items():
        assert urlsplit(url).password == PASSWORDS["REDIS_PASSWORD"], name
        database = services[name]["environment"]["TIDEGATE_DATABASE_URL"]
        assert urlsplit(database).password == PASSWORDS["POSTGRES_PASSWORD"], name
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == PASSWORDS["GRAFANA_ADMIN_PASSWORD"]
