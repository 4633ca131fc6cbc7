"""The API's cached fleet (api/fleet.py FleetCache) and a worker's record of what it
warmed (workers/warmed.py): what a router and an activation get to see."""

from __future__ import annotations

from api.fleet import FleetCache
from tidegate.records import EngineStats, Heartbeat, WorkerState
from workers.warmed import Warmed


def beat(name: str, state: WorkerState) -> Heartbeat:
    return Heartbeat(name=name, state=state, lanes=("chat",), pool="vllm", slots=4)


class Fleet:
    """The heartbeats in Redis, as `read_fleet` would return them; counts the reads."""

    def __init__(self, state: WorkerState) -> None:
        self.state, self.reads = state, 0

    def read(self) -> list[Heartbeat]:
        self.reads += 1
        return [beat("w1", self.state)]


def test_the_cache_serves_reads_within_its_age() -> None:
    fleet = Fleet(WorkerState.STANDBY)
    cache = FleetCache(fleet.read, max_age_s=3600)
    assert [v.state for v in cache.views()] == [WorkerState.STANDBY]
    fleet.state = WorkerState.ACTIVE
    assert [v.state for v in cache.views()] == [WorkerState.STANDBY]  # cached: not read
    assert fleet.reads == 1


def test_an_announced_change_is_seen_at_the_next_view() -> None:
    fleet = Fleet(WorkerState.STANDBY)
    cache = FleetCache(fleet.read, max_age_s=3600)
    cache.views()
    fleet.state = WorkerState.ACTIVE
    cache.changed()
    assert [v.state for v in cache.views()] == [WorkerState.ACTIVE]
    assert fleet.reads == 2


def test_a_read_that_began_before_the_announcement_does_not_count_as_after_it() -> None:
    fleet = Fleet(WorkerState.STANDBY)
    cache = FleetCache(fleet.read, max_age_s=3600)

    def announce_mid_read() -> list[Heartbeat]:
        views = fleet.read()  # read the old state, then the worker announces
        cache.changed()
        return views

    cache._read = announce_mid_read  # type: ignore[method-assign]
    assert [v.state for v in cache.views()] == [WorkerState.STANDBY]
    cache._read = fleet.read  # type: ignore[method-assign]
    fleet.state = WorkerState.ACTIVE
    assert [v.state for v in cache.views()] == [WorkerState.ACTIVE]


def stats(evictions: int) -> EngineStats:
    return EngineStats(kv_evictions=evictions)


def test_prompts_warmed_are_not_warmed_again_until_something_is_evicted() -> None:
    warmed = Warmed()
    assert warmed.missing(["a", "b"], "vllm", stats(0)) == ["a", "b"]
    warmed.add(["a", "b"], "vllm", stats(0))
    assert warmed.missing(["a", "b", "c"], "vllm", stats(0)) == ["c"]
    assert warmed.missing(["a", "b"], "vllm", stats(1)) == ["a", "b"]  # evicted since


def test_a_warm_that_evicted_is_not_trusted_and_a_reset_forgets() -> None:
    warmed = Warmed()
    warmed.missing(["a"], "vllm", stats(0))
    warmed.add(["a"], "vllm", stats(2))  # the warm itself evicted blocks
    assert warmed.missing(["a"], "vllm", stats(2)) == ["a"]
    warmed.add(["a"], "vllm", stats(2))
    assert warmed.missing(["a"], "vllm", stats(2)) == []
    warmed.forget()
    assert warmed.missing(["a"], "vllm", stats(2)) == ["a"]


def test_an_engine_that_does_not_count_evictions_warms_every_time() -> None:
    warmed = Warmed()
    warmed.add(["a"], "trtllm", stats(0))
    assert warmed.missing(["a"], "trtllm", stats(0)) == ["a"]
    assert warmed.missing(["a"], "vllm", None) == ["a"]
