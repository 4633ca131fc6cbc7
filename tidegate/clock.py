"""The time the control plane plans by: the real clock, or a replay's compressed one.

A replay (bench/festival.py) plays a simulated day faster than real time through the
real processes: the API counts arrivals per *simulated* minute, and the scheduler
forecasts, reads the declared peak windows and times its lead in simulated time. Three
settings describe the replay clock (tidegate/settings.py):

- `TIDEGATE_REPLAY_START`: the simulated moment the replay begins (ISO 8601, UTC);
  unset (the default) is the real clock;
- `TIDEGATE_REPLAY_WALL_START`: the real moment (Unix seconds) at which the simulated
  clock reads REPLAY_START, the same for every process of the replay;
- `TIDEGATE_REPLAY_SPEEDUP`: simulated seconds per real second (60: a minute a second).

Only the planning is compressed: a job's own times (queue wait, TTFT, the engine's steps),
heartbeats, leases and the scheduler's period stay real seconds. What the scheduler
measures in real seconds and plans with in simulated time (an activation's duration, its
own period) it converts with `sim_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime


@dataclass(frozen=True)
class Clock:
    """Planning time: the real clock when `start` is None, else a replay's."""

    start: datetime | None = None  # the simulated moment at `wall_start`; None: real time
    wall_start: float = 0.0  # Unix seconds when the replay's clock reads `start`
    speedup: float = 1.0  # simulated seconds per real second
    wall: Callable[[], float] = field(default=time.time, repr=False, compare=False)

    @property
    def replay(self) -> bool:
        return self.start is not None

    def now_s(self) -> float:
        """Planning time in Unix seconds."""
        wall = self.wall()
        if self.start is None:
            return wall
        return self.start.timestamp() + (wall - self.wall_start) * self.speedup

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.now_s(), UTC)

    def minute(self) -> int:
        """The current minute since the epoch: how arrivals are counted and flushed."""
        return int(self.now_s() // 60)

    def sim_s(self, real_s: float) -> float:
        """A real duration in planning seconds (an activation measured, the tick period)."""
        return real_s * self.speedup

    def real_s(self, sim_s: float) -> float:
        """A planning duration in real seconds (a modelled engine load, compressed)."""
        return sim_s / self.speedup


REAL = Clock()
