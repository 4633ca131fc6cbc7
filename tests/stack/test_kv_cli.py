"""`tidegate kv synth` and `tidegate kv replay` as a user runs them: a subprocess, its exit
status, its last stdout line (JSON) and its error message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidegate.lanes import load_lanes
from workers.kvcache.sim import replay
from workers.kvcache.trace import read_trace, session_metas

ROOT = Path(__file__).resolve().parents[2]
LANES = ROOT / "tidegate" / "lanes.toml"  # the shipped lanes, whose `chat` lane replay uses


def tidegate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIDEGATE_LANES_FILE": str(LANES)}
    return subprocess.run([sys.executable, "-m", "tidegate_tools.cli", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kv") / "trace.jsonl"
    done = tidegate("kv", "synth", "--out", path, "--sessions", "12", "--seed", "5",
                    "--short-turns", "2-3")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["trace"] == str(path)
    assert report["params"]["sessions"] == 12 and report["params"]["short_turns"] == [2, 3]
    assert report["requests"] == len(path.read_text().splitlines()) > 12
    return path


def test_replay_prints_the_hit_rate_as_json(trace: Path) -> None:
    policy = "session"
    done = tidegate("kv", "replay", "--trace", trace, "--capacity-blocks", "300",
                    "--policy", policy)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert {"policy", "capacity_blocks", "hit_rate"} <= summary.keys()
    assert summary["policy"] == policy and summary["capacity_blocks"] == 300
    # The same numbers as the library with the chat lane's parameters.
    requests = read_trace(trace)
    metas = list(session_metas(requests, lane="chat"))
    expected = replay(requests, metas, policy, 300, load_lanes(LANES)["chat"].kv_policy)
    assert summary["hit_rate"] == round(expected.hit_rate, 4)
    assert 0 < summary["hit_rate"] < 1


def test_replay_of_a_missing_trace_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-trace.jsonl"
    done = tidegate("kv", "replay", "--trace", missing, "--capacity-blocks", "10",
                    "--policy", "lru")
    assert done.returncode != 0
    assert str(missing) in done.stderr
    assert "Traceback" not in done.stderr


def test_replay_of_a_malformed_trace_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chat_id": 1}\n')
    done = tidegate("kv", "replay", "--trace", bad, "--capacity-blocks", "10",
                    "--policy", "lru")
    assert done.returncode != 0
    assert "line 1" in done.stderr and "missing field" in done.stderr
    assert "Traceback" not in done.stderr


def test_replay_for_an_unknown_lane_fails(trace: Path) -> None:
    done = tidegate("kv", "replay", "--trace", trace, "--capacity-blocks", "10",
                    "--policy", "session", "--lane", "no-such-lane")
    assert done.returncode != 0
    assert "no-such-lane" in done.stderr
    assert done.stdout == ""


def test_synth_with_bad_parameters_names_the_field(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    done = tidegate("kv", "synth", "--out", out, "--short-turns", "5-2")
    assert done.returncode != 0
    assert "short_turns" in done.stderr
    assert not out.exists()
