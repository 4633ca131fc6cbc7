"""Token events of every job a worker runs, written by one thread: an engine step's
events for all the jobs in the batch go to Redis in one round trip.

Before this, each job's task thread woke at every engine step and wrote its event in a
round trip of its own: at GPU speed, a wake-up and a round trip per token per job, the
worker's largest cost per token (bench/README.md). Now the engine host hands each delta
to the job's feed here (on the engine's loop thread: an append under a lock), and the
streamer's thread takes what every feed holds, and sends it in one call of the
publisher's lease-checked append script for many events (workers/publisher.py
APPEND_MANY: a Redis command per event was twice the client CPU of one for them all).
A job's task thread wakes at its first token, to write it to the store, and at its end.

Whatever is off that path goes back to the job's task thread, which then publishes the
rest of its events one at a time as before (workers/job_stream.py), with its retries, its
write-back of a stream Redis lost, and its LeaseLost: an append the lease refused, a
stream gone, a Redis error, a script Redis forgot. The streamer never retries and never
ends a job.

The streamer also looks for cancels: every CANCEL_CHECK_S, one EXISTS over the cancel
keys of all its jobs (a cancel's pub/sub broadcast is at most once: workers/job_stream.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis

from tidegate import keys, redisconn
from tidegate.events import Event
from tidegate.redisconn import StreamsClient
from workers.engine import Delta
from workers.host import merge, name_os_thread
from workers.progress import Progress
from workers.publisher import EventPublisher, is_duplicate

log = logging.getLogger("tidegate.worker")

T = TypeVar("T")
THREAD = "tidegate-writer"
CANCEL_CHECK_S = 0.25

# What a feed tells its task thread, in order: (kind, value).
FIRST = "first"  # value: the first token's time (datetime); the event is out
DELTA = "delta"  # value: a Delta the task thread publishes itself (after SLOW)
SLOW = "slow"  # value: deltas not published; from here the task thread publishes
END = "end"  # value: None, or the exception that ended the run; every event is out
CANCELLED = "cancelled"  # the job's cancel key is set; the engine request was aborted


@dataclass(eq=False)
class Feed:
    """One job's run through the streamer. The engine's loop thread calls put and close;
    the streamer's thread publishes; the task thread reads `inbox`."""

    streamer: Streamer
    job_id: str
    progress: Progress
    cancel_key: str
    inbox: queue.SimpleQueue[tuple[str, Any]] = field(default_factory=queue.SimpleQueue)
    pending: list[Delta] = field(default_factory=list)
    # The job's `started` event, until it is out: the streamer sends it in its next batch,
    # with the other jobs' events (progress.head holds it until then).
    head: Event | None = None
    end: BaseException | None = None
    ended: bool = False  # close() came; `end` holds its exception, if any
    fast: bool = True  # the streamer publishes; False: the task thread does
    writing: bool = False  # the streamer is publishing a batch of this feed now
    finish_reason: str = "length"

    def put(self, delta: Delta) -> None:
        self.streamer._put(self, delta)

    def close(self, end: BaseException | None) -> None:
        self.streamer._close(self, end)


@dataclass
class _Take:
    """What the streamer took of one feed for one round trip."""

    feed: Feed
    deltas: list[Delta]
    ended: bool
    end: BaseException | None
    delta: Delta | None = None  # the deltas merged
    event: Event | None = None  # the token event they make, if any
    head: Event | None = None  # the job's `started` event, sent before `event`
    first: bool = False  # it carries the job's first token
    renewed: bool = False  # the lease was renewed with it (the run's last batch)
    renewed_at: float = 0.0
    settled: bool = False  # its answer is applied

    def sent(self) -> list[Delta]:
        """The deltas as their event carried them: merged into one. An append whose reply
        was lost (a timeout, a reset) may be in the stream: the task thread then publishes
        this same event at the same seq, which Redis refuses as a duplicate. Handed back one
        by one, the first would take that seq and the others new ones: their tokens twice."""
        return [self.delta] if self.delta is not None else self.deltas


def by_tag(items: list[T], key_of: Callable[[T], str]) -> list[list[T]]:
    """`items` in groups of one job tag each (tidegate/keys.py), in their order within each."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(keys.tag_of(key_of(item)), []).append(item)
    return list(groups.values())


class Streamer:
    def __init__(self, client: StreamsClient, publisher: EventPublisher,
                 cancel_check_s: float = CANCEL_CHECK_S) -> None:
        self.r = client
        self._sharded = redisconn.is_cluster_client(client)
        self.publisher = publisher
        self.cancel_check_s = cancel_check_s
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # a batch is out
        self._wake = threading.Event()
        self._feeds: dict[str, Feed] = {}  # the jobs it publishes for
        self._dirty: dict[int, Feed] = {}  # feeds with something new, by id()
        self._next_cancel_check = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=THREAD, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    # -- the task thread -------------------------------------------------------------

    def open(self, job_id: str, progress: Progress, cancel_key: str) -> Feed:
        """The job's feed. A `started` event the task thread left in `progress.head` goes
        out in the streamer's next batch (else the task thread publishes it before any
        event of its own, workers/job_stream.py `emit`)."""
        feed = Feed(self, job_id, progress, cancel_key, head=progress.head)
        with self._lock:
            self._feeds[job_id] = feed
            if feed.head is not None:
                self._dirty[id(feed)] = feed
        if feed.head is not None:
            self._wake.set()
        return feed

    def detach(self, feed: Feed) -> None:
        """The task thread is done with the feed (its end, or an exception on its way):
        the streamer publishes nothing more for it, and none of its writes is left in
        flight when this returns (the attempt may release its lease next)."""
        with self._lock:
            self._give_back(feed)
            while feed.writing:
                self._written.wait()

    # -- the engine's loop thread ----------------------------------------------------

    def _put(self, feed: Feed, delta: Delta) -> None:
        with self._lock:
            if feed.fast:
                feed.pending.append(delta)
                self._dirty[id(feed)] = feed
            else:
                feed.inbox.put((DELTA, delta))
                return
        self._wake.set()

    def _close(self, feed: Feed, end: BaseException | None) -> None:
        with self._lock:
            if feed.fast:
                feed.ended, feed.end = True, end
                self._dirty[id(feed)] = feed
            else:
                feed.inbox.put((END, end))
                return
        self._wake.set()

    # -- the streamer's thread -------------------------------------------------------

    def _run(self) -> None:
        name_os_thread(THREAD)
        while not self._stopped:
            self._wake.wait(self.cancel_check_s)
            self._wake.clear()
            takes = self._take()
            try:
                self._write(takes)
            except Exception:  # a bug must not stop every job's events: hand them back
                log.exception("the event streamer failed; its jobs publish on their own")
                with self._lock:
                    for take in takes:
                        if not take.settled:
                            self._hand_back(take.feed, take.sent(), take.ended, take.end)
            finally:
                with self._lock:
                    for take in takes:
                        take.feed.writing = False
                    self._written.notify_all()

    def _write(self, takes: list[_Take]) -> None:
        watched = self._cancel_watch_due()
        if not takes and not watched:
            return
        try:
            answers, cancelled = self._send(takes, watched)
        except redis.RedisError as exc:
            log.warning("event batch failed (%s); its jobs publish on their own",
                        type(exc).__name__)
            answers, cancelled = [[exc, exc] for _ in takes], []
        with self._lock:
            for take, answer in zip(takes, answers, strict=True):
                self._settle(take, answer)
                take.settled = True
            for feed in cancelled:
                self._cancel(feed)

    def _take(self) -> list[_Take]:
        with self._lock:
            dirty, self._dirty = list(self._dirty.values()), {}
            takes = []
            for feed in dirty:
                if not feed.fast:
                    continue
                takes.append(_Take(feed, feed.pending, feed.ended, feed.end, head=feed.head))
                feed.pending, feed.writing, feed.head = [], True, None
                feed.ended, feed.end = False, None
        for take in takes:
            self._event_of(take)
        return takes

    def _event_of(self, take: _Take) -> None:
        if not take.deltas:
            return
        delta = take.delta = merge(take.deltas)
        if delta.empty:
            return
        progress = take.feed.progress
        take.first = not progress.token_ids
        take.event = Event(job_id=take.feed.job_id, seq=progress.seq + (take.head is not None),
                           kind="token",
                           text=delta.text, token_ids=list(delta.token_ids),
                           data=delta.event_data())

    def _cancel_watch_due(self) -> list[Feed]:
        now = time.monotonic()
        if now < self._next_cancel_check:
            return []
        self._next_cancel_check = now + self.cancel_check_s
        with self._lock:
            return [feed for feed in self._feeds.values() if feed.fast]

    def _send(self, takes: list[_Take], watched: list[Feed]
              ) -> tuple[list[list[object]], list[Feed]]:
        """One round trip: every take's appends in one script call, and one EXISTS over the
        cancel keys watched; (the answers of each take's events, head first; the feeds
        whose job was cancelled)."""
        pipe = self.r.pipeline(transaction=False)
        calls = [(event, take.feed.progress.lease) for take in takes
                 for event in (take.head, take.event) if event is not None]
        # A cluster takes a script's keys, and EXISTS's, from one slot: a call per tag.
        call_groups = by_tag(calls, lambda call: call[1].key) if self._sharded else [calls]
        for group in call_groups if calls else ():
            script_keys, args = self.publisher.append_many_call(group)
            pipe.execute_command("EVALSHA", self.publisher.append_many_sha, len(script_keys),
                                 *script_keys, *args)
        watch_groups = (by_tag(watched, lambda feed: feed.cancel_key) if self._sharded
                        else [watched])
        for feeds in watch_groups if watched else ():
            pipe.exists(*[feed.cancel_key for feed in feeds])
        # A job's run ends with this batch: its lease renewed in the same round trip, so
        # the job's end (workers/endings.py `_finish`) need not renew it in one of its own.
        ending = [take for take in takes if take.ended and take.end is None]
        for take in ending:
            take.feed.progress.lease.renew_in(pipe)
        replies = iter(pipe.execute(raise_on_error=False)) if len(pipe) else iter(())
        by_call = {id(call): answer for group in call_groups if calls
                   for call, answer in zip(group, self.publisher.many_answers(
                       next(replies), len(group)), strict=True)}
        appended = iter(by_call[id(call)] for call in calls)
        answers = [[next(appended) for event in (take.head, take.event) if event is not None]
                   for take in takes]
        cancelled: list[Feed] = []
        counts = [next(replies) for _ in watch_groups] if watched else []
        if any(isinstance(count, int) and count > 0 for count in counts):  # rare: find which
            cancelled = [feed for feed in watched if self.r.exists(feed.cancel_key)]
        renewed_at = time.monotonic()
        for take in ending:
            renewed = next(replies)
            take.renewed, take.renewed_at = renewed == 1, renewed_at
            if isinstance(renewed, redis.exceptions.NoScriptError):  # for the next batch
                self.publisher.load_append()
        return answers, cancelled

    def _settle(self, take: _Take, answers: list[object]) -> None:
        """Under the lock: the answers of the take's events applied to its job."""
        feed = take.feed
        if take.head is not None and self._appended(answers[0]):
            # Out, whatever comes of the rest: from here the job's next event follows it.
            feed.progress.appended(take.head)
            feed.progress.head = None
        if not feed.fast:  # given back meanwhile (detached, or cancelled)
            return
        if feed.progress.head is not None or (
                take.event is not None and not self._appended(answers[-1])):
            self._hand_back(feed, take.sent(), take.ended, take.end)
            return
        if take.delta is not None:
            self._advance(take)
        if take.ended:
            if take.renewed:
                feed.progress.renewed_at = take.renewed_at
            feed.fast = False
            self._feeds.pop(feed.job_id, None)
            feed.inbox.put((END, take.end))

    def _appended(self, answer: object) -> bool:
        if answer == 1:
            return True
        if isinstance(answer, redis.exceptions.NoScriptError):
            self.publisher.load_append()  # for the next batch; this one's job goes slow
        return isinstance(answer, BaseException) and is_duplicate(answer)

    def _advance(self, take: _Take) -> None:
        """The job's progress after its event is out, as the task thread's own publishing
        keeps it (workers/job_stream.py `on_delta`)."""
        feed, delta = take.feed, take.delta
        assert delta is not None
        progress = feed.progress
        if delta.cached_tokens is not None:
            progress.cached_tokens = delta.cached_tokens
        if delta.finish_reason:
            feed.finish_reason = delta.finish_reason
        if take.event is None:
            return
        progress.add_tokens(delta.text, delta.token_ids, delta.other_tokens)
        progress.appended(take.event)
        if take.first:
            progress.first_token_out = datetime.now(UTC)
            if not take.ended:  # else the job's end writes it, in the same statement
                feed.inbox.put((FIRST, progress.first_token_out))

    def _hand_back(self, feed: Feed, deltas: list[Delta], ended: bool = False,
                   end: BaseException | None = None) -> None:
        """Under the lock: the task thread publishes the feed's events from here on."""
        if not feed.fast:
            return
        feed.fast = False
        self._feeds.pop(feed.job_id, None)
        feed.inbox.put((SLOW, [*deltas, *feed.pending]))
        feed.pending = []
        if ended or feed.ended:
            feed.inbox.put((END, end if ended else feed.end))
            feed.ended, feed.end = False, None

    def _give_back(self, feed: Feed) -> None:
        """Under the lock: the streamer forgets the feed; nothing is told to the task
        thread, which has stopped reading."""
        feed.fast = False
        self._feeds.pop(feed.job_id, None)
        feed.pending = []

    def _cancel(self, feed: Feed) -> None:
        if not feed.fast:
            return
        self._give_back(feed)
        feed.inbox.put((CANCELLED, None))
