"""A job's lease: which attempt may run it, and the fence on everything it writes to Redis.

One attempt at a time holds `{ns}:job:{id}:lease`, its value a token of its own (worker
and a random part, so two deliveries on one worker are two attempts). The worker's
heartbeat renews the leases it holds; a worker that dies stops renewing, its leases expire
after `keys.lease_ttl_s`, and the recovery sweep (tasks/recovery.py) hands its messages
back to their queues. Every event an attempt appends is written by a script that first
checks the lease is still its own (or takes back one that lapsed with no other holder),
so an attempt that stalled past its lease and was replaced can never add a token to the
job's stream: it gets LeaseLost and stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.commands.core import Script

from tidegate.locks import RELEASE, RedisLock, new_token
from tidegate.redisconn import StreamsClient, StreamsPipeline

# Whether the job's stream (the key `stream`) already ends in a terminal event: then the
# job ended, its last attempt released the lease, and a lapsed lease is not taken back (a
# stalled attempt that wakes after another ended the job is fenced off, not let write after
# the end). Read only when the lease is free, which is rare.
ENDED_FUNCTION = """
local function ended(stream)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
  if not last then return false end
  local fields = last[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'k' then return fields[i + 1] == 'done' or fields[i + 1] == 'error' end
  end
  return false
end
"""

# Extends the lease if it is this attempt's, or takes it back if it lapsed and no other
# attempt took it, nor ended the job (KEYS[2], the job's stream, when given): a worker that
# stalled past its lease (seconds, on a starved host) goes on; a takeover stops it.
RENEW = ENDED_FUNCTION + """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
if not holder and KEYS[2] and ended(KEYS[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
WAIT_POLL_S = 0.5  # a duplicate delivery checks the other attempt's lease this often


class LeaseLost(Exception):
    """This attempt no longer holds its job's lease: another attempt took the job over."""


class Lease:
    def __init__(self, client: StreamsClient, key: str, worker: str, ttl_s: int,
                 stream: str | None = None) -> None:
        """`stream`: the job's event stream; given, a lapsed lease is not taken back once
        the stream holds the job's end (RENEW)."""
        self.r, self.key, self.ttl_s = client, key, ttl_s
        self._keys = [key] if stream is None else [key, stream]
        # Taken and released as the one lock idiom (tidegate/locks.py); renewed by RENEW,
        # which also takes back a lease that lapsed with no other holder.
        self._lock = RedisLock(client, key, ttl_s, token=new_token(worker))
        self.owner = self._lock.token
        self._release = register_script(client, RELEASE)
        self._renew = register_script(client, RENEW)
        self.released = False  # by this attempt, which is over

    def take(self) -> bool:
        return self._lock.acquire()

    def take_in(self, pipe: StreamsPipeline) -> None:
        """take() queued on a pipeline (the caller reads the reply)."""
        self._lock.acquire_in(pipe)

    def take_when_free(self, give_up: Callable[[], bool]) -> bool:
        """Takes the lease once the attempt holding it ends or dies (its lease expires);
        False when `give_up()` says the wait is over (the job ended meanwhile)."""
        while not self.take():
            if give_up():
                return False
            time.sleep(WAIT_POLL_S)
        return True

    def renew(self) -> bool:
        """True while this attempt holds the lease (extended, or taken back if free)."""
        return bool(self._renew(keys=self._keys, args=[self.owner, self.ttl_s]))

    def renew_in(self, pipe: StreamsPipeline) -> None:
        """renew() queued on a pipeline by its script's sha (the reply: 1 held, 0 another's;
        NoScriptError when Redis does not know it, and the caller then renews itself).
        EVALSHA by execute_command: redis-py's cluster pipeline refuses its evalsha()."""
        pipe.execute_command("EVALSHA", self._renew.sha, len(self._keys), *self._keys,
                             self.owner, self.ttl_s)

    def release(self) -> None:
        """Deletes the lease if it is still this attempt's, never another's."""
        self._release(keys=[self.key], args=[self.owner])
        self.released = True

    def release_in(self, pipe: StreamsPipeline) -> None:
        """release() queued on a pipeline: its script by sha (the caller falls back to
        release() when Redis does not know it)."""
        pipe.execute_command("EVALSHA", self._release.sha, 1, self.key, self.owner)


def register_script(client: StreamsClient, text: str) -> Script:
    """redis-py types register_script for its Redis alone; its RedisCluster has the same
    one (the script runs on the node of its keys' slot)."""
    return client.register_script(text)  # type: ignore[misc]
