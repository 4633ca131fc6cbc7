"""The traffic forecast and peak windows as tables of inputs and expected outputs (the
store's traffic samples, the forecaster's history, are in tests/stack/test_traffic_store.py)."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from pathlib import Path

import pytest

from scheduler.forecast import forecast, minute_of, peak_rate_per_s
from scheduler.peaks import PeakWindow, peak_factor, windows_of
from tidegate.lanes import load_lanes

NOW = datetime(2026, 11, 11, 19, 0, 30, tzinfo=UTC)  # mid-minute: the 19:00 minute is open
T0 = minute_of(NOW)
MIN = timedelta(minutes=1)
DAY = timedelta(days=1)
FESTIVAL = PeakWindow(start=T0 + 60 * MIN, end=T0 + 180 * MIN, factor=10.0, ramp_min=15)


def flat(rate: float, days: int = 8, until: datetime = T0) -> dict[datetime, float]:
    """`rate` arrivals every minute for `days` days before `until`."""
    start = until - days * DAY
    return {start + i * MIN: rate for i in range(int((until - start) / MIN))}


def with_recent(history: dict[datetime, float], rate: float) -> dict[datetime, float]:
    """The last 15 complete minutes replaced by `rate`."""
    return {**history, **{T0 - i * MIN: rate for i in range(1, 16)}}


def values(history: dict[datetime, float], horizon: int = 30, **kw: object) -> list[float]:
    return [round(n, 6) for _, n in forecast(history, NOW, horizon, **kw)]  # type: ignore[arg-type]


# -- forecast ------------------------------------------------------------------------


def test_minutes_start_at_the_open_minute() -> None:
    minutes = [m for m, _ in forecast(flat(60), NOW, 3)]
    assert minutes == [T0, T0 + MIN, T0 + 2 * MIN]


@pytest.mark.parametrize(
    ("case", "history", "since", "expected"),
    [
        ("flat week", flat(60), None, 60.0),
        ("yesterday only", flat(30, days=1), None, 30.0),
        # Yesterday 100, last week 50: 0.6 * 100 + 0.4 * 50 (today so far on that blend,
        # so the trend is 1).
        ("yesterday and last week", with_recent({**flat(50), **flat(100, days=2)}, 80), None,
         80.0),
        ("recent minutes only (new lane)", {T0 - i * MIN: 12.0 for i in range(1, 16)}, None,
         12.0),
        ("no history", {}, None, 0.0),
        # Coverage declared from a week ago: the empty minutes are zeros, not unknowns.
        ("empty minutes count as zero", {}, T0 - 8 * DAY, 0.0),
    ],
)
def test_seasonal_base(case: str, history: dict[datetime, float], since: datetime | None,
                       expected: float) -> None:
    assert values(history, since=since) == [expected] * 30, case


@pytest.mark.parametrize(
    ("case", "recent", "expected"),
    [
        ("on season", 60, 60.0),
        ("running 50% above", 90, 90.0),
        ("running 25% below", 45, 45.0),
        ("burst clamped at 2x", 600, 120.0),
        ("outage clamped at 0.5x", 0, 30.0),
    ],
)
def test_trend_scales_the_seasonal_base(case: str, recent: float, expected: float) -> None:
    assert values(with_recent(flat(60), recent)) == [expected] * 30, case


def test_yesterdays_shape_is_followed() -> None:
    # Yesterday the traffic doubled at 19:10; the forecast shows the step, smoothed over
    # the +-5 minutes each lag is read as.
    history = flat(60)
    for i in range(10, 60):
        history[T0 - DAY + i * MIN] = 120.0
    out = values(history)
    assert out[:5] == [60.0] * 5
    assert out[5] == pytest.approx(0.6 * (10 * 60 + 120) / 11 + 0.4 * 60)
    assert out[15:] == [0.6 * 120 + 0.4 * 60] * 15


def test_a_declared_10x_window_with_its_ramp() -> None:
    out = values(flat(60), horizon=200, peaks=[FESTIVAL])
    expected = {0: 60, 59: 60, 60: 60, 65: 60 * 4, 70: 60 * 7, 75: 600, 120: 600,
                170: 60 * 7, 179: 60 * 1.6, 180: 60, 199: 60}
    assert {i: out[i] for i in expected} == pytest.approx(expected)


def test_a_daily_window_is_not_counted_twice() -> None:
    # The same daily 10x window was in yesterday's and last week's counts.
    daily = PeakWindow(start=time(19, 30), end=time(21, 0), factor=10.0, ramp_min=0)
    history = {m: 60.0 * peak_factor([daily], m) for m in flat(60)}
    out = values(history, horizon=60, peaks=[daily])
    assert out[:30] == [60.0] * 30 and out[30:] == [600.0] * 30


def test_a_one_off_window_does_not_come_back_the_next_day() -> None:
    yesterday = PeakWindow(start=T0 - DAY - 60 * MIN, end=T0 - DAY + 60 * MIN, factor=10.0,
                           ramp_min=0)
    history = {m: 60.0 * peak_factor([yesterday], m) for m in flat(60)}
    assert values(history, peaks=[yesterday]) == [60.0] * 30
    # Not declared, yesterday's festival reads as traffic and the forecast repeats it (the
    # trend, seeing today far below, pulls it down only to its 0.5 clamp).
    assert values(history)[0] == pytest.approx((0.6 * 600 + 0.4 * 60) * 0.5)


def test_peak_rate_per_s_takes_the_highest_minute_of_the_span() -> None:
    expected = forecast(flat(60), NOW, 200, peaks=[FESTIVAL])
    assert peak_rate_per_s(expected, NOW, NOW + 2 * MIN) == pytest.approx(1.0)
    assert peak_rate_per_s(expected, NOW, NOW + 80 * MIN) == pytest.approx(10.0)
    assert peak_rate_per_s(expected, NOW + 300 * MIN, NOW + 310 * MIN) == 0.0


# -- peak windows --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "factor"),
    [
        ("21:59", 1.0),
        ("22:00", 1.0),
        ("22:05", 4.0),
        ("22:15", 10.0),
        ("23:59", 10.0),  # across midnight: the window ends at 02:00 the next day
        ("01:45", 10.0),
        ("01:50", 7.0),
        ("02:00", 1.0),
        ("12:00", 1.0),
    ],
)
def test_daily_window_across_midnight(at: str, factor: float) -> None:
    window = PeakWindow(start=time(22, 0), end=time(2, 0), factor=10.0, ramp_min=15)
    hour, minute = map(int, at.split(":"))
    moment = datetime(2026, 11, 11, hour, minute, tzinfo=UTC)
    assert window.factor_at(moment) == pytest.approx(factor)


def test_overlapping_windows_do_not_multiply() -> None:
    at = T0 + 100 * MIN
    quiet = PeakWindow(start=T0, end=T0 + 200 * MIN, factor=0.5, ramp_min=0)
    assert peak_factor([FESTIVAL, FESTIVAL], at) == 10.0
    assert peak_factor([quiet], at) == 0.5
    assert peak_factor([quiet, FESTIVAL], at) == 10.0
    assert peak_factor([], at) == 1.0


def test_window_needs_one_kind_of_bounds() -> None:
    with pytest.raises(ValueError, match="both"):
        PeakWindow(start=time(22, 0), end=T0, factor=2.0)


def test_windows_from_the_lanes_file(tmp_path: Path) -> None:
    path = tmp_path / "lanes.toml"
    path.write_text(
        '[lanes.chat]\nqueue = "chat"\n'
        '[[lanes.chat.peaks]]\nstart = "20:00"\nend = "22:00"\nfactor = 3\n'
        "[[lanes.chat.peaks]]\nstart = 2026-11-11T20:00:00Z\nend = 2026-11-11T23:00:00Z\n"
        "factor = 10\nramp_min = 30\n"
        '[lanes.finance]\nqueue = "finance"\n'
    )
    lanes = load_lanes(path)
    daily, festival = windows_of(lanes["chat"])
    assert (daily.start, daily.factor, daily.ramp_min) == (time(20, 0), 3.0, 15.0)
    assert festival.factor_at(datetime(2026, 11, 11, 20, 15, tzinfo=UTC)) == 5.5
    assert windows_of(lanes["finance"]) == []
    assert (lanes["finance"].min_workers, lanes["finance"].max_workers) == (1, 8)


def test_the_shipped_lanes_file_still_loads() -> None:
    for lane in load_lanes().values():
        assert lane.min_workers <= lane.max_workers
