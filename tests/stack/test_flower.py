"""`tidegate flower` runs Flower with the app, behind basic auth, and sees the workers; it
refuses to start without a password of the operator's own."""

from __future__ import annotations

import os
import subprocess

import httpx
import psutil
import pytest

from tests.helpers import Stack
from tidegate_tools.procs import Proc, free_port, tidegate_argv, wait_until


def test_flower_requires_auth_and_sees_the_workers(stack: Stack, tmp_root) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    env = {**os.environ, "TIDEGATE_FLOWER_USER": "ops", "TIDEGATE_FLOWER_PASSWORD": "s3cret"}
    proc = Proc("flower", tidegate_argv("flower", "--port", str(port)),
                tmp_root / "logs" / "flower.log", env)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{base}/healthcheck", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 60, "Flower to answer", [proc])
        # The password reaches Flower through its environment: a command line is visible
        # to every local user.
        assert "s3cret" not in " ".join(psutil.Process(proc.popen.pid).cmdline())
        assert httpx.get(f"{base}/api/workers", timeout=10).status_code == 401
        wrong = httpx.get(f"{base}/api/workers", auth=("ops", "wrong"), timeout=10)
        assert wrong.status_code == 401

        def sees_workers() -> bool:
            resp = httpx.get(f"{base}/api/workers", params={"refresh": "1"}, auth=("ops", "s3cret"),
                             timeout=20)
            return resp.status_code == 200 and set(stack.workers.values()) <= set(resp.json())

        wait_until(sees_workers, 30, "Flower to list both workers", [proc], poll_s=1)
    finally:
        proc.stop()


@pytest.mark.parametrize("password", ["", "tidegate"], ids=["unset", "old-default"])
def test_flower_refuses_to_start_without_a_password_of_its_own(password: str) -> None:
    env = {**os.environ, "TIDEGATE_FLOWER_PASSWORD": password}
    # Before the check, Flower started and served: the run would time out.
    done = subprocess.run(tidegate_argv("flower", "--port", str(free_port())), env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "TIDEGATE_FLOWER_PASSWORD" in done.stderr
