"""`tidegate up`: the whole stack left running; the `curl` and `openai` lines it prints work
as printed, Flower answers behind the login it prints, and Ctrl-C (SIGINT) stops every
process it started.

Its own Redis (a port where none answers: `tidegate up` starts one), SQLite database,
data folder, namespace and ports; the shipped lanes file; the toy checkpoint."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tidegate_tools.procs import free_port, tidegate_argv, wait_until

UP_START_S = 600.0  # two vLLM engines loading at once on a shared 2-core machine
STOP_S = 120.0

pytestmark = pytest.mark.timeout(UP_START_S + 300)


class Up:
    """`tidegate up` as a child process, its printed lines collected as they come."""

    def __init__(self, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(tidegate_argv("up"), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.lines: list[str] = []
        self.seen: dict[int, psutil.Process] = {}  # every descendant seen, for the cleanup
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def printed() -> bool:
            self.descendants()
            match = re.search(pattern, self.text(), re.MULTILINE)
            if match:
                found.append(match)
            elif self.popen.poll() is not None:
                raise AssertionError(f"tidegate up exited {self.popen.returncode}:\n"
                                     f"{self.text()}")
            return bool(match)

        wait_until(printed, timeout_s, f"tidegate up to print {pattern!r}")
        return found[0]

    def after(self, heading: str, count: int) -> list[str]:
        """The `count` lines printed under the line starting with `heading`."""
        at = next(i for i, line in enumerate(self.lines) if line.strip().startswith(heading))
        return [line.strip() for line in self.lines[at + 1:at + 1 + count]]

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update((p.pid, p) for p in found)
        return found


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: a zombie has ended (this machine's init may reap it late)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def up(tmp_root: Path, model_path: Path) -> Iterator[Up]:
    data = tmp_root / "up"
    env = {k: v for k, v in os.environ.items() if k != "TIDEGATE_LANES_FILE"}  # shipped lanes
    env.update({
        "TIDEGATE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # none there: up starts one
        "TIDEGATE_DATA_DIR": str(data),
        "TIDEGATE_DATABASE_URL": f"sqlite:///{data / 'up.db'}",
        "TIDEGATE_NAMESPACE": "tgup",
        "TIDEGATE_MODEL": str(model_path),
        "TIDEGATE_API_PORT": str(free_port()),
        "TIDEGATE_FLOWER_PORT": str(free_port()),
    })
    env.pop("TIDEGATE_FLOWER_PASSWORD", None)  # up makes one up and prints it
    proc = Up(env)
    try:
        yield proc
    finally:
        proc.descendants()
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()
        for child in running(list(proc.seen.values())):  # each part has a session of its own
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_up_answers_what_it_prints_and_ctrl_c_leaves_no_process(up: Up) -> None:
    up.wait_for(r"^  3\. Flower", UP_START_S)
    print(up.text())  # shown when the test fails
    key = up.wait_for(r"API key \(shown once\): (\S+)", 1).group(1)
    pids = {int(p) for p in re.findall(r"^  \S.* pid (\d+) ", up.text(), re.MULTILINE)}
    parts = {line.split()[0] for line in up.lines if re.match(r"^  \S.* pid \d+ ", line)}
    assert {"redis", "api", "batches", "webhooks", "flower"} <= parts, up.text()
    assert len([line for line in up.lines if line.startswith("  worker ")]) == 2  # finance, chat

    # 1. The curl lines, as printed: a job submitted, its tokens streamed to its end.
    curl = up.after("1. submit", 2)
    assert curl[0].startswith("JOB=$(curl ") and curl[1].startswith("curl -sN ")
    done = subprocess.run(["bash", "-c", "\n".join(curl)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert "event: token" in done.stdout and "event: done" in done.stdout, done.stdout

    # 2. The openai lines, as printed, through the openai package.
    lines = up.after("2. the openai client", 4)
    assert lines[0] == "from openai import OpenAI"
    names: dict[str, object] = {}
    exec(compile("\n".join(lines), "<tidegate up's openai lines>", "exec"), names)  # noqa: S102
    reply = names["reply"]
    assert reply.usage.completion_tokens > 0  # type: ignore[attr-defined]
    assert reply.choices[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    assert key in lines[1]

    # 3. Flower behind the login it printed.
    flower = up.wait_for(r"3\. Flower.*: (http://\S+) \(user (\S+), password (\S+) ", 1)
    url, user, password = flower.groups()
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(f"{url}/workers", auth=(user, password), timeout=30).status_code == 200

    # Ctrl-C: every process it started, and theirs, ends.
    started = up.descendants()
    assert pids <= {p.pid for p in started}, (pids, started)
    os.kill(up.popen.pid, signal.SIGINT)
    assert up.popen.wait(STOP_S) == 0, up.text()
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not running(started), 30, "every process up started to end")
    left = running(started)
    assert not left, f"left running: {[(p.pid, p.cmdline()) for p in left]}"
    assert "[up] stopped" in up.text()
