"""The floor's own promises: tests/unit reaches no network and starts no process (its
conftest's guard), and a test whose service or tool is missing skips on a developer's
machine but fails in CI (`CI=true`), so CI never passes by skipping what it must run."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
from collections.abc import Callable

import pytest

from tests.helpers import missing_here, tool_or_skip
from tests.unit.conftest import NotInUnitTests


def test_a_network_connection_is_refused_naming_what_was_tried() -> None:
    with pytest.raises(NotInUnitTests, match="connect"):
        socket.create_connection(("127.0.0.1", 6379), timeout=1)


def test_binding_a_network_port_is_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, \
            pytest.raises(NotInUnitTests, match="bind"):
        sock.bind(("127.0.0.1", 0))


def test_a_unix_socket_pair_stays_open_for_the_event_loop() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"x")
        assert right.recv(1) == b"x"


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"], check=False),
    lambda: os.system("true"),
    lambda: os.posix_spawn("/bin/true", ["true"], {}),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
], ids=["subprocess", "os.system", "posix_spawn", "multiprocessing-fork"])
def test_starting_a_process_is_refused(start: Callable[[], object]) -> None:
    with pytest.raises(NotInUnitTests, match="process"):
        start()


def _outcome(check: Callable[[], None]) -> BaseException:
    """What a missing-service check raised: pytest's skip or fail, caught here whichever
    it was, so a check that skips where it must fail fails this test, not skips it."""
    try:
        check()
    except BaseException as exc:  # pytest's outcomes are BaseExceptions
        return exc
    raise AssertionError("the check returned: the test would have run without its service")


def test_a_missing_service_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    outcome = _outcome(lambda: missing_here("PostgreSQL unreachable"))
    assert isinstance(outcome, pytest.fail.Exception)
    assert "CI=true" in str(outcome)


def test_a_missing_service_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    outcome = _outcome(lambda: missing_here("PostgreSQL unreachable"))
    assert isinstance(outcome, pytest.skip.Exception)
    assert "PostgreSQL unreachable" in str(outcome)


def test_a_missing_tool_fails_in_ci_naming_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    outcome = _outcome(lambda: tool_or_skip("tidegate-no-such-tool", "make ops-tools"))
    assert isinstance(outcome, pytest.fail.Exception)
    assert "make ops-tools" in str(outcome)
