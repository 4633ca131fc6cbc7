"""The replay clock (tidegate/clock.py, TIDEGATE_REPLAY_*), reactive scaling only
(TIDEGATE_PREWARM=false), and the sim engine's modelled cold start and activation."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest

from scheduler import autoscale
from scheduler.planner import plan
from tidegate import keys
from tidegate.clock import REAL, Clock
from tidegate.lanes import Lane, load_lanes
from tidegate.records import WorkerState
from tidegate.router import WorkerView
from tidegate.settings import Settings, SettingsError, get_settings
from workers.engine import EngineConfig
from workers.sim_engine import SimEngine
from workers.sim_profile import load_profile
from workers.sim_tokens import Vocab

ORIGIN = datetime(2026, 11, 11, 19, 0, tzinfo=UTC)
WALL0 = 1_800_000_000.0


def test_the_real_clock_is_the_default() -> None:
    settings = Settings()
    assert settings.clock is REAL and not settings.clock.replay
    assert abs(settings.clock.now_s() - time.time()) < 1
    assert settings.clock.sim_s(10) == 10


def test_a_replay_clock_runs_from_its_origin_at_its_speedup() -> None:
    wall = [WALL0]
    clock = Clock(ORIGIN, WALL0, 60.0, wall=lambda: wall[0])
    assert clock.now() == ORIGIN
    wall[0] += 1.5  # a second and a half of real time: 90 simulated seconds
    assert clock.now() == ORIGIN + timedelta(seconds=90)
    assert clock.minute() == int(ORIGIN.timestamp() // 60) + 1
    assert (clock.sim_s(2.0), clock.real_s(120.0)) == (120.0, 2.0)


def test_the_replay_settings_make_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_REPLAY_START", "2026-11-11T19:00:00")  # naive: UTC
    monkeypatch.setenv("TIDEGATE_REPLAY_WALL_START", str(WALL0))
    monkeypatch.setenv("TIDEGATE_REPLAY_SPEEDUP", "60")
    clock = Settings().clock
    assert (clock.start, clock.wall_start, clock.speedup) == (ORIGIN, WALL0, 60.0)


@pytest.mark.parametrize(("env", "named"), [
    ({"TIDEGATE_REPLAY_SPEEDUP": "60"}, "TIDEGATE_REPLAY_SPEEDUP"),
    ({"TIDEGATE_REPLAY_WALL_START": str(WALL0)}, "TIDEGATE_REPLAY_WALL_START"),
    ({"TIDEGATE_REPLAY_START": "2026-11-11T19:00:00Z"}, "TIDEGATE_REPLAY_WALL_START"),
    ({"TIDEGATE_REPLAY_START": "2026-11-11T19:00:00Z", "TIDEGATE_REPLAY_WALL_START": "1",
      "TIDEGATE_REPLAY_SPEEDUP": "0"}, "TIDEGATE_REPLAY_SPEEDUP"),
])
def test_a_half_declared_replay_clock_stops_the_process_naming_it(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        with pytest.raises(SettingsError, match=f"invalid setting {named}"):
            get_settings()
    finally:
        get_settings.cache_clear()


# --- the scheduler on the clock -----------------------------------------------------


class FakeStore:
    """The store's traffic samples: (lane, minute) -> arrivals."""

    def __init__(self, counts: dict[datetime, int]) -> None:
        self.counts = counts
        self.recorded: list[tuple[str, datetime, int]] = []
        self.traffic = self  # Store.traffic: its two methods are here

    def arrivals(self, lane: str, since: datetime, until: datetime) -> list[tuple[datetime, int]]:
        return sorted((m, n) for m, n in self.counts.items() if since <= m < until)

    def record_arrivals(self, lane: str, minute: datetime, count: int) -> None:
        self.recorded.append((lane, minute, count))


class FakeRedis:
    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters

    def scan_iter(self, match: str, count: int) -> list[bytes]:
        return [k.encode() for k in self.counters]

    def getdel(self, key: bytes) -> int | None:
        return self.counters.pop(key.decode(), None)


def test_arrivals_are_flushed_by_the_replay_clocks_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEGATE_REPLAY_START", ORIGIN.isoformat())
    monkeypatch.setenv("TIDEGATE_REPLAY_WALL_START", str(time.time() - 10))  # 10 min in
    monkeypatch.setenv("TIDEGATE_REPLAY_SPEEDUP", "60")
    settings = Settings()
    now_min = settings.clock.minute()
    assert now_min == int(ORIGIN.timestamp() // 60) + 10
    ns = settings.namespace
    redis = FakeRedis({keys.arrivals(ns, "chat", now_min - 1): 5,
                       keys.arrivals(ns, "chat", now_min): 7})  # this minute is not over
    store = FakeStore({})
    assert autoscale.flush_arrivals(redis, store, settings) == 5  # type: ignore[arg-type]
    assert store.recorded == [("chat", ORIGIN + timedelta(minutes=9), 5)]


def festival_lane(in_min: int) -> Lane:
    chat = load_lanes()["chat"].model_dump()
    chat["max_workers"] = 16
    chat["peaks"] = [{"start": ORIGIN + timedelta(minutes=in_min),
                      "end": ORIGIN + timedelta(minutes=in_min + 60), "factor": 5.0,
                      "ramp_min": 5.0}]
    return Lane(**chat)


VIEWS = [WorkerView(name="w1", pool="vllm", lanes=frozenset({"chat"}), state=WorkerState.ACTIVE,
                    slots=4, mean_job_ms=1000.0)]


def steady(rate_per_min: int) -> FakeStore:
    """Two weeks of one rate per minute, up to ORIGIN."""
    start = ORIGIN - timedelta(days=8)
    return FakeStore({start + timedelta(minutes=i): rate_per_min for i in range(8 * 1440)})


def workers(lane: Lane, rate_per_s: float) -> int:
    return plan(rate_per_s, 4.0, 1.0, 4, lane.ttft_p99_objective_ms, lane.min_workers,
                lane.max_workers)


def test_prewarm_plans_ahead_on_the_declared_peak_and_holds_for_its_horizon() -> None:
    lane, store = festival_lane(in_min=20), steady(120)
    p = autoscale.lane_plan(store, lane, VIEWS, ORIGIN, lead_s=60, tick_s=60)  # type: ignore[arg-type]
    assert p.want == workers(lane, 2.0)  # the next two minutes: no peak yet
    assert p.horizon_rate == pytest.approx(10.0)  # 5x, inside the next 30 minutes
    assert p.ready == workers(lane, 10.0) > p.want
    soon = autoscale.lane_plan(store, lane, VIEWS, ORIGIN, lead_s=60 * 22, tick_s=60)  # type: ignore[arg-type]
    assert soon.want > p.want  # a lead time that reaches into the ramp


def test_a_lanes_peak_spare_is_held_in_its_declared_window_and_not_before() -> None:
    spare = Lane(**{**festival_lane(in_min=20).model_dump(), "peak_spare_workers": 1})
    store = steady(120)
    plain = autoscale.lane_plan(store, festival_lane(in_min=20), VIEWS, ORIGIN, lead_s=60,  # type: ignore[arg-type]
                                tick_s=60)
    before = autoscale.lane_plan(store, spare, VIEWS, ORIGIN, lead_s=60, tick_s=60)  # type: ignore[arg-type]
    assert before.want == plain.want  # 20 minutes out: no spare active yet
    assert before.ready == plain.ready + 1  # but one more held ready for it
    inside = ORIGIN + timedelta(minutes=30)
    during = autoscale.lane_plan(store, spare, VIEWS, inside, lead_s=60, tick_s=60)  # type: ignore[arg-type]
    plain_during = autoscale.lane_plan(store, festival_lane(in_min=20), VIEWS, inside,  # type: ignore[arg-type]
                                       lead_s=60, tick_s=60)
    assert during.want == plain_during.want + 1
    reactive = autoscale.lane_plan(store, spare, VIEWS, inside, lead_s=60, tick_s=60,  # type: ignore[arg-type]
                                   prewarm=False)
    assert reactive.want == workers(spare, reactive.rate)  # reactive knows no window


def test_reactive_plans_on_the_last_minutes_only() -> None:
    lane, store = festival_lane(in_min=0), steady(120)  # the peak is declared from now on
    store.counts[ORIGIN - timedelta(minutes=1)] = 720  # the last minute: 12 jobs/s
    p = autoscale.lane_plan(store, lane, VIEWS, ORIGIN + timedelta(seconds=20),  # type: ignore[arg-type]
                            lead_s=600, tick_s=60, prewarm=False)
    assert autoscale.REACTIVE_WINDOW_MIN == 5
    assert (p.rate, p.horizon_rate) == (pytest.approx(4.0), pytest.approx(4.0))  # (12+4*2)/5
    assert p.want == p.ready == workers(lane, p.rate)


def test_prewarm_is_on_by_default_and_off_by_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().prewarm
    monkeypatch.setenv("TIDEGATE_PREWARM", "false")
    assert not Settings().prewarm


# --- the sim engine's modelled start --------------------------------------------------


class Sleeps:
    def __init__(self) -> None:
        self.slept: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)


def start_and_warm(scale: float | None) -> list[float]:
    """What a sim engine sleeps through its start (with its warm-up) and one more warm."""
    sleeps = Sleeps()

    async def main() -> None:
        # No request runs: the engine never reads its vocabulary.
        engine = SimEngine(EngineConfig(model="unused"), profile="festival-replay",
                           vocab=cast(Vocab, object()), sleep=sleeps, startup_scale=scale)
        await engine.start()
        await engine.warm([])  # the start's warm-up (workers/host.py)
        await engine.warm([])  # an activation's
        await engine.shutdown()

    asyncio.run(main())
    return sleeps.slept


def test_the_sim_engine_plays_its_profiles_start_only_on_a_replay_clock() -> None:
    profile = load_profile("festival-replay")
    load_s, activation_s = profile.cold_start_s - profile.activation_s, profile.activation_s
    assert start_and_warm(60.0) == pytest.approx([load_s / 60, activation_s / 60,
                                                  activation_s / 60])
    assert start_and_warm(None) == []


def test_a_replays_arrivals_per_simulated_minute_are_planned_as_real_jobs_per_second() -> None:
    """At 60x a simulated minute is a real second: 2 arrivals in it are 2 jobs/s for the
    workers, whose service times are real."""
    lane, store = festival_lane(in_min=120), steady(2)
    p = autoscale.lane_plan(store, lane, VIEWS, ORIGIN, lead_s=60, tick_s=60,  # type: ignore[arg-type]
                            speedup=60.0)
    assert (p.rate, p.now_rate) == (pytest.approx(2.0), pytest.approx(2.0))
    assert p.want == workers(lane, 2.0)
    reactive = autoscale.lane_plan(store, lane, VIEWS, ORIGIN, lead_s=60, tick_s=60,  # type: ignore[arg-type]
                                   prewarm=False, speedup=60.0)
    assert reactive.rate == pytest.approx(2.0)
