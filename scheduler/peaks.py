"""Declared peak windows: traffic the history cannot know about (a festival night, a
quarter-end close), declared per lane in the lanes file.

A window multiplies the expected traffic by `factor` between `start` and `end`. The
factor does not jump: it climbs linearly from 1 at `start` to `factor` at
`start + ramp_min`, holds, and falls back linearly to 1 over the last `ramp_min` minutes
before `end` (both ramps inside the window, so the window bounds every minute it
changes). A ramp longer than half the window never reaches the full factor.

`start`/`end` are either datetimes (a one-off window) or times of day in UTC (every
day; an end at or before the start ends the next day). Where windows overlap, the factor
farthest from 1 wins: two declarations of the same night must not multiply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from tidegate.lanes import Lane, PeakSpec

DAY = timedelta(days=1)


@dataclass(frozen=True)
class PeakWindow:
    """One declared window; see the module docstring for the shape of its factor."""

    start: datetime | time  # datetime: once; time of day (UTC): daily
    end: datetime | time
    factor: float  # traffic multiplier at the top of the window
    ramp_min: float = 15.0  # minutes to climb from 1 to factor (and back down)

    def __post_init__(self) -> None:
        if isinstance(self.start, datetime) != isinstance(self.end, datetime):
            raise ValueError("peak window: start and end must both be datetimes or both times")
        if self.factor <= 0 or self.ramp_min < 0:
            raise ValueError(f"peak window: factor {self.factor} must be > 0, "
                             f"ramp_min {self.ramp_min} >= 0")

    def occurrences(self, at: datetime) -> Iterable[tuple[datetime, datetime]]:
        """The concrete (start, end) spans that may contain `at` (aware, UTC)."""
        if isinstance(self.start, datetime) and isinstance(self.end, datetime):
            yield _utc(self.start), _utc(self.end)
            return
        assert isinstance(self.start, time) and isinstance(self.end, time)
        # Yesterday's occurrence may run past midnight into today.
        for day in (at.date() - DAY, at.date()):
            start, end = _on(day, self.start), _on(day, self.end)
            yield start, end if end > start else end + DAY

    def factor_at(self, at: datetime) -> float:
        """The multiplier at `at`: 1 outside the window, ramping to `factor` inside."""
        best = 1.0
        for start, end in self.occurrences(at):
            if start <= at < end:
                best = max(best, self._ramped(min(at - start, end - at)), key=_dist1)
        return best

    def _ramped(self, from_edge: timedelta) -> float:
        ramp_s = self.ramp_min * 60.0
        share = 1.0 if ramp_s <= 0 else min(1.0, from_edge.total_seconds() / ramp_s)
        return 1.0 + (self.factor - 1.0) * share


def peak_factor(windows: Sequence[PeakWindow], at: datetime) -> float:
    """The multiplier in force at `at`: the window farthest from 1 wins, 1 outside all."""
    return max((w.factor_at(at) for w in windows), key=_dist1, default=1.0)


def windows_of(lane: Lane) -> list[PeakWindow]:
    """The lane's declared windows, from its lanes-file entries."""
    return [from_spec(spec) for spec in lane.peaks]


def from_spec(spec: PeakSpec) -> PeakWindow:
    return PeakWindow(start=spec.start, end=spec.end, factor=spec.factor, ramp_min=spec.ramp_min)


def _dist1(factor: float) -> float:
    # A quiet window (factor < 1) must also win over "no window", hence distance from 1.
    return abs(factor - 1.0)


def _utc(at: datetime) -> datetime:
    """Naive datetimes in the lanes file (TOML local datetimes) are read as UTC."""
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _on(day: date, at: time) -> datetime:
    moment = datetime.combine(day, at.replace(tzinfo=None))
    return _utc(moment.replace(tzinfo=at.tzinfo) if at.tzinfo else moment)
