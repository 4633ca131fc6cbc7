"""Where a job goes. Today: its lane's queue, which every worker of the lane consumes.
Engine pools, session affinity and fallback build on this decision point."""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.lanes import Lane


@dataclass(frozen=True)
class Route:
    queue: str  # Celery queue the job is published to
    reason: str  # why, for the job's record and logs


def route(lane: Lane) -> Route:
    return Route(queue=lane.queue, reason=f"lane {lane.name} queue")
