"""bench/peak.py stands alone: its figures come from a named sim profile and the seed,
never from a file another benchmark wrote (bench/results/e2e.json above all)."""

from __future__ import annotations

import builtins
import io
from pathlib import Path
from typing import Any

import pytest

import bench.common
import bench.peak as peak


def small_run(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """The whole computation at a twentieth of the traffic (a second, not twenty)."""
    monkeypatch.setattr(peak, "BASE_LOAD", 0.05)
    return peak.compute().results


def test_the_engine_figures_are_the_named_profiles() -> None:
    engine = peak.engine_figures()
    assert engine.profile.name == peak.PROFILE
    assert (engine.cold_start_s, engine.activation_s) == (
        engine.profile.cold_start_s, engine.profile.activation_s)
    assert engine.cold_start_s > 10 * engine.activation_s > 0
    # The median TPOT is one step of all slots decoding, as the profile times it.
    context = peak.PROMPT_TOKENS + peak.TOKENS // 2
    assert engine.tpot_p50_s == engine.profile.step_s(peak.SLOTS, peak.SLOTS * context, 0)
    assert f"`{peak.PROFILE}`" in peak._profile_line(engine.profile)


def test_the_result_is_the_same_without_e2e_json_or_with_it_rewritten(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(bench.common, "RESULTS", results)
    monkeypatch.setattr(peak, "RESULTS", results)
    opened: list[str] = []
    real_open = io.open

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)  # Path.read_text opens through io.open
    absent = small_run(monkeypatch)
    read_first = list(opened)
    (results / "e2e.json").write_text('{"tidegate": {"server_ttft_p50_ms": 9999, '
                                      '"server_ttft_p99_ms": 99999, "tpot_p50_ms": 999, '
                                      '"tpot_p99_ms": 9999}, "setup": {"tokens per request": 7}}')
    opened.clear()
    rewritten = small_run(monkeypatch)
    assert absent == rewritten
    assert absent["pre-warming"]["cold_starts"] >= 0
    repo_results = str(Path(bench.common.ROOT) / "bench" / "results")
    for paths in (read_first, opened):  # the profiles file and the lanes file, nothing else
        assert not [p for p in paths if p.startswith((str(results), repo_results))], paths
        assert any(p.endswith("sim_profiles.toml") for p in paths)
