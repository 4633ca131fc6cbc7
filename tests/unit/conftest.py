"""tests/unit is the floor that needs nothing running: no process started, no network
connection made. A test here that tries either fails at once, naming what it tried, so
a test that needs Redis, a server or a tool goes to tests/stack, where the fixtures
start and stop what it needs.

The guard is plain monkeypatching of the doors (socket connect and bind; process spawn
through subprocess, os.system, os.posix_spawn and os.fork, which multiprocessing uses), not
a plugin: pytest-socket would cover sockets only. tests/unit/test_unit_guard.py checks
that each door is shut.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

# py-cpuinfo runs `file -b <python>` when it is first imported (vLLM imports it): imported
# here, at collection, so a test that first imports vLLM does not trip the guard on a
# library's import-time probe rather than on anything the test does.
with contextlib.suppress(ImportError):
    import cpuinfo  # noqa: F401

# AF_UNIX stays open: asyncio's event loop wakes itself through a socketpair.
NETWORK_FAMILIES = {socket.AF_INET, socket.AF_INET6}


class NotInUnitTests(RuntimeError):
    """A test under tests/unit tried to reach the network or start a process."""


def _guarded(name: str, original: Any) -> Any:
    def guard(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
        if self.family in NETWORK_FAMILIES:
            raise NotInUnitTests(f"socket.{name}{args!r}: tests/unit makes no network "
                                 "connection; move the test to tests/stack")
        return original(self, *args, **kwargs)
    return guard


def _no_process(*args: Any, **kwargs: Any) -> Any:
    raise NotInUnitTests(f"a process was started ({args[1] if len(args) > 1 else kwargs}): "
                         "tests/unit starts none; move the test to tests/stack")


def _no_os_process(name: str) -> Any:
    def guard(*args: Any, **kwargs: Any) -> Any:
        raise NotInUnitTests(f"os.{name}{args!r}: tests/unit starts no process; move the "
                             "test to tests/stack")
    return guard


@pytest.fixture(autouse=True)
def no_network_no_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, _guarded(name, getattr(socket.socket, name)))
    monkeypatch.setattr(subprocess.Popen, "__init__", _no_process)
    for name in ("system", "posix_spawn", "posix_spawnp", "fork"):
        monkeypatch.setattr(os, name, _no_os_process(name))
    yield
