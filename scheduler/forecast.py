"""Traffic forecast: arrivals per minute for the next minutes of one lane.

Pure: the history (arrivals per minute, as sampled into the store) and the declared peak
windows come in as values, so the table tests and the fleet simulation run the very code
the scheduler runs.

The algorithm, for each minute m from the current (partial) minute to `horizon_min - 1`
minutes later:

1. De-peak the history. Each past count is divided by the declared peak factor in force
   at its minute, so a declared peak is neither counted twice (a daily window is in
   yesterday's count *and* declared again) nor carried into the next day (a one-off
   festival night must not come back tomorrow at 10x).
2. Seasonal base S(m): a weighted blend of the same minute yesterday (weight 0.6: it
   follows recent growth) and the same minute last week (0.4: it knows the weekday).
   Each lag is read as the mean of the 11 minutes centred on it, because a single
   minute's count is mostly Poisson noise. A lag before the history's start is left out
   and the weights of the others renormalised.
3. Trend T: the last 15 complete minutes' actual (de-peaked) arrivals over their own
   seasonal expectation, clamped to [0.5, 2]: today running 20% above yesterday lifts
   the whole forecast 20%, while a burst or an outage cannot swing it without bound.
   Without a seasonal expectation for those minutes, T = 1.
4. Base B(m) = S(m) * T. Without any seasonal history (a new lane), B(m) is the recent
   15 minutes' de-peaked mean, flat; with no history at all, 0.
5. Forecast F(m) = B(m) * P(m), P the declared peak factor at m (scheduler/peaks.py).

Coverage: the history covers [since, now), `since` defaulting to its first key. Inside
that span a minute absent from the mapping had no arrivals (the store writes a row only
when something arrived); before it, a minute is unknown, not zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from scheduler.peaks import PeakWindow, peak_factor

MINUTE = timedelta(minutes=1)
# (lag, weight): yesterday follows recent growth, last week keeps the weekday's shape.
SEASONAL_LAGS = ((timedelta(days=1), 0.6), (timedelta(days=7), 0.4))
SMOOTH_MIN = 5  # a lag is read as the mean of the minutes within +-5 of it
RECENT_MIN = 15  # minutes the trend and the no-history fallback look back
TREND_MIN, TREND_MAX = 0.5, 2.0  # a burst or an outage cannot swing the forecast further

Forecast = list[tuple[datetime, float]]


def minute_of(at: datetime) -> datetime:
    """The minute `at` falls in: how the store keys traffic samples."""
    return at.replace(second=0, microsecond=0)


class _History:
    """Past arrivals with their coverage, de-peaked on read."""

    def __init__(self, counts: Mapping[datetime, float], since: datetime | None,
                 now: datetime, peaks: Sequence[PeakWindow]) -> None:
        self.counts = counts
        first = min(counts, default=None)
        self.since = minute_of(since) if since is not None else first
        self.until = minute_of(now)  # exclusive: the current minute is not over
        self.peaks = peaks

    def depeaked(self, minute: datetime) -> float | None:
        """Arrivals at `minute` as if no declared peak applied; None when not covered."""
        if self.since is None or not self.since <= minute < self.until:
            return None
        return float(self.counts.get(minute, 0.0)) / peak_factor(self.peaks, minute)

    def mean(self, start: datetime, minutes: int) -> float | None:
        """Mean de-peaked arrivals over `minutes` from `start`, over the covered ones."""
        known = [v for i in range(minutes) if (v := self.depeaked(start + i * MINUTE)) is not None]
        return sum(known) / len(known) if known else None


def seasonal(hist: _History, minute: datetime) -> float | None:
    """The weighted blend of the lags that history covers; None when it covers none."""
    total = weight_sum = 0.0
    for lag, weight in SEASONAL_LAGS:
        value = hist.mean(minute - lag - SMOOTH_MIN * MINUTE, 2 * SMOOTH_MIN + 1)
        if value is not None:
            total += weight * value
            weight_sum += weight
    return total / weight_sum if weight_sum else None


def trend(hist: _History) -> float:
    """Recent actual over recent seasonal expectation, clamped; 1 without a pairing."""
    actual = expected = 0.0
    for i in range(1, RECENT_MIN + 1):
        minute = hist.until - i * MINUTE
        value, season = hist.depeaked(minute), seasonal(hist, minute)
        if value is not None and season is not None:
            actual += value
            expected += season
    if expected <= 0:
        return 1.0
    return min(TREND_MAX, max(TREND_MIN, actual / expected))


def forecast(history: Mapping[datetime, float], now: datetime, horizon_min: int,
             peaks: Sequence[PeakWindow] = (), since: datetime | None = None) -> Forecast:
    """Expected arrivals for each minute from now's minute on, `horizon_min` minutes.

    history: arrivals per minute keyed by the (aware, UTC) minute; see the module
    docstring for the algorithm and for what `since` means.
    """
    hist = _History(history, since, now, peaks)
    factor = trend(hist)
    recent = hist.mean(hist.until - RECENT_MIN * MINUTE, RECENT_MIN)
    out: Forecast = []
    for i in range(horizon_min):
        minute = hist.until + i * MINUTE
        season = seasonal(hist, minute)
        base = season * factor if season is not None else (recent or 0.0)
        out.append((minute, base * peak_factor(peaks, minute)))
    return out


def peak_rate_per_s(expected: Forecast, start: datetime, end: datetime) -> float:
    """The highest forecast arrival rate (per second) among the minutes overlapping
    [start, end): what the fleet must carry when it is that far ahead."""
    first = minute_of(start)
    rates = [n / 60.0 for minute, n in expected if first <= minute < end]
    return max(rates, default=0.0)
