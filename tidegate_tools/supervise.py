"""`tidegate worker` is a small supervisor around the Celery worker process it starts: a
worker asked to restart (a rolling restart of its engine) exits with RESTART_EXIT and is
started again, in standby, as a new process. Signals are passed on to the worker."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType

from tidegate.records import RESTART_EXIT


def supervise(args: list[str]) -> int:
    argv = [sys.executable, "-m", "tidegate_server", *args, "--supervised"]
    _become_subreaper()
    while True:
        child = subprocess.Popen(argv)
        forward = _forwarder(child)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        code = child.wait()
        _reap_leftovers()
        if code != RESTART_EXIT:
            return code
        if "--standby" not in argv:
            argv.insert(-1, "--standby")  # the scheduler warms it, then reactivates it


def _become_subreaper() -> None:
    """Orphans of the worker (its engine's processes) become this process's children, so
    a restart can end them: a new engine started beside the old one's leftovers hung."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _reap_leftovers() -> None:
    import psutil

    leftovers = psutil.Process().children(recursive=True)
    for proc in leftovers:
        proc.kill()
    psutil.wait_procs(leftovers, timeout=10)


def _forwarder(child: subprocess.Popen[bytes]):  # type: ignore[no-untyped-def]
    def forward(signum: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    return forward
