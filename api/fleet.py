"""The fleet as `GET /fleetz` reports it: each lane's workers by state and pool.

Kept apart from /readyz on purpose. /readyz says whether this API process can serve
(Redis, the database, its tokenizer), and a load balancer acts on it; whether workers are
active is the fleet's health, not the API's: during a rolling worker restart every API
pod would otherwise leave the load balancer, and submits would fail instead of queueing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tidegate.lanes import Lane
from tidegate.records import Heartbeat, WorkerState


def fleet_report(fleet: Iterable[Heartbeat], lanes: Mapping[str, Lane]) -> dict[str, Any]:
    """{"ready", "workers": {state: count}, "lanes": {lane: {"ready", "runs_on"?,
    state: {pool: [names]}}}}. A lane is ready when a worker serving it is active, or
    when it needs none (`min_workers = 0`); the fleet is ready when every lane is. A lane
    that runs on another's workers (`runs_on`) reports that lane's workers, and any worker
    started on the lane itself (the demo starts one per lane)."""
    workers = list(fleet)
    report = {name: _lane_report(lane, lanes, workers) for name, lane in sorted(lanes.items())}
    counts = {state.value: sum(hb.state == state for hb in workers) for state in WorkerState}
    return {"ready": all(r["ready"] for r in report.values()), "workers": counts,
            "lanes": report}


def _lane_report(lane: Lane, lanes: Mapping[str, Lane], fleet: list[Heartbeat]) -> dict[str, Any]:
    host = lanes.get(lane.runs_on, lane) if lane.runs_on else lane
    by_state: dict[str, dict[str, list[str]]] = {state.value: {} for state in WorkerState}
    for hb in fleet:
        if host.name in hb.lanes or lane.name in hb.lanes:
            by_state[hb.state.value].setdefault(hb.pool, []).append(hb.name)
    for pools in by_state.values():
        for names in pools.values():
            names.sort()
    ready = bool(by_state[WorkerState.ACTIVE.value]) or host.min_workers == 0
    return {"ready": ready, **({"runs_on": host.name} if lane.runs_on else {}), **by_state}


def active_workers(report: Mapping[str, Any]) -> set[str]:
    """Every worker the report shows active, whatever its lane and pool."""
    return {name for lane in report["lanes"].values()
            for names in lane[WorkerState.ACTIVE.value].values() for name in names}
