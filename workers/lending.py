"""A lending worker pulls other lanes' waiting jobs onto its idle slots.

Work-conserving lanes have two halves. The router lends at submit time, from heartbeats
(tidegate/router.py, step 4): it can only place a job that arrives while a lender's slot
is idle. The jobs of a burst queued while every slot was busy would still wait for their
own lane's workers after a lender's slots went idle. So a worker whose lane lends
(`lend_to`) also looks every LEND_POLL_S while it is active: when it has slots idle,
nothing of its own waiting (its pool queue and its direct queue empty) and fewer borrowed
jobs than its cap, it moves the most urgent, oldest messages of a borrowing lane's pool
queue (the one of its own pool) onto its direct queue, one for each idle slot, in one
script; only once messages were seen waiting there at the look before (the borrowing
lane's own idle workers take theirs within milliseconds: those are not taken from them).
Its consumer takes them like any message, and the runner runs each as a borrowed job, at
the engine's lowest priority (workers/runner.py): the lane's own arrivals take the slot
back at once.

A moved message keeps its delivery info (its routing key names the borrower's queue): if
this worker dies with it, the recovery sweep hands it back to the borrower's queue.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import orjson
import redis

from tidegate import keys
from tidegate.lanes import lendable_slots, may_borrow, pool_queue
from tidegate.records import WorkerState
from tidegate.settings import Settings
from workers.context import WorkerContext

log = logging.getLogger("tidegate.worker")

LEND_POLL_S = 0.05  # how often an active lending worker looks for a job to take

# KEYS: the worker's own lists (ARGV[1] of them: its pool queue's and its direct queue's
# priority sub-lists), then pairs (a borrower's sub-list, the direct queue's sub-list of the
# same priority step), most urgent step first. kombu pushes on the left and pops on the
# right: the message taken is the oldest of its step, and it is put where it is popped next.
# ARGV[2]: how many to move at most (idle slots); 0 only says whether one waits. Returns
# {n, the n messages moved}, or {-1}: one waits (ARGV[2] 0); {0} as well when its own
# lists are not empty (the last moved messages not yet taken) or no borrower's one waits.
MOVE = """
local own = tonumber(ARGV[1])
local most = tonumber(ARGV[2])
for i = 1, own do
  if redis.call('LLEN', KEYS[i]) > 0 then return {0} end
end
local moved = {0}
for i = own + 1, #KEYS, 2 do
  while redis.call('LLEN', KEYS[i]) > 0 do
    if most == 0 then return {-1} end
    if moved[1] == most then return moved end
    local message = redis.call('RPOP', KEYS[i])
    redis.call('RPUSH', KEYS[i + 1], message)
    moved[1] = moved[1] + 1
    moved[#moved + 1] = message
  end
end
return moved
"""
WAITING = -1
INCOMING_S = 10.0  # a moved job not started after this is no longer counted as coming


class Worker(Protocol):
    """What the lender uses of its worker (workers/worker.py)."""

    settings: Settings
    lane: str
    pool: str
    pool_queue: str
    direct_queue: str
    redis: Any  # redis.Redis
    ctx: WorkerContext | None
    stopped: bool

    def state(self) -> WorkerState: ...

    def counts(self) -> tuple[int, dict[str, int]]: ...


def borrower_queues(worker: Worker) -> list[str]:
    """The pool queues (of this worker's pool) of the lanes its lane lends to, once each."""
    lanes, own = worker.settings.lanes, worker.settings.lanes[worker.lane]
    queues = [pool_queue(lanes[name], worker.pool) for name in own.lend_to
              if name in lanes and may_borrow(lanes[name], own)]
    return list(dict.fromkeys(queues))


def move_keys(own_queues: list[str], borrowers: list[str], direct: str) -> list[str]:
    """The script's KEYS (MOVE_ONE)."""
    own = [sub for queue in own_queues for sub in keys.queue_sublists(queue)]
    pairs = []
    for step, target in enumerate(keys.queue_sublists(direct)):
        for queue in borrowers:
            pairs += [keys.queue_sublists(queue)[step], target]
    return own + pairs


def task_id(message: bytes) -> str:
    """The job id of one of kombu's messages (its task id)."""
    try:
        return str(orjson.loads(message)["headers"]["id"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""


class Lender(threading.Thread):
    def __init__(self, worker: Worker, period_s: float = LEND_POLL_S) -> None:
        super().__init__(name="lender", daemon=True)
        self.worker, self.period_s = worker, period_s
        slots = worker.settings.engine_slots
        self.slots = slots
        self.cap = lendable_slots(worker.settings.lanes[worker.lane], slots)
        self.keys = move_keys([worker.pool_queue, worker.direct_queue],
                              borrower_queues(worker), worker.direct_queue)
        self.own = len(keys.queue_sublists(worker.pool_queue)) * 2
        self.moved = 0
        self.seen = False  # a borrower's message was waiting at the last look
        # Jobs moved onto the direct queue whose task has not started: their slots are
        # taken. (Between its consumer's pop and the task's start a job is in neither the
        # direct queue nor the worker's count; under load that gap outlasts a poll.)
        self._incoming: dict[str, float] = {}
        self._lock = threading.Lock()
        self._script = worker.redis.register_script(MOVE)

    def started(self, job_id: str) -> None:
        """A task began (workers/worker.py): its job, if moved here, is no longer coming."""
        with self._lock:
            self._incoming.pop(job_id, None)

    def _expect(self, messages: list[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            for message in messages:
                self._incoming[task_id(message) or f"unknown-{now}-{id(message)}"] = now

    def _coming(self) -> int:
        cutoff = time.monotonic() - INCOMING_S
        with self._lock:
            for job_id in [j for j, t in self._incoming.items() if t < cutoff]:
                del self._incoming[job_id]
            return len(self._incoming)

    def run(self) -> None:
        while not self.worker.stopped:
            time.sleep(self.period_s)
            try:
                self.tick()
            except redis.RedisError as exc:
                log.warning("lending: %s", type(exc).__name__)
                time.sleep(1)  # Redis is away: the consumer and the heartbeat say so too
            except Exception:  # a bug in one look must not end the lending
                log.exception("lending failed")

    def tick(self) -> int:
        """Takes borrowers' messages for the slots idle now; how many it took."""
        w, ctx = self.worker, self.worker.ctx
        if ctx is None or w.state() != WorkerState.ACTIVE:
            return 0
        in_flight, _ = w.counts()
        coming = self._coming()
        room = min(self.slots - in_flight, self.cap - ctx.borrowed) - coming
        if room <= 0:
            self.seen = False
            return 0
        reply = self._script(keys=self.keys, args=[self.own, room if self.seen else 0])
        found, messages = int(reply[0]), reply[1:]
        self.seen = found != 0
        if found <= 0:
            return 0
        self._expect(messages)
        self.moved += found
        log.debug("lending: took %d waiting jobs of other lanes (%d so far)", found, self.moved)
        return found
