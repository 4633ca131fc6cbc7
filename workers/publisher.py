"""Token events into Redis: each one appended to the job's stream and published on its
channel in one round trip, by a script that first checks the attempt still holds the
job's lease (workers/lease.py): a replaced attempt can never add to the stream.

A Redis that restarted empty (no persistence) lost the streams of the jobs running: the
script notices that a stream it appends to after the first event is gone, and the
attempt writes back every event it knows of (its own and earlier attempts') before the
new one, with their own seqs, so a consumer reconnecting after the last event it kept
gets exactly what it missed: no gap, no repeat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from tidegate import keys, redisconn
from tidegate.events import Event
from tidegate.redisconn import StreamsClient
from workers.lease import ENDED_FUNCTION, RENEW, Lease, LeaseLost, register_script

log = logging.getLogger("tidegate.worker")

# One event's append, as a Lua function of its two keys and the offset of its ARGVs.
# Keys: lease, stream. ARGVs (from o + 1): owner, entry id, event JSON, kind, maxlen,
# channel, stream TTL (0: none), lease TTL, mode, write time. A lapsed lease nobody else
# took is taken back (workers/lease.py), unless the stream already holds the job's end
# (another attempt ended it: this one stalled and is fenced off). The entry id is the
# event's seq, so Redis refuses a second append of one seq (the XADD error is returned,
# not raised: a batch goes on).
# Modes: "next" (an event after the first: -1 if the stream is gone), "first", "restore"
# (an event written back: not published again on the live channel). The entry's `t` is
# the worker's time.time() when it sent this write (seconds, a decimal string; a
# written-back event gets the time of the write-back): readers of the event read `e` and
# `k` only; `t` is for measuring delivery (bench/frontdoor.py). New ARGVs go at the end,
# so the order above stays as it is, and ARGS_PER_EVENT grows with them.
APPEND_FUNCTION = ENDED_FUNCTION + """
local function append(lease, stream, o)
  local holder = redis.call('GET', lease)
  if holder and holder ~= ARGV[o + 1] then return 0 end
  if not holder and ended(stream) then return 0 end
  if not holder then redis.call('SET', lease, ARGV[o + 1], 'EX', ARGV[o + 8]) end
  -- After the first event the stream must be there: NOMKSTREAM answers nil (false in
  -- Lua) when it is gone, in the same command (an EXISTS before it was one more per event).
  local added
  if ARGV[o + 9] == 'next' then
    added = redis.pcall('XADD', stream, 'NOMKSTREAM', 'MAXLEN', '~', ARGV[o + 5], ARGV[o + 2],
                        'e', ARGV[o + 3], 'k', ARGV[o + 4], 't', ARGV[o + 10])
    if not added then return -1 end
  else
    added = redis.pcall('XADD', stream, 'MAXLEN', '~', ARGV[o + 5], ARGV[o + 2],
                        'e', ARGV[o + 3], 'k', ARGV[o + 4], 't', ARGV[o + 10])
  end
  if type(added) == 'table' and added.err then return added end
  if ARGV[o + 9] ~= 'restore' then redis.call('PUBLISH', ARGV[o + 6], ARGV[o + 3]) end
  if ARGV[o + 7] ~= '0' then redis.call('EXPIRE', stream, ARGV[o + 7]) end
  return 1
end
"""
ARGS_PER_EVENT = 10
# A job stream's entries as XRANGE answers them: (stream id, {b"e": event JSON, b"k": kind}).
StreamEntries = Sequence[tuple[bytes, Mapping[bytes, bytes]]]

# One event: 1 appended, 0 the lease is another's, -1 the stream is gone; Redis's XADD
# error (a seq appended before) comes back as the script's error.
APPEND = APPEND_FUNCTION + "return append(KEYS[1], KEYS[2], 0)\n"

# Many jobs' events at once (workers/streamer.py), KEYS and ARGVs one event after the
# other: an answer per event, as APPEND's, with DUPLICATE for a seq appended before. Any
# other error ends the script with it: the events before it are appended, the rest not.
DUPLICATE = 2
APPEND_MANY = APPEND_FUNCTION + f"""
local answers = {{}}
for i = 1, #KEYS / 2 do
  local answer = append(KEYS[2 * i - 1], KEYS[2 * i], (i - 1) * {ARGS_PER_EVENT})
  if type(answer) == 'table' then
    if not string.find(answer.err, 'equal or smaller', 1, true) then return answer end
    answer = {DUPLICATE}
  end
  answers[i] = answer
end
return answers
"""

# On a Redis Cluster (TIDEGATE_STREAMS_URL) the live channel is a shard channel: a PUBLISH
# there goes to every node of the cluster over its bus, a cost per event on every shard
# (bench/README.md); SPUBLISH stays on the shard of the job's slot (subscribers use
# SSUBSCRIBE). Its channel carries the job's hash tag, as a script's keys must.


def sharded(script: str) -> str:
    """`script` publishing on shard channels (SPUBLISH, Redis 7) instead of PUBLISH."""
    return script.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")



@dataclass(frozen=True)
class StreamState:
    """What earlier attempts of a job already published (for idempotent resume)."""

    next_seq: int
    text: str
    token_ids: tuple[int, ...]
    terminal: bool
    events: tuple[Event, ...] = ()  # all of them, to write back if Redis loses the stream


class EventPublisher:
    def __init__(self, client: StreamsClient, namespace: str, maxlen: int, ttl_s: int) -> None:
        self.r = client
        self.ns = namespace
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self._scripts = (APPEND, APPEND_MANY)
        if redisconn.is_cluster_client(client):
            self._scripts = (sharded(APPEND), sharded(APPEND_MANY))
        self._append = register_script(client, self._scripts[0])
        self._append_many = register_script(client, self._scripts[1])

    def publish(self, event: Event, lease: Lease, history: Sequence[Event] = ()) -> bool:
        """Append and publish; False when this seq was already appended (a duplicate);
        LeaseLost when `lease` is no longer the attempt's. `history`: the job's events
        before this one, written back first if Redis lost the stream."""
        appended = self._append_one(event, lease, "next" if event.seq > 0 else "first")
        if appended == -1:
            log.warning("job %s: its event stream was lost (Redis restarted empty?); "
                        "writing back its %d earlier events", event.job_id, len(history))
            for past in history:
                self._append_one(past, lease, "restore")
            appended = self._append_one(event, lease, "first")
        return appended is not None

    def publish_last(self, event: Event, lease: Lease, history: Sequence[Event] = ()) -> bool:
        """publish() of an attempt's last event, and its lease released, in one round trip
        when all goes well; otherwise publish() then release(), each on its own."""
        script_keys, args = self.append_call(event, lease, "next" if event.seq > 0 else "first")
        pipe = self.r.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", self.append_sha, 2, *script_keys, *args)
        lease.release_in(pipe)
        appended, released = pipe.execute(raise_on_error=False)
        if appended == 1:
            if released in (0, 1):
                lease.released = True
            else:  # the release's script was not loaded: release on its own
                lease.release()
            return True
        # Off the usual way (the stream lost, a duplicate, the lease another's, the append
        # script Redis forgot): the release above may have run, and an append takes a lapsed
        # lease back, so the append goes first and the release again after it.
        published = self.publish(event, lease, history)
        lease.release()
        return published

    def _append_one(self, event: Event, lease: Lease, mode: str) -> int | None:
        """The script's answer (1, or -1: the stream is gone); None for a seq appended
        before; LeaseLost when the lease is another attempt's."""
        script_keys, args = self.append_call(event, lease, mode)
        try:
            answer = self._append(keys=script_keys, args=args)
        except redis.ResponseError as exc:
            if is_duplicate(exc):
                return None
            raise
        if answer == 0:
            if event.terminal and self._holds(event):
                return None  # a retry: this very event went out, its reply was lost
            raise LeaseLost(event.job_id)
        return int(answer)

    def _holds(self, event: Event) -> bool:
        """The stream has this very event at its seq. An attempt's last event releases its
        lease in the same round trip (publish_last): when that reply is lost, the retry
        finds no lease and the job's end in the stream, and must not take itself for a
        replaced attempt (LeaseLost leaves the task unacked, to be delivered again). Asked
        only then: a retried event before the last finds its lease and Redis refuses the
        seq, and nothing is appended on this answer either way (the script checks the
        lease before its XADD)."""
        entries: Any = self.r.xrange(keys.job_events(self.ns, event.job_id),
                                     keys.stream_id(event.seq), keys.stream_id(event.seq))
        return bool(entries) and entries[0][1].get(b"e") == event.to_json().encode()

    @property
    def append_sha(self) -> str:
        return str(self._append.sha)

    @property
    def append_many_sha(self) -> str:
        return str(self._append_many.sha)

    def load_append(self) -> None:
        """Load the append scripts into Redis (a restarted Redis has lost them): for
        callers that send them by their sha in a pipeline (workers/streamer.py), with the
        lease's renew, which the streamer sends with a job's last batch."""
        for script in (*self._scripts, RENEW):
            self.r.script_load(script)

    def append_call(self, event: Event, lease: Lease, mode: str) -> tuple[list[str], list[Any]]:
        """The append script's keys and arguments for one event."""
        fields = event.stream_fields()
        args = [lease.owner, keys.stream_id(event.seq), fields["e"], fields["k"], self.maxlen,
                keys.job_live(self.ns, event.job_id), self.ttl_s if event.terminal else 0,
                lease.ttl_s, mode, repr(time.time())]
        return [lease.key, keys.job_events(self.ns, event.job_id)], args

    def append_many_call(self, calls: Sequence[tuple[Event, Lease]]
                         ) -> tuple[list[str], list[Any]]:
        """APPEND_MANY's keys and arguments for these events (each after its job's first:
        the streamer's token events), one event's after the other."""
        script_keys: list[str] = []
        args: list[Any] = []
        for event, lease in calls:
            event_keys, event_args = self.append_call(event, lease,
                                                      "next" if event.seq > 0 else "first")
            script_keys += event_keys
            args += event_args
        return script_keys, args

    @staticmethod
    def many_answers(reply: object, n: int) -> list[object]:
        """APPEND_MANY's reply as an answer per event, as APPEND's: 1 also for an event
        appended before (it is there); the reply itself for all when the call failed."""
        if isinstance(reply, BaseException) or not isinstance(reply, list) or len(reply) != n:
            return [reply] * n
        return [1 if answer == DUPLICATE else answer for answer in reply]

    def state(self, job_id: str) -> StreamState:
        # redis-py types every reply as maybe awaitable; this client is the sync one.
        entries = cast(StreamEntries, self.r.xrange(keys.job_events(self.ns, job_id)))
        return self.state_of(entries)

    @staticmethod
    def state_of(entries: StreamEntries) -> StreamState:
        """The state the job stream's entries (XRANGE) make."""
        events = [Event.from_json(fields[b"e"]) for _, fields in entries]
        tokens = [e for e in events if e.kind == "token"]
        return StreamState(
            next_seq=events[-1].seq + 1 if events else 0,
            text="".join(e.text for e in tokens),
            token_ids=tuple(i for e in tokens for i in e.token_ids),
            terminal=bool(events) and events[-1].terminal,
            events=tuple(events),
        )


def is_duplicate(exc: BaseException) -> bool:
    """Redis refused an append because its seq is already in the stream (a retry after a
    lost reply): the event is there."""
    return isinstance(exc, redis.ResponseError) and "equal or smaller" in str(exc)
