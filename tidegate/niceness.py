"""A process's CPU priority: the lanes' workers (their lane's cpu_nice) and the background
processes (the batch driver, the webhook sender: TIDEGATE_BACKGROUND_NICE) lower theirs,
so that on a shared node the front door and the more urgent lanes come first."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def lower_cpu_priority(nice: int, why: str) -> None:
    """This process at niceness `nice`, before its threads and engine process start (both
    inherit it). Linux keeps a niceness per thread, so threads already running are set one
    by one. Only ever lowers the priority: raising it needs privileges."""
    if nice <= os.getpriority(os.PRIO_PROCESS, 0):
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") \
        else [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    log.info("CPU priority lowered to niceness %d (%s)", nice, why)
    _session_nice(nice)


AUTOGROUP = Path("/proc/self/autogroup")


def _session_nice(nice: int) -> None:
    """Linux's autogroup scheduling shares the CPU between sessions first, so a niceness
    only counts against processes of the same session: a process in a session of its own
    (tidegate's process tools, systemd and containers start it so) sets its session's
    niceness too. In someone else's session (a shell's) that would slow the rest of it:
    left alone, and said."""
    if not AUTOGROUP.exists():
        return
    if os.getsid(0) not in (os.getpid(), os.getppid()):  # the supervisor leads its own
        log.warning("niceness %d counts only against this session's processes: start the "
                    "process in a session of its own (setsid) for it to count against others",
                    nice)
        return
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError as exc:
        log.warning("could not set this session's niceness to %d: %s", nice, exc)
