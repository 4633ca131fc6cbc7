"""Weighted fair queuing of tenants inside each of kombu's lists.

kombu's Redis transport keeps a queue as lists, one per priority step; the API pushes a
job's message on the left and a worker's consumer pops on the right. Pushed as they come,
one tenant that floods a lane puts every other tenant's jobs behind its backlog. So the
API (api/submit.py) places each message by start-time fair queuing (Goyal et al., SFQ;
the cost in tokens, as the Virtual Token Counter of Sheng et al. does for LLM serving):

    cost    = (prompt tokens + max_tokens) / the tenant's weight
    start   = max(V - burst x cost, the tenant's last finish tag on this list)
    finish  = start + cost

and the list stays ordered by start tag, lowest at the right (popped first), equal tags in
arrival order. V, the list's virtual time, follows the lowest start tag still waiting (the
job served next), or, when nothing tracked waits, the highest start tag given so far; it
never goes back. While several tenants are backlogged, each gets the list's capacity in
proportion to its weight, measured in the tokens its jobs ask for: their tags run ahead
of V by their own backlogs.

A tenant whose jobs all ran, or that was quiet, starts `burst` of its jobs' costs before
V (TIDEGATE_FAIR_BURST_JOBS, default 4): its first few jobs go ahead of every backlogged
tenant's, then it takes its share like the others. Without that credit (plain SFQ) a
tenant far below its share still had its little bursts spread at half the capacity
behind a flood's (bench/fairness.py: its TTFT p50 740 ms against 115 ms alone); with it
unbounded, a long-idle tenant would take a whole lane. The credit is bounded, so no
tenant banks idle time.

Across API processes: one script places the message and updates the tags atomically on
the broker's Redis, so every process sees one order. Only the push is changed: workers
pop as before, the lending pull (workers/lending.py) moves the rightmost, the reconciler's
resends and kombu's restores push without a tag. A sorted set of waiting jobs' start tags
is trimmed at each push to the list's length (the jobs popped since were its lowest);
untracked messages, all of them sent before or outside this order, are served in the
places they were put. A list that empties drops its set, so any drift ends there.

The cost is what a job may take, not what it took: a tenant that asks max_tokens it does
not use pays for them in order (never in tokens billed).
"""

from __future__ import annotations

import redis
from redis.client import Pipeline

from tidegate import keys

# KEYS: the kombu list, its start tags (zset job id -> tag), the finish tags (hash
# tenant -> tag, "_clock": the highest start tag given, "_now": the virtual time, never
# lowered). ARGV: the message, the job id, the tenant, the job's cost divided by the
# tenant's weight, the burst credit (how far before the virtual time it may start), the
# keys' time to live (a worker's direct queue ends with the worker: its tags must too).
# Returns how many waiting messages it went ahead of (they are served after it; 0: at the
# back, as a plain LPUSH).
PUSH = """
local waiting = redis.call('LLEN', KEYS[1])
if waiting == 0 then
  redis.call('DEL', KEYS[2])
else
  local excess = redis.call('ZCARD', KEYS[2]) - waiting
  if excess > 0 then redis.call('ZPOPMIN', KEYS[2], excess) end
end
local clock = tonumber(redis.call('HGET', KEYS[3], '_clock') or '0')
local now = tonumber(redis.call('HGET', KEYS[3], '_now') or '0')
local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if head[2] then now = math.max(now, tonumber(head[2])) else now = math.max(now, clock) end
local start = now - tonumber(ARGV[5])
local finish = redis.call('HGET', KEYS[3], ARGV[3])
if finish then start = math.max(start, tonumber(finish)) end
redis.call('HSET', KEYS[3], ARGV[3], string.format('%.17g', start + tonumber(ARGV[4])),
           '_now', string.format('%.17g', now))
if start > clock then redis.call('HSET', KEYS[3], '_clock', string.format('%.17g', start)) end
local later = redis.call('ZCOUNT', KEYS[2], string.format('(%.17g', start), '+inf')
if later == 0 then
  redis.call('LPUSH', KEYS[1], ARGV[1])
else
  local pivot = redis.call('LINDEX', KEYS[1], later - 1)
  if pivot then
    redis.call('LINSERT', KEYS[1], 'AFTER', pivot, ARGV[1])
  else
    redis.call('RPUSH', KEYS[1], ARGV[1])
  end
end
redis.call('ZADD', KEYS[2], string.format('%.17g', start), ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[6])
return later
"""


TAGS_TTL_S = 86_400  # a list's tags outlive its last push by a day, then go


def cost(prompt_tokens: int, max_tokens: int, weight: int) -> float:
    """A job's virtual cost: the tokens it may take over its tenant's weight (>= 1)."""
    return (prompt_tokens + max_tokens) / max(weight, 1)


class FairPush:
    """Places job messages in fair order on the broker's Redis (`client`)."""

    def __init__(self, client: redis.Redis, ns: str, burst: int = 4) -> None:
        self.script = client.register_script(PUSH)
        self.ns, self.burst = ns, burst

    def script_keys(self, sublist: str) -> list[str]:
        return [sublist, keys.fair_tags(self.ns, sublist), keys.fair_finish(self.ns, sublist)]

    def args(self, message: str, job_id: str, tenant: int, job_cost: float) -> list[str | int]:
        return [message, job_id, str(tenant), repr(float(job_cost)),
                repr(float(job_cost * self.burst)), TAGS_TTL_S]

    def add(self, pipe: Pipeline, sublist: str, message: str, job_id: str, tenant: int,
            job_cost: float) -> None:
        """Queues the push on a pipeline as EVALSHA (no SCRIPT EXISTS round trip: redis-py's
        pipeline makes one for each registered script it runs); the answer is a
        NoScriptError when the broker does not know it yet (`push` then loads it)."""
        script_keys = self.script_keys(sublist)
        pipe.execute_command(  # type: ignore[no-untyped-call]
            "EVALSHA", self.script.sha, len(script_keys), *script_keys,
            *self.args(message, job_id, tenant, job_cost))

    def push(self, sublist: str, message: str, job_id: str, tenant: int,
             job_cost: float) -> int:
        """The push alone (the script loaded where missing): how many it went ahead of."""
        return int(self.script(keys=self.script_keys(sublist),
                               args=self.args(message, job_id, tenant, job_cost)))
