"""Every Redis key and channel tidegate uses, in one place.

Schema (``{ns}`` is the deployment namespace, setting ``TIDEGATE_NAMESPACE``; pub/sub
channels ignore the Redis DB number, so the prefix is what keeps two deployments apart).
The ``job`` keys and the wake streams live on the streams' Redis (``TIDEGATE_STREAMS_URL``,
by default the main one, maybe a cluster); ``{t}`` is the job's hash tag in braces
(``job_tag``); everything else lives on the main Redis:

| key / channel                  | type    | written by      | lifetime                          |
|--------------------------------|---------|-----------------|-----------------------------------|
| ``{ns}:job:{t}:{id}:events``   | stream  | worker          | ``stream_ttl_s`` after terminal   |
| ``{ns}:job:{t}:{id}:live``     | channel | worker          | pub/sub, at most once             |
| ``{ns}:job:{t}:{id}:lease``    | string  | worker          | ``lease_ttl_s``, renewed each beat|
| ``{ns}:job:{t}:{id}:cancel``   | string  | API             | ``stream_ttl_s``                  |
| ``{ns}:streamhub:{t}:{h}:wake``| stream  | API             | ``streamhub.WAKE_TTL_S``          |
| ``{ns}:cancel``                | channel | API             | pub/sub: job ids to abort         |
| ``{ns}:worker:{name}``         | string  | worker          | heartbeat, ``heartbeat_ttl_s``    |
| ``{ns}:fleet``                 | channel | worker          | pub/sub: a worker's name, when its|
|                                |         |                 | state changed off its beat        |
| ``{ns}:rate:{tenant}:{min}:{k}``| counter | API             | ``RATE_WINDOW_TTL_S`` (uploads)   |
| ``{ns}:ratelimit:{k/tenant}``  | counter | API, worker     | two minutes (and ``.../-1``): the |
|                                |         |                 | sliding window, tidegate/ratelimit|
| ``{ns}:desired``               | hash    | scheduler       | worker -> desired state and queue |
| ``{ns}:lock:{name}:{period}``  | string  | scheduler,      | two periods (one beat acts; one   |
|                                |         | worker          | worker sweeps for orphans)        |
| ``{ns}:actions``               | stream  | scheduler       | ``ACTIONS_MAXLEN`` entries        |
| ``{ns}:plans``                 | stream  | scheduler       | ``PLANS_MAXLEN`` entries: each    |
|                                |         |                 | tick's plan per lane              |
| ``{ns}:beat:*``                | several | scheduler       | celery-redbeat's schedule and its |
|                                |         |                 | lock (one beat across replicas)   |
| ``{ns}:health:{worker}``       | hash    | scheduler       | ``HEALTH_STRIKES_TTL_S``          |
| ``{ns}:arrivals:{lane}:{min}`` | counter | API             | ``ARRIVALS_TTL_S``, or until the  |
|                                |         |                 | scheduler moves it to the store   |
| ``{ns}:hot:{lane}``            | zset    | API             | ``HOT_PREFIXES_KEPT`` digests,    |
|                                |         |                 | ``hot_prefix_ttl_s`` after a use  |
| ``{ns}:hot:{lane}:{digest}``   | string  | API             | ``hot_prefix_ttl_s`` after a use  |
| ``{ns}:activation_s``          | list    | scheduler       | last 20 activation times          |
| ``{ns}:reconcile:suspects``    | hash    | scheduler       | job -> when first seen orphaned;  |
|                                |         |                 | ``RECONCILE_SUSPECTS_TTL_S``      |
| ``{ns}:webhook:slots:{kind}:{n}``| zset  | webhook sender  | holders of a tenant's or a host's |
|                                |         |                 | delivery slots, each expiring with|
|                                |         |                 | the claim lease                   |
| ``{ns}:webhook:sending:{id}``  | string  | webhook sender  | one attempt of a delivery in      |
|                                |         |                 | flight; the claim lease           |
| ``{ns}:fair:{list}:tags``      | zset    | API             | job -> its fair start tag, while  |
|                                |         |                 | waiting in kombu's ``list`` (on   |
|                                |         |                 | the broker: tidegate/fairq.py);   |
|                                |         |                 | a day after the last push         |
| ``{ns}:fair:{list}:finish``    | hash    | API             | tenant -> its last finish tag on  |
|                                |         |                 | ``list``, the virtual time; as    |
|                                |         |                 | above                             |

Celery queues (kombu's lists on the broker's Redis; no namespace, the broker's DB keeps
deployments apart):

| queue                          | consumed by                                         |
|--------------------------------|-----------------------------------------------------|
| ``{lane queue}.{pool}``        | the active workers of that lane's pool              |
| ``{ns}.direct.{worker}``       | one worker: session affinity, LoRA, scheduler steps |

kombu keeps one list per priority step: ``queue`` for step 0, then ``queue|1`` ..
``queue|9`` (``queue_sublists``); Redis serves step 0 first.

Stream entry ids are ``{seq + 1}-0``: the event's sequence number is its id, so SSE's
``Last-Event-ID`` maps straight onto ``XREAD`` and a duplicate append is refused by Redis.
"""

from __future__ import annotations

import zlib

HEARTBEAT_PERIODS = 5  # a heartbeat lives this many periods: a dead worker is gone after it
RATE_WINDOW_TTL_S = 120  # a one-minute rate window, kept past its minute for late readers
ARRIVALS_TTL_S = 7200  # arrival counters the scheduler did not move (it was down) expire
HEALTH_STRIKES_TTL_S = 600  # a worker's strikes are forgotten after quiet checks
ACTIONS_MAXLEN = 10_000  # scheduler actions kept for `tidegate status`
PLANS_MAXLEN = 10_000  # the scheduler's per-lane plans kept (a day of 10 s ticks, 1 lane)
HOT_PREFIXES_KEPT = 50  # distinct system prompts remembered per lane for warm-ups
PRIORITY_STEPS = tuple(range(10))  # kombu's sub-lists: name all ten, the default merges 0-2
PRIORITY_SEP = "|"


# A worker starved of CPU for seconds keeps its heartbeat and its leases: on 2 shared cores
# every worker's heartbeat thread was measured missing 4-6 s of beats at once.
LEASE_MIN_TTL_S = 10


def heartbeat_ttl_s(heartbeat_s: float) -> int:
    """How long a worker's record outlives its last beat: a crashed worker leaves the fleet
    after this (a cleanly stopped one at once: it removes its record)."""
    return max(LEASE_MIN_TTL_S, int(heartbeat_s * HEARTBEAT_PERIODS) + 1)


def lease_ttl_s(heartbeat_s: float) -> int:
    """A job's lease outlives a few missed beats of its worker, and is gone within seconds
    of its worker's death: the time a crashed worker's jobs wait before they resume."""
    return heartbeat_ttl_s(heartbeat_s)


def pool_queue(lane_queue: str, pool: str) -> str:
    """The queue every worker of `pool` serving a lane consumes."""
    return f"{lane_queue}.{pool}"


def direct_queue(ns: str, worker: str) -> str:
    """Each worker's own queue: session affinity and scheduler-steered work."""
    return f"{ns}.direct.{worker}"


def direct_queue_pattern(ns: str) -> str:
    """Every worker's direct queue and its priority sub-lists (a SCAN pattern)."""
    return f"{ns}.direct.*"


def direct_queue_worker(ns: str, queue: str) -> str | None:
    """The worker whose direct queue (or sub-list of it) `queue` is; None for any other."""
    prefix = f"{ns}.direct."
    if not queue.startswith(prefix):
        return None
    return queue[len(prefix):].split(PRIORITY_SEP, 1)[0] or None


def queue_sublists(queue: str) -> list[str]:
    """kombu's lists of one queue, priority step 0 first."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def sublist_step(sublist: str) -> int:
    """The priority step of one of kombu's lists (`queue_sublists`)."""
    _, sep, step = sublist.rpartition(PRIORITY_SEP)
    return int(step) if sep and step.isdigit() else 0


# A job's keys carry one of these hash tags (Redis Cluster hashes only the part in braces),
# so its stream, lease and cancel key sit on one shard, and the jobs of one tag share one
# slot: the writer appends many jobs' events in one script call and the API reads many
# streams in one XREAD per tag (workers/streamer.py, api/streamhub.py), which a cluster
# refuses across slots. Each tag's slot is the centre of its twenty-fourth of the 16,384
# slots, so a cluster whose masters split the slots evenly gets the same number of tags
# each, for 2, 3, 4, 6, 8, 12 or 24 masters. Fewer tags, fewer calls per engine step (60
# cost a third more Redis CPU per token on 3 masters: bench/README.md); more than 24
# masters gain nothing. Never change them: running jobs' keys would move.
JOB_TAGS = (
    "t14995", "t3124", "t18333", "t3774", "t22874", "t5337", "t764", "t16833", "t48416",
    "t13911", "t134", "t29406", "t15019", "t15284", "t1904", "t23365", "t8280", "t13097",
    "t12450", "t18828", "t11761", "t40483", "t12200", "t6980",
)


def job_tag(job_id: str) -> str:
    """The hash tag of a job's keys (JOB_TAGS), from its id: every process finds the same."""
    return JOB_TAGS[zlib.crc32(job_id.encode()) % len(JOB_TAGS)]


def job_events(ns: str, job_id: str) -> str:
    return f"{ns}:job:{{{job_tag(job_id)}}}:{job_id}:events"


def job_live(ns: str, job_id: str) -> str:
    return f"{ns}:job:{{{job_tag(job_id)}}}:{job_id}:live"


def job_live_pattern(ns: str) -> str:
    """Every job's live channel (PSUBSCRIBE; on a cluster they are shard channels, which
    take no pattern: SSUBSCRIBE each)."""
    return f"{ns}:job:*:live"


def fair_tags(ns: str, sublist: str) -> str:
    """The fair start tags of the jobs waiting in one of kombu's lists (tidegate/fairq.py)."""
    return f"{ns}:fair:{sublist}:tags"


def fair_finish(ns: str, sublist: str) -> str:
    """Each tenant's last finish tag on one of kombu's lists, and the list's clock."""
    return f"{ns}:fair:{sublist}:finish"


def job_lease(ns: str, job_id: str) -> str:
    return f"{ns}:job:{{{job_tag(job_id)}}}:{job_id}:lease"


def job_cancel(ns: str, job_id: str) -> str:
    return f"{ns}:job:{{{job_tag(job_id)}}}:{job_id}:cancel"


def streamhub_wake(ns: str, tag: str, hub: str) -> str:
    """An API process's wake stream for its XREAD of the streams of one tag (api/streamhub.py)."""
    return f"{ns}:streamhub:{{{tag}}}:{hub}:wake"


def tag_of(key: str) -> str:
    """The hash tag in a job key (or a wake stream's)."""
    return key.partition("{")[2].partition("}")[0]


def cancel_channel(ns: str) -> str:
    return f"{ns}:cancel"


def worker_heartbeat(ns: str, name: str) -> str:
    return f"{ns}:worker:{name}"


def worker_heartbeat_pattern(ns: str) -> str:
    return f"{ns}:worker:*"


def rate_window(ns: str, tenant_id: int, minute: int, kind: str) -> str:
    return f"{ns}:rate:{tenant_id}:{minute}:{kind}"


def rate_limits(ns: str) -> str:
    """The prefix of the per-minute rate limits' counters (tidegate/ratelimit.py): the
    `limits` library names them `{prefix}:{<kind>/<tenant>}` and `.../-1`."""
    return f"{ns}:ratelimit"


def desired_states(ns: str) -> str:
    return f"{ns}:desired"


def scheduler_lock(ns: str, name: str, period: int) -> str:
    return f"{ns}:lock:{name}:{period}"


def scheduler_actions(ns: str) -> str:
    return f"{ns}:actions"


def scheduler_plans(ns: str) -> str:
    return f"{ns}:plans"


def beat_prefix(ns: str) -> str:
    """celery-redbeat's key prefix: it writes ``{prefix}:schedule``, ``{prefix}:statics``,
    ``{prefix}:lock`` and one hash per entry, ``{prefix}{entry name}``."""
    return f"{ns}:beat:"


def beat_lock(ns: str) -> str:
    """The lock the one beat sending the schedule holds (redbeat's `lock_key`)."""
    return f"{beat_prefix(ns)}:lock"


def health_strikes(ns: str, worker: str) -> str:
    return f"{ns}:health:{worker}"


def arrivals(ns: str, lane: str, minute: int) -> str:
    return f"{ns}:arrivals:{lane}:{minute}"


def arrivals_pattern(ns: str) -> str:
    return f"{ns}:arrivals:*"


def parse_arrivals(key: str) -> tuple[str, int]:
    """(lane, minute since the epoch) of an arrivals counter key."""
    _, lane, minute = key.rsplit(":", 2)
    return lane, int(minute)


def hot_prefixes(ns: str, lane: str) -> str:
    """A lane's system prompts ranked by use, as digests (tidegate/hot.py)."""
    return f"{ns}:hot:{lane}"


def hot_prefix_text(ns: str, lane: str, digest: str) -> str:
    """One hot prefix's text, under the sha256 digest the ranking holds."""
    return f"{ns}:hot:{lane}:{digest}"


def activation_times(ns: str) -> str:
    return f"{ns}:activation_s"


RECONCILE_SUSPECTS_TTL_S = 600  # written every reconcile pass; gone when no scheduler runs


def reconcile_suspects(ns: str) -> str:
    """Jobs the reconciler found with no message and no lease, and since when."""
    return f"{ns}:reconcile:suspects"


def stream_id(seq: int) -> str:
    """Stream entry id of event ``seq`` (ids must be > 0-0, hence the +1)."""
    return f"{seq + 1}-0"


def seq_of(entry_id: str | bytes) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0]) - 1


def batch_lock(ns: str, batch_id: str) -> str:
    """Held by the batch driver while it steps a batch (api/batch_driver.py); lives
    BATCH_LOCK_S."""
    return f"{ns}:lock:batch:{batch_id}"


def batch_driver_lock(ns: str) -> str:
    """Held by the one `tidegate batches` process that drives the open batches; its TTL is
    TIDEGATE_BATCH_DRIVER_LOCK_S, extended while it runs (tidegate/locks.py)."""
    return f"{ns}:lock:batch-driver"


BATCH_LOCK_S = 60  # longer than one pass over a batch; a dead holder's lock lapses


def fleet_channel(ns: str) -> str:
    """Pub/sub: a worker's name, published right after it wrote a heartbeat off its period
    (an activation): routers re-read the fleet at once instead of at its next beat."""
    return f"{ns}:fleet"


def auth_changed_channel(ns: str) -> str:
    """Pub/sub: a key or tenant was revoked or changed; every API process forgets the keys
    it had found valid (api/auth.py), so a revoked key is refused at once."""
    return f"{ns}:auth-changed"


def webhook_slots(ns: str, kind: str, name: str) -> str:
    """The deliveries in flight of one tenant (`tenant`, its id) or to one host (`host`),
    across every webhook process: a sorted set of holders scored by when each slot lapses
    (tasks/webhooks.py `Slots`)."""
    return f"{ns}:webhook:slots:{kind}:{name}"


def webhook_sending(ns: str, delivery_id: str) -> str:
    """Held while one attempt of a delivery is in flight (tidegate/locks.py RedisLock): a
    duplicate of its task does nothing meanwhile."""
    return f"{ns}:webhook:sending:{delivery_id}"
