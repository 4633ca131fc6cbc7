"""The session-priority retention policy (workers/kvcache/policy.py) as tables of request
metadata and the retention its blocks get."""

from __future__ import annotations

import json

import pytest

from tidegate.lanes import KvPolicy
from workers.kvcache.policy import EXPIRED_PRIORITY, Retention, SessionMeta, retention

DEFAULTS = KvPolicy()  # 80 for 4 turns, -5 a turn to 40; one-shot 10; shared 90; idle 90 s


@pytest.mark.parametrize(("meta", "priority", "duration_s"), [
    # one-shot: no session, no turn, or the session's last turn; never lapses (it is last)
    (SessionMeta(None), 10, None),
    (SessionMeta(None, turn=3), 10, None),
    (SessionMeta("s1", turn=0), 10, None),
    (SessionMeta("s1", turn=2, live=False), 10, None),
    # a short, live session
    (SessionMeta("s1", turn=1), 80, 90.0),
    (SessionMeta("s1", turn=4), 80, 90.0),
    # then 5 a turn down to the floor, and no further
    (SessionMeta("s1", turn=5), 75, 90.0),
    (SessionMeta("s1", turn=6), 70, 90.0),
    (SessionMeta("s1", turn=11), 45, 90.0),
    (SessionMeta("s1", turn=12), 40, 90.0),
    (SessionMeta("s1", turn=13), 40, 90.0),
    (SessionMeta("s1", turn=500), 40, 90.0),
    # warm-up prompts are shared prefixes, session or not
    (SessionMeta(None, warm=True), 90, 90.0),
    (SessionMeta("s1", turn=7, warm=True), 90, 90.0),
])
def test_default_retention_classes(meta: SessionMeta, priority: int,
                                   duration_s: float | None) -> None:
    got = retention(meta, DEFAULTS)
    assert (got.priority, got.duration_s) == (priority, duration_s)
    assert got.shared_priority == 90  # every class is lifted once another request reuses it


@pytest.mark.parametrize(("params", "turn", "priority"), [
    (KvPolicy(short_session_turns=1), 1, 80),
    (KvPolicy(short_session_turns=1), 2, 75),
    (KvPolicy(decay_per_turn=0), 50, 80),  # no decay: long sessions keep their class
    (KvPolicy(decay_per_turn=30), 6, 40),  # 80 - 60 is below the floor
    (KvPolicy(long_session_floor=0, decay_per_turn=20), 8, 0),
    # a floor above the starting priority never lifts a session above where it started
    (KvPolicy(session_priority=30, long_session_floor=40), 1, 30),
    (KvPolicy(session_priority=30, long_session_floor=40), 20, 30),
])
def test_session_priority_with_lane_parameters(params: KvPolicy, turn: int,
                                               priority: int) -> None:
    assert retention(SessionMeta("s1", turn=turn), params).priority == priority


def test_lane_parameters_reach_every_class() -> None:
    params = KvPolicy(session_priority=70, one_shot_priority=5, shared_priority=95,
                      session_idle_s=12.5)
    assert retention(SessionMeta(None), params) == Retention(5, None, 95)
    assert retention(SessionMeta("s", turn=1), params) == Retention(70, 12.5, 95)
    assert retention(SessionMeta(None, warm=True), params) == Retention(95, 12.5, 95)


def test_one_shot_is_evicted_before_every_session_class() -> None:
    one_shot = retention(SessionMeta(None), DEFAULTS).priority
    sessions = [retention(SessionMeta("s", turn=t), DEFAULTS).priority for t in range(1, 40)]
    assert one_shot < min(sessions)
    assert min(sessions) > EXPIRED_PRIORITY  # a lapsed session drops below a live long one
    assert sessions == sorted(sessions, reverse=True)  # never climbs back with more turns


@pytest.mark.parametrize("kept", [
    Retention(10),
    Retention(80, 90.0, 90),
    Retention(40, 0.5, 0),
    Retention(100, None, 100),
])
def test_retention_round_trips_through_json(kept: Retention) -> None:
    # The adapter sends it to the engine process in SamplingParams.extra_args as JSON.
    body = json.loads(json.dumps(kept.as_dict()))
    assert Retention.from_dict(body) == kept


def test_retention_from_dict_coerces_types() -> None:
    got = Retention.from_dict({"priority": 80.0, "duration_s": 90, "shared_priority": 90.0})
    assert got == Retention(80, 90.0, 90)
    assert isinstance(got.priority, int) and isinstance(got.duration_s, float)
