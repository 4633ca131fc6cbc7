"""Token events into Redis: each one appended to the job's stream and published on its
channel in one pipelined round trip."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from tidegate import keys
from tidegate.events import Event


@dataclass(frozen=True)
class StreamState:
    """What earlier attempts of a job already published (for idempotent resume)."""

    next_seq: int
    text: str
    token_ids: tuple[int, ...]
    terminal: bool


class EventPublisher:
    def __init__(self, client: redis.Redis, namespace: str, maxlen: int, ttl_s: int) -> None:
        self.r = client
        self.ns = namespace
        self.maxlen = maxlen
        self.ttl_s = ttl_s

    def publish(self, event: Event) -> bool:
        """Append and publish; False when this seq was already appended (a duplicate)."""
        key = keys.job_events(self.ns, event.job_id)
        fields = event.stream_fields()
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(key, fields, id=keys.stream_id(event.seq),  # type: ignore[arg-type]
                  maxlen=self.maxlen, approximate=True)
        pipe.publish(keys.job_live(self.ns, event.job_id), fields["e"])
        if event.terminal:
            pipe.expire(key, self.ttl_s)
        try:
            pipe.execute()
        except redis.ResponseError as exc:
            if "equal or smaller" in str(exc):
                return False
            raise
        return True

    def finished(self, summary: dict[str, object]) -> None:
        """A finished job's timings, read by the API for its Prometheus histograms."""
        self.r.xadd(keys.finished_stream(self.ns), {"s": json.dumps(summary)},
                    maxlen=keys.FINISHED_MAXLEN, approximate=True)

    def state(self, job_id: str) -> StreamState:
        entries: Any = self.r.xrange(keys.job_events(self.ns, job_id))
        events = [Event.from_json(fields[b"e"]) for _, fields in entries]
        tokens = [e for e in events if e.kind == "token"]
        return StreamState(
            next_seq=events[-1].seq + 1 if events else 0,
            text="".join(e.text for e in tokens),
            token_ids=tuple(i for e in tokens for i in e.token_ids),
            terminal=bool(events) and events[-1].terminal,
        )
