"""The reconciler: the store is the truth, and Redis is made to agree with it.

An accepted job is durable before its 202: its row holds the task's payload until the
job ends (store.models.Job.payload). Redis holds what moves a job on: its message (in a
queue list, or in kombu's unacked hash while a worker has it), its lease (while an
attempt runs it, workers/lease.py) and its event stream. Redis loses them when it is
restarted without its data or flushed, and a bug can drop a message. Every
`reconcile_s`, one scheduler (the period's lock, then a holder lock: two passes never
overlap) compares the jobs the store has not seen end, accepted more than
`reconcile_grace_s` ago, with what Redis holds:

    in the store                   in Redis                     the pass
    queued or running              a message or a lease         nothing
                                   neither                      sends it again, or ends it
    cancelled while running, not   a lease (its worker lives)   nothing: the worker ends it
    finished (its worker died)     no lease                     ends it

A job must be found so for `reconcile_grace_s`, over two passes at least (the suspects
hash), before the pass acts: a message is briefly in neither place while a worker takes
it (BRPOP, then kombu's unacked entry) or a restore puts it back. To act, the pass takes
the job's lease itself, so no attempt starts meanwhile and no worker appends to the
stream while it writes there (workers/publisher.py appends under the lease only).

Sent again: the stored payload, at the job's priority, to the queue the router picks now
(a session to the live worker holding its prefix, a LoRA job to a worker with the adapter,
else the lane's pool; with no worker at all, the lane's pool queue to wait in); the row's
queue and route reason say so. The attempt resumes after whatever the job's stream still
holds (workers/runner.py).

Ended, store first and then the terminal event its consumer waits for, then the stream's
TTL: a payload past its deadline -> `expired` (`error` event, deadline_exceeded, as a
worker writes it); no payload (accepted before the store kept them) -> `error`, code
`lost`; cancelled -> the `done` event with finish_reason `cancelled` that the API writes
for a queued job, the tokens in the stream kept as its output.

Each pass also moves the messages waiting in the direct queue of a dead worker (no
heartbeat) to a queue a live worker of their lane consumes, as tasks/recovery.py does for
a dead worker's unacked messages. The store names the queue each job was sent to, so the
dead direct queues are found from the unended jobs' queues, without scanning Redis' keys.

The deadline rule. A job's deadline is its lane's promise to the client, wall-clock from
accept (the payload's deadline_at, fixed by the API). Time a job lay orphaned, its
message lost or its worker dead, counts like any other and is never given back: a job
sent again keeps its deadline_at, and one found past it ends `expired` with a terminal
event, here or in the worker that takes it.

Bounds: at most RECONCILE_BATCH jobs a pass (oldest first); the queue lists are read only
when a queued or running job lacks a lease, and at most MAX_SCANNED messages of them: past
that, nothing is sent again this pass (a backlog that long is not one Redis lost). Every
action is logged and recorded in the scheduler's actions (ids and queues, never text).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypedDict, cast

import redis
from celery import Celery

from store import JobRecord, Store
from tasks.app import queue_lengths, send_generate
from tasks.payloads import GeneratePayload
from tasks.recovery import (
    live_queue,
    message_task_id,
    push_served_next,
    rerouted,
    stranded_worker,
    target_queue,
    task_id,
)
from tidegate import capabilities, keys, redisconn, router
from tidegate.events import Event, Kind
from tidegate.fleet import read_fleet
from tidegate.lanes import pool_queue, redis_priority
from tidegate.locks import RedisLock, new_token
from tidegate.records import ACTIVE_STATUSES, Heartbeat, JobStatus, WorkerState
from tidegate.redisconn import StreamsClient
from tidegate.settings import Settings

log = logging.getLogger("tidegate.reconcile")

RECONCILE_BATCH = 500  # unended jobs looked at per pass, oldest first
MAX_SCANNED = 20_000  # queued and unacked messages read per pass at most
MAX_MOVED = 1000  # messages moved out of dead workers' direct queues per pass
HOLD_S = 30  # the holder lock lapses if a pass died without releasing it

# What a pass did to one job or one queue ({"action": ..., "job_id": ...}): logged, and
# recorded with the scheduler's actions (scheduler/service.py).
Action = dict[str, object]


class PassResult(TypedDict, total=False):
    acted: bool  # False: another pass was running
    reason: str  # why it did not act
    actions: list[Action]


@dataclass
class Pass:
    """One pass: its clients, the fleet it saw and the time it started."""

    app: Celery
    client: redis.Redis  # the suspects hash, the queues
    store: Store
    settings: Settings
    streams: StreamsClient  # the token streams' Redis (leases, streams): maybe `client`
    fleet: list[Heartbeat] = field(default_factory=list)
    now: float = field(default_factory=time.time)

    @property
    def ns(self) -> str:
        return self.settings.namespace

    @property
    def alive(self) -> set[str]:
        """Workers that consume their direct queue: heartbeating and not failed."""
        return {hb.name for hb in self.fleet if hb.state != WorkerState.FAILED}


def reconcile(app: Celery, client: redis.Redis, store: Store, settings: Settings) -> PassResult:
    """One pass, if no other runs now; returns what it did."""
    lock = RedisLock(client, keys.scheduler_lock(settings.namespace, "reconciling", 0), HOLD_S)
    if not lock.acquire():
        return {"acted": False, "reason": "another pass is running"}
    try:
        run = Pass(app, client, store, settings, streams_client(settings) or client,
                   fleet=read_fleet(client, settings.namespace))
        return {"acted": True, "actions": _reconcile(run)}
    finally:
        lock.release()


def _reconcile(run: Pass) -> list[Action]:
    before = datetime.fromtimestamp(run.now - run.settings.reconcile_grace_s, UTC)
    queues = run.store.jobs.unended_queues(keys.direct_queue(run.ns, ""))
    actions = _move_stranded(run, set(queues))
    jobs = run.store.jobs.unended_jobs(before, RECONCILE_BATCH)
    leased = _leased(run, [job.id for job in jobs])
    lacking = [job for job in jobs if job.id not in leased]
    present = _queued_ids(run) if any(j.status in ACTIVE_STATUSES for j in lacking) else set()
    suspects = [job for job in lacking if _orphaned(job, present)]
    confirmed = _confirm(run, [job.id for job in suspects])
    for job in suspects:
        if job.id in confirmed and (action := _act(run, job)) is not None:
            actions.append(action)
    return actions


def _orphaned(job: JobRecord, present: set[str] | None) -> bool:
    """A job with no lease is orphaned when cancelled (its worker is gone: the lease is
    what a live attempt holds) or when no message of it is queued; when the queues were
    too long to read (present is None), a queued or running job is not judged."""
    if job.status == JobStatus.CANCELLED:
        return True
    return present is not None and job.id not in present


# -- what Redis holds ----------------------------------------------------------------


def _leased(run: Pass, job_ids: list[str]) -> set[str]:
    pipe = run.streams.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.exists(keys.job_lease(run.ns, job_id))
    return {job_id for job_id, n in zip(job_ids, pipe.execute(), strict=True) if n}


def _queued_ids(run: Pass) -> set[str] | None:
    """Job ids of every message in the lanes' pool queues, the live workers' direct queues
    and kombu's unacked hash; None when there are more than MAX_SCANNED."""
    lists = [sub for lane in run.settings.lanes.values() for pool in lane.pools
             for sub in keys.queue_sublists(pool_queue(lane, pool))]
    lists += [sub for name in run.alive
              for sub in keys.queue_sublists(keys.direct_queue(run.ns, name))]
    with run.app.pool.acquire(block=True) as conn:
        channel: Any = conn.default_channel
        broker, unacked = channel.client, channel.qos.unacked_key
        pipe = broker.pipeline(transaction=False)
        for sub in lists:
            pipe.llen(sub)
        pipe.hlen(unacked)
        *lengths, in_flight = pipe.execute()
        if sum(lengths) + in_flight > MAX_SCANNED:
            log.warning("reconcile: %d messages queued, over %d: no job is sent again this "
                        "pass", sum(lengths) + in_flight, MAX_SCANNED)
            return None
        for sub, length in zip(lists, lengths, strict=True):
            if length:
                pipe.lrange(sub, 0, -1)
        pipe.hvals(unacked)
        *queued, taken = pipe.execute()
    ids = {message_task_id(_loads(raw)) for batch in queued for raw in batch}
    ids |= {task_id(raw) for raw in taken}
    return {job_id for job_id in ids if job_id is not None}


def _loads(raw: bytes) -> dict[str, Any]:  # a kombu message: JSON
    try:
        message = json.loads(raw)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def _confirm(run: Pass, job_ids: list[str]) -> set[str]:
    """The suspects found so for `reconcile_grace_s` already. The hash is rewritten with
    this pass's suspects only: a job seen fine once starts its wait again."""
    key = keys.reconcile_suspects(run.ns)
    # redis-py types a reply as maybe awaitable; this client is the sync one.
    stored = cast(dict[bytes, bytes], run.client.hgetall(key))
    seen = {k.decode(): float(v) for k, v in stored.items()}
    since = {job_id: seen.get(job_id, run.now) for job_id in job_ids}
    pipe = run.client.pipeline(transaction=True)
    pipe.delete(key)
    if since:
        pipe.hset(key, mapping=since)
        pipe.expire(key, keys.RECONCILE_SUSPECTS_TTL_S)
    pipe.execute()
    grace = run.settings.reconcile_grace_s
    return {job_id for job_id, first in since.items() if run.now - first >= grace}


# -- dead workers' direct queues -----------------------------------------------------


def _move_stranded(run: Pass, queues: set[str]) -> list[Action]:
    """Messages waiting in a dead worker's direct queue go to a queue a live worker of
    their lane consumes, in the order they would have been served."""
    actions: list[Action] = []
    for queue in sorted(queues):
        worker = stranded_worker(run.ns, queue, run.alive)
        if worker is None:
            continue
        moved = sum(_move_list(run, sub) for sub in keys.queue_sublists(queue))
        if moved:
            log.warning("reconcile: moved %d message(s) out of the direct queue of dead "
                        "worker %s", moved, worker)
            actions.append({"action": "moved_stranded", "worker": worker, "messages": moved})
    return actions


def _move_list(run: Pass, sub: str) -> int:
    """Moves one list's messages, newest first, each to the served-next end of its target:
    the oldest ends up served first. Each move is one transaction (WATCH on the list)."""
    moved = 0
    with run.app.pool.acquire(block=True) as conn:
        broker: Any = conn.default_channel.client
        while moved < MAX_MOVED and broker.transaction(
                lambda pipe: _move_one(run, pipe, sub), sub, value_from_callable=True):
            moved += 1
    return moved


def _move_one(run: Pass, pipe: redis.client.Pipeline, sub: str) -> bool:
    raw = cast(bytes | None, pipe.lindex(sub, 0))  # WATCHing: the command runs now
    message = _loads(raw) if raw else {}
    target = target_queue(run.settings, run.fleet, message) if message else None
    if target is None:  # empty, or no generate task of a known lane: left where it is
        return False
    pipe.multi()
    pipe.lpop(sub)
    push_served_next(pipe, rerouted(message, target), target)
    return True


# -- acting on one job ---------------------------------------------------------------


def _act(run: Pass, job: JobRecord) -> Action | None:
    """Sends the job again or ends it, holding its lease; None when an attempt took the
    job meanwhile or it ended."""
    lease = RedisLock(run.streams, keys.job_lease(run.ns, job.id),
                      keys.lease_ttl_s(run.settings.heartbeat_s), token=new_token("reconciler"))
    if not lease.acquire():
        return None
    try:
        action = _decide(run, job)
    finally:
        lease.release()
    if action is not None:
        run.client.hdel(keys.reconcile_suspects(run.ns), job.id)
        log.warning("reconcile: job %s (%s, no message, no lease): %s", job.id, job.status,
                    json.dumps(action))
    return action


def _decide(run: Pass, job: JobRecord) -> Action | None:
    if job.status == JobStatus.CANCELLED:
        return _end_cancelled(run, job)
    payload = run.store.jobs.job_payload(job.id)
    if payload is None:
        return _end_lost(run, job, "its message was lost, and no payload was kept to send "
                         "it again")
    if job.lane not in run.settings.lanes:
        return _end_lost(run, job, f"its message was lost, and its lane {job.lane} is gone")
    try:
        body = GeneratePayload.from_dict(payload)
    except (TypeError, KeyError):
        return _end_lost(run, job, "its message was lost, and its payload is unreadable")
    if body.deadline_at is not None and body.deadline_at <= run.now:
        return _end_expired(run, job)
    return _send_again(run, job, body)


def _send_again(run: Pass, job: JobRecord, body: GeneratePayload) -> Action:
    needs = {**capabilities.needs(body.sampling),
             **capabilities.output_needs(body.guided, body.tool_parse)}
    queue, why = _route(run, job, needs)
    send_generate(run.app, body, queue, redis_priority(job.priority))
    run.store.jobs.note_requeue(job.id, queue, f"sent again by the reconciler (no message, no "
                                f"lease): {why}")
    return {"action": "requeue", "job_id": job.id, "status": job.status, "queue": queue}


def _route(run: Pass, job: JobRecord, needs: dict[str, str]) -> tuple[str, str]:
    """The router's queue for the job now (among the workers able to run it: `needs`);
    with no worker to take it, the lane's pool queue, where it waits for the next one."""
    lane = run.settings.lanes[job.lane]
    views = [router.WorkerView.from_heartbeat(hb) for hb in run.fleet]
    backlog = queue_lengths(run.client, [pool_queue(lane, pool) for pool in lane.pools])
    session = (run.store.sessions.get_session(job.session_id, job.tenant_id)
               if job.session_id else None)
    sticky = session.last_worker if session and run.settings.session_affinity else None
    try:
        route = router.route(lane, views, backlog, lambda n: keys.direct_queue(run.ns, n),
                             lora=job.lora, session_worker=sticky, needs=needs)
        return route.queue, route.reason
    except router.NoRoute as exc:
        queue = live_queue(run.settings, run.fleet, job.lane) or pool_queue(lane, lane.pools[-1])
        return queue, f"{exc}; waits in {queue}"


def _end_expired(run: Pass, job: JobRecord) -> Action | None:
    if not run.store.runs.expire_job(job.id):
        return None
    _write_end(run, job.id, "error", {"code": "deadline_exceeded",
                                      "message": "the job's deadline passed"})
    return {"action": "expired", "job_id": job.id, "status": job.status}


def _end_lost(run: Pass, job: JobRecord, why: str) -> Action | None:
    if not run.store.runs.end_job(job.id, JobStatus.ERROR, error=why)[0]:
        return None
    _write_end(run, job.id, "error", {"code": "lost", "message": f"the job was lost: {why}"})
    return {"action": "lost", "job_id": job.id, "status": job.status}


def _end_cancelled(run: Pass, job: JobRecord) -> Action:
    """The end its dead worker did not write: the row's finish (with the tokens its
    stream holds), then the `done` event."""
    text, token_ids = _stream_tokens(run, job.id)
    run.store.runs.end_job(job.id, JobStatus.CANCELLED, finish_reason="cancelled",
                           output_text=text, completion_tokens=len(token_ids))
    _write_end(run, job.id, "done", {
        "finish_reason": "cancelled",
        "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": len(token_ids)}})
    return {"action": "ended_cancelled", "job_id": job.id, "status": job.status}


def _stream_tokens(run: Pass, job_id: str) -> tuple[str, list[int]]:
    """The text and token ids the job's stream holds."""
    entries: Any = run.streams.xrange(keys.job_events(run.ns, job_id))
    tokens = [e for _, fields in entries if (e := Event.from_json(fields[b"e"])).kind == "token"]
    return "".join(e.text for e in tokens), [i for e in tokens for i in e.token_ids]


def _write_end(run: Pass, job_id: str, kind: Kind, data: dict[str, object]) -> None:
    """The terminal event after the stream's last (unless it has one), its pub/sub copy,
    and the stream's TTL. The pass holds the job's lease: no attempt appends meanwhile."""
    key = keys.job_events(run.ns, job_id)
    last: Any = run.streams.xrevrange(key, count=1)
    tail = Event.from_json(last[0][1][b"e"]) if last else None
    # A cluster's pipeline refuses PUBLISH (no key): it goes on its own after.
    sharded = redisconn.is_cluster_client(run.streams)
    pipe = run.streams.pipeline(transaction=not sharded)
    event = None
    if tail is None or not tail.terminal:
        event = Event(job_id=job_id, seq=tail.seq + 1 if tail else 0, kind=kind, data=data)
        pipe.xadd(key, event.stream_fields(), id=keys.stream_id(event.seq),  # type: ignore[arg-type]
                  maxlen=run.settings.stream_maxlen, approximate=True)
        if not sharded:
            pipe.publish(keys.job_live(run.ns, job_id), event.to_json())
    pipe.expire(key, run.settings.stream_ttl_s)
    pipe.execute()
    if sharded and event is not None:  # a shard channel, as the workers' (workers/publisher.py)
        run.streams.spublish(keys.job_live(run.ns, job_id), event.to_json())


@functools.cache
def _streams_of(url: str, connect_s: float, socket_s: float) -> StreamsClient:
    return redisconn.sync_streams_client(url, **redisconn.timeouts(connect_s, socket_s))


def streams_client(settings: Settings) -> StreamsClient | None:
    """The token streams' Redis when it is not the main one (TIDEGATE_STREAMS_URL), one
    client per process; None otherwise."""
    if not settings.streams_url:
        return None
    return _streams_of(settings.streams_url, settings.redis_connect_timeout_s,
                       settings.redis_socket_timeout_s)
