"""Invalid settings stop the process at start with a message naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(env_over: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_over}
    return subprocess.run([sys.executable, "-m", "tidegate_tools.cli", *args], env=env, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize(("name", "value"), [
    ("TIDEGATE_API_PORT", "eighty"),
    ("TIDEGATE_REDIS_URL", "http://127.0.0.1:6379"),
    ("TIDEGATE_DATABASE_URL", "mysql://x"),
    ("TIDEGATE_ENGINE_SLOTS", "0"),
])
def test_invalid_setting_is_named_at_start(name: str, value: str) -> None:
    result = run_cli({name: value}, "status")
    assert result.returncode != 0
    assert name in result.stderr


def test_invalid_lanes_file_names_lane_and_field(tmp_path: Path) -> None:
    lanes = tmp_path / "lanes.toml"
    lanes.write_text('[lanes.chat]\nqueue = "chat"\nmax_output_tokens = -1\n')
    result = run_cli({"TIDEGATE_LANES_FILE": str(lanes)}, "status")
    assert result.returncode != 0
    assert "TIDEGATE_LANES_FILE" in result.stderr
    assert "'chat'" in result.stderr and "max_output_tokens" in result.stderr


def test_missing_lanes_file_is_named(tmp_path: Path) -> None:
    result = run_cli({"TIDEGATE_LANES_FILE": str(tmp_path / "nope.toml")}, "status")
    assert result.returncode != 0 and "TIDEGATE_LANES_FILE" in result.stderr
