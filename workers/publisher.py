"""Token events into Redis: each one appended to the job's stream and published on its
channel in one round trip, by a script that first checks the attempt still holds the
job's lease (workers/lease.py): a replaced attempt can never add to the stream."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from tidegate import keys
from tidegate.events import Event
from workers.lease import Lease, LeaseLost

# KEYS: lease, stream. ARGV: owner, entry id, event JSON, kind, maxlen, channel, stream
# TTL (0: none), lease TTL. A lapsed lease nobody else took is taken back (workers/lease.py).
# The entry id is the event's seq, so Redis refuses a second append of one seq.
APPEND = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[8]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], ARGV[2], 'e', ARGV[3], 'k', ARGV[4])
redis.call('PUBLISH', ARGV[6], ARGV[3])
if ARGV[7] ~= '0' then redis.call('EXPIRE', KEYS[2], ARGV[7]) end
return 1
"""


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
        self._append: Any = client.register_script(APPEND)

    def publish(self, event: Event, lease: Lease) -> bool:
        """Append and publish; False when this seq was already appended (a duplicate);
        LeaseLost when `lease` is no longer the attempt's."""
        fields = event.stream_fields()
        args = [lease.owner, keys.stream_id(event.seq), fields["e"], fields["k"], self.maxlen,
                keys.job_live(self.ns, event.job_id), self.ttl_s if event.terminal else 0,
                lease.ttl_s]
        try:
            appended = self._append(keys=[lease.key, keys.job_events(self.ns, event.job_id)],
                                    args=args)
        except redis.ResponseError as exc:
            if "equal or smaller" in str(exc):
                return False
            raise
        if not appended:
            raise LeaseLost(event.job_id)
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
