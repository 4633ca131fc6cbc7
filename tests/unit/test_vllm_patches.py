"""tidegate's vLLM patches (workers/vllm_patches/): each does nothing unless its variable is
set, and each is fenced by the one version pin. In-process: vLLM's classes are never
wrapped here (the KV patch's `_install` is replaced by a recorder), and every vLLM
attribute a test changes is restored by monkeypatch."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import vllm
from vllm.distributed.device_communicators import shm_broadcast

from workers import vllm_patches
from workers.engine import EngineConfig, EngineError
from workers.vllm_engine import VllmEngine
from workers.vllm_patches import PINNED_VLLM, PatchRefused, kvcache, wakeup

VLLM_DEFAULT_RECHECK_MS = 5000  # SHM_READER_RECHECK_INTERVAL_MS as vLLM ships it
OTHER_VLLM = "0.31.0"


@pytest.fixture
def installs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The KV patch's installs, recorded instead of wrapping vLLM's classes in this process;
    both KV variables unset to start with."""
    calls: list[bool] = []
    monkeypatch.setattr(kvcache, "_install", lambda: calls.append(True))
    monkeypatch.delenv(kvcache.POLICY_ENV, raising=False)
    monkeypatch.delenv(kvcache.STATS_ENV, raising=False)
    return calls


@pytest.fixture
def recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's recheck interval as shipped, restored after the test; the variable unset."""
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", VLLM_DEFAULT_RECHECK_MS)
    monkeypatch.delenv(wakeup.RECHECK_ENV, raising=False)


def test_the_installed_vllm_is_the_pinned_one() -> None:
    assert vllm.__version__ == PINNED_VLLM


# --- the wake-up patch --------------------------------------------------------------


def test_wakeup_plugin_sets_the_recheck_only_when_asked(monkeypatch: pytest.MonkeyPatch,
                                                         recheck: None) -> None:
    wakeup.register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_DEFAULT_RECHECK_MS  # a peer vLLM
    monkeypatch.setenv(wakeup.RECHECK_ENV, "20")
    wakeup.register()
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20


def test_wakeup_does_nothing_on_another_vllm_and_says_so(
        monkeypatch: pytest.MonkeyPatch, recheck: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vllm, "__version__", OTHER_VLLM)
    monkeypatch.setenv(wakeup.RECHECK_ENV, "20")
    with caplog.at_level(logging.WARNING, logger="tidegate.vllm"):
        wakeup.register()  # must not raise: it would break a peer vLLM
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_DEFAULT_RECHECK_MS
    [record] = [r for r in caplog.records if r.name == "tidegate.vllm"]
    assert record.levelno == logging.WARNING
    assert OTHER_VLLM in record.getMessage() and PINNED_VLLM in record.getMessage()


# --- the KV cache patch -------------------------------------------------------------


def test_kv_patch_does_nothing_without_its_variables(monkeypatch: pytest.MonkeyPatch,
                                                     installs: list[bool]) -> None:
    monkeypatch.setattr(vllm, "__version__", OTHER_VLLM)  # not even looked at
    kvcache.register()
    assert installs == []


def test_kv_patch_refuses_an_unknown_policy_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, installs: list[bool]) -> None:
    monkeypatch.setenv(kvcache.POLICY_ENV, "fifo")
    with pytest.raises(PatchRefused, match=f"{kvcache.POLICY_ENV}='fifo'.*session"):
        kvcache.register()
    assert installs == []


def test_kv_patch_installs_on_the_pinned_vllm(monkeypatch: pytest.MonkeyPatch,
                                              installs: list[bool]) -> None:
    monkeypatch.setenv(kvcache.POLICY_ENV, "session")
    kvcache.register()
    assert installs == [True]


def test_session_policy_refuses_another_vllm_version(monkeypatch: pytest.MonkeyPatch,
                                                     model_path: Path,
                                                     installs: list[bool]) -> None:
    monkeypatch.setattr(vllm, "__version__", OTHER_VLLM)
    monkeypatch.setenv(kvcache.POLICY_ENV, "session")
    with pytest.raises(PatchRefused, match=r"vLLM 0\.32\.0.*this is vLLM 0\.31\.0"):
        kvcache.register()
    # start() sets this with setdefault; deleting it first makes monkeypatch remove it after.
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = VllmEngine(EngineConfig(model=str(model_path), kv_policy="session"))
    with pytest.raises(EngineError, match="refuses to load"):
        asyncio.run(engine.start())
    monkeypatch.setenv(kvcache.POLICY_ENV, "lru")
    kvcache.register()  # stock eviction: only the timing is skipped, with a warning
    assert installs == []


def test_kv_timing_alone_is_skipped_on_another_vllm(
        monkeypatch: pytest.MonkeyPatch, installs: list[bool], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(vllm, "__version__", OTHER_VLLM)
    monkeypatch.setenv(kvcache.STATS_ENV, str(tmp_path / "kv.stats"))
    with caplog.at_level(logging.WARNING, logger="tidegate.kvcache"):
        kvcache.register()
    assert installs == []
    assert any(OTHER_VLLM in r.getMessage() and PINNED_VLLM in r.getMessage()
               for r in caplog.records)


# --- the one pin --------------------------------------------------------------------


def test_both_patches_check_the_one_pin(monkeypatch: pytest.MonkeyPatch, recheck: None,
                                        installs: list[bool]) -> None:
    """Moving the package's pin to the running version turns both patches on, and moving
    vLLM off it turns both off: neither keeps a pin of its own."""
    monkeypatch.setattr(vllm_patches, "PINNED_VLLM", "0.99.0")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setenv(kvcache.POLICY_ENV, "session")
    monkeypatch.setenv(wakeup.RECHECK_ENV, "20")
    kvcache.register()
    wakeup.register()
    assert installs == [True]
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS",
                        VLLM_DEFAULT_RECHECK_MS)
    monkeypatch.setattr(vllm, "__version__", PINNED_VLLM)  # the old pin, no longer the pin
    with pytest.raises(PatchRefused, match=r"vLLM 0\.99\.0.*this is vLLM 0\.32\.0"):
        kvcache.register()
    wakeup.register()
    assert installs == [True]
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == VLLM_DEFAULT_RECHECK_MS
