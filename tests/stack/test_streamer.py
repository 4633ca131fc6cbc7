"""The worker's streamer (workers/streamer.py) on a redis-server of the test's own: many
jobs' token events written together, and every case off that path handed back to the
job's task thread with the deltas it did not publish, in order."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from tests.helpers import tool_or_skip
from tidegate import keys, redisconn
from tidegate.events import Event
from tidegate.locks import RELEASE
from tidegate_tools.procs import Proc, RedisClusterProcs, free_port, redis_cluster, start_redis
from workers import job_stream
from workers.engine import Delta
from workers.host import Cancelled
from workers.lease import Lease, LeaseLost
from workers.progress import Progress
from workers.publisher import EventPublisher, StreamState
from workers.streamer import CANCELLED, DELTA, END, FIRST, SLOW, Feed, Streamer

NS = "tgstreamer"
WAIT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_root: Path) -> Iterator[RedisClusterProcs]:
    tool_or_skip("redis-cli", "Debian's redis-tools: make ops-tools")
    with redis_cluster(tmp_root / "logs" / "streamer-cluster") as procs:
        yield procs


@pytest.fixture(params=["redis", "cluster"])
def client(request: pytest.FixtureRequest, tmp_root: Path) -> Iterator[Any]:
    """A redis-server of the test's own, or a three-master Redis Cluster's client (the
    streams on TIDEGATE_STREAMS_URL): its jobs' keys fall on every shard."""
    if request.param == "cluster":
        procs: RedisClusterProcs = request.getfixturevalue("cluster")
        sharded = redisconn.sync_streams_client(procs.url)
        try:
            yield sharded
        finally:
            sharded.flushall()
            sharded.close()
        return
    port = free_port()
    proc: Proc = start_redis(port, tmp_root / "logs")
    try:
        yield redis.Redis(port=port)
    finally:
        proc.stop()


@pytest.fixture()
def streamer(client: redis.Redis) -> Iterator[Streamer]:
    publisher = EventPublisher(client, NS, maxlen=10_000, ttl_s=60)
    publisher.load_append()
    s = Streamer(client, publisher, cancel_check_s=0.05)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def open_job(client: redis.Redis, streamer: Streamer, job_id: str) -> Feed:
    """A job whose `started` event is out (seq 0), as the task thread leaves it."""
    lease = Lease(client, keys.job_lease(NS, job_id), "worker-a", ttl_s=30,
                  stream=keys.job_events(NS, job_id))
    assert lease.take()
    started = Event(job_id=job_id, seq=0, kind="started")
    assert streamer.publisher.publish(started, lease)
    progress = Progress.of(lease, StreamState(1, "", (), False, (started,)))
    return streamer.open(job_id, progress, keys.job_cancel(NS, job_id))


def token(i: int, finished: bool = False) -> Delta:
    return Delta(text=f"t{i} ", token_ids=(i,), finished=finished,
                 finish_reason="length" if finished else None)


def messages(feed: Feed) -> Iterator[tuple[str, object]]:
    while True:
        kind, value = feed.inbox.get(timeout=WAIT_S)
        yield kind, value
        if kind in (END, CANCELLED):
            return


def stream_of(client: redis.Redis, job_id: str) -> list[Event]:
    entries: Any = client.xrange(keys.job_events(NS, job_id))
    return [Event.from_json(fields[b"e"]) for _, fields in entries]


def test_many_jobs_stream_every_token_in_order_and_hear_their_end(
        client: redis.Redis, streamer: Streamer) -> None:
    feeds = [open_job(client, streamer, f"job-{n}") for n in range(20)]

    def engine() -> None:  # one engine step puts a delta for every job, as a batch does
        for step in range(30):
            for feed in feeds:
                feed.put(token(step, finished=step == 29))
        for feed in feeds:
            feed.close(None)

    threading.Thread(target=engine).start()
    for feed in feeds:
        kinds = [kind for kind, _ in messages(feed)]
        # No FIRST when the first token came with the end: the end writes both at once.
        assert kinds in ([FIRST, END], [END])
        assert feed.progress.first_token_out is not None
        events = stream_of(client, feed.job_id)
        assert [e.seq for e in events] == list(range(len(events)))
        assert "".join(e.text for e in events) == "".join(f"t{i} " for i in range(30))
        assert feed.progress.token_ids == list(range(30))
        assert feed.progress.seq == len(events)
        assert feed.finish_reason == "length"
        streamer.detach(feed)


def test_a_lost_lease_hands_the_job_back_with_its_unpublished_tokens(
        client: redis.Redis, streamer: Streamer) -> None:
    feed = open_job(client, streamer, "job-lost")
    feed.put(token(0))
    assert [kind for kind, _ in _until(feed, FIRST)] == [FIRST]
    client.set(keys.job_lease(NS, "job-lost"), "another-attempt")
    feed.put(token(1))
    feed.put(token(2))
    feed.close(None)
    got = list(messages(feed))
    assert got[0][0] == SLOW
    assert {kind for kind, _ in got[1:-1]} <= {DELTA}  # what came after the hand-back
    handed = [*got[0][1], *(delta for _, delta in got[1:-1])]  # type: ignore[misc]
    assert "".join(d.text for d in handed) == "t1 t2 "
    assert got[-1] == (END, None)
    assert [e.seq for e in stream_of(client, "job-lost")] == [0, 1]


def test_an_event_appended_before_counts_as_out_and_the_others_still_go(
        client: redis.Redis, streamer: Streamer) -> None:
    """A seq already in its stream (an earlier write whose reply was lost) is refused by
    Redis; the batch takes it as out, and every other job's event is appended."""
    again, other = (open_job(client, streamer, job) for job in ("job-again", "job-other"))
    earlier = Event(job_id="job-again", seq=1, kind="token", text="t0 ", token_ids=[0])
    assert streamer.publisher.publish(earlier, again.progress.lease)
    again.put(token(0))
    other.put(token(0))
    for feed in (again, other):
        assert [kind for kind, _ in _until(feed, FIRST)] == [FIRST]
        feed.close(None)
        assert [kind for kind, _ in messages(feed)] == [END]
        assert [(e.seq, e.text) for e in stream_of(client, feed.job_id)][1:] == [(1, "t0 ")]
        assert feed.progress.seq == 2


def test_a_cancel_key_stops_the_job_and_publishes_nothing_more(
        client: redis.Redis, streamer: Streamer) -> None:
    feed = open_job(client, streamer, "job-cancel")
    feed.put(token(0))
    assert [kind for kind, _ in _until(feed, FIRST)] == [FIRST]
    client.set(keys.job_cancel(NS, "job-cancel"), 1)
    assert [kind for kind, _ in messages(feed)] == [CANCELLED]
    feed.put(token(1))
    feed.close(Cancelled("job-cancel"))
    streamer.detach(feed)
    assert [e.seq for e in stream_of(client, "job-cancel")] == [0, 1]


def test_a_redis_that_forgot_the_script_hands_back_then_the_next_batch_runs(
        client: redis.Redis, streamer: Streamer) -> None:
    client.script_flush()
    slow = open_job(client, streamer, "job-noscript")  # its started event loads it again
    client.script_flush()
    slow.put(token(0))
    assert list(_until(slow, SLOW))[-1][0] == SLOW
    fast = open_job(client, streamer, "job-after")
    fast.put(token(0))
    assert [kind for kind, _ in _until(fast, FIRST)] == [FIRST]
    fast.close(None)
    assert [kind for kind, _ in messages(fast)] == [END]


def _until(feed: Feed, kind: str) -> Iterator[tuple[str, object]]:
    while True:
        got = feed.inbox.get(timeout=WAIT_S)
        yield got
        if got[0] == kind:
            return


def test_a_started_event_left_to_the_streamer_goes_out_first_and_the_end_renews_the_lease(
        client: redis.Redis, streamer: Streamer) -> None:
    """The task thread leaves `started` in progress.head: the streamer's next batch sends
    it before the job's tokens, and the batch that ends the run renews the lease (the job's
    end then needs no renew of its own, workers/runner.py)."""
    lease = Lease(client, keys.job_lease(NS, "job-head"), "worker-a", ttl_s=30)
    assert lease.take()
    client.expire(keys.job_lease(NS, "job-head"), 5)
    progress = Progress.of(lease, StreamState(0, "", (), False, ()))
    progress.head = Event(job_id="job-head", seq=0, kind="started", data={"attempt": 1})
    feed = streamer.open("job-head", progress, keys.job_cancel(NS, "job-head"))
    feed.put(token(0))
    feed.put(token(1, finished=True))
    feed.close(None)
    assert [kind for kind, _ in messages(feed)][-1] == END
    streamer.detach(feed)
    events = stream_of(client, "job-head")
    assert [(e.seq, e.kind) for e in events][0] == (0, "started")
    assert [e.seq for e in events] == list(range(len(events)))
    assert "".join(e.text for e in events) == "t0 t1 "
    assert progress.head is None and progress.seq == len(events)
    assert progress.renewed_at is not None
    assert client.ttl(keys.job_lease(NS, "job-head")) > 5  # renewed to its 30 s


def test_a_started_event_the_streamer_could_not_send_stays_with_the_task_thread(
        client: redis.Redis, streamer: Streamer) -> None:
    """The lease another's before the first batch: nothing is appended, the job goes back
    to its task thread with `started` still in progress.head (its _emit sends it first)."""
    lease = Lease(client, keys.job_lease(NS, "job-headless"), "worker-a", ttl_s=30)
    assert lease.take()
    progress = Progress.of(lease, StreamState(0, "", (), False, ()))
    progress.head = Event(job_id="job-headless", seq=0, kind="started")
    client.set(keys.job_lease(NS, "job-headless"), "another-attempt")
    feed = streamer.open("job-headless", progress, keys.job_cancel(NS, "job-headless"))
    feed.put(token(0))
    feed.close(None)
    got = list(messages(feed))
    assert got[0][0] == SLOW and got[-1] == (END, None)
    assert progress.head is not None and progress.seq == 0
    assert stream_of(client, "job-headless") == []


def test_a_lapsed_lease_is_not_taken_back_once_another_attempt_ended_the_job(
        client: redis.Redis, streamer: Streamer) -> None:
    """A stalled attempt that wakes after another attempt ended the job (and released the
    lease) finds the lease free: it must not take it back and write after the end."""
    feed = open_job(client, streamer, "job-ended")
    feed.put(token(0))
    assert [kind for kind, _ in _until(feed, FIRST)] == [FIRST]
    other = Lease(client, keys.job_lease(NS, "job-ended"), "worker-b", ttl_s=30)
    client.delete(other.key)  # the stalled attempt's lease lapsed; the other took the job
    assert other.take()
    done = Event(job_id="job-ended", seq=2, kind="done", data={"finish_reason": "length"})
    assert streamer.publisher.publish_last(done, other)  # its end releases the lease
    assert not client.exists(other.key)
    assert not feed.progress.lease.renew()  # the stalled one's heartbeat: no take-back
    feed.put(token(1))
    feed.close(None)
    got = list(messages(feed))
    assert got[0][0] == SLOW and got[-1] == (END, None)  # handed back: LeaseLost there
    assert [e.kind for e in stream_of(client, "job-ended")] == ["started", "token", "done"]
    assert not client.exists(other.key)


def test_a_batch_whose_reply_was_lost_hands_back_its_event_whole_so_no_token_goes_twice(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis appended the batch, then its reply was lost (a timeout): the job goes back to
    its task thread with the tokens as that event carried them, which the task thread's
    publishing (workers/job_stream.py `on_delta`) appends at the same seq: refused as a
    duplicate. The stream holds every token once, as the job's progress counts them."""
    publisher = EventPublisher(client, NS, maxlen=10_000, ttl_s=60)
    publisher.load_append()
    s = Streamer(client, publisher, cancel_check_s=60)
    feed = open_job(client, s, "job-lost-reply")
    for i in range(3):  # before the streamer runs: one batch carries the three
        feed.put(token(i))
    lose_replies(client, monkeypatch, 1)
    s.start()
    try:
        got = list(_until(feed, SLOW))
        assert [kind for kind, _ in got] == [SLOW]
        assert [e.seq for e in stream_of(client, "job-lost-reply")] == [0, 1]  # it was out
        # The task thread's context: its store only takes the first token's time.
        store = SimpleNamespace(runs=SimpleNamespace(mark_first_token=lambda *_: True))
        task_thread = SimpleNamespace(retry=lambda f, *a: f(*a), publisher=publisher,
                                      hold=None, store=store)
        handed: list[Delta] = got[0][1]  # type: ignore[assignment]
        for delta in handed:
            job_stream.on_delta(task_thread, "job-lost-reply", feed.progress, delta)  # type: ignore[arg-type]
    finally:
        s.stop()
    events = stream_of(client, "job-lost-reply")
    assert [e.seq for e in events] == list(range(len(events)))
    assert [i for e in events for i in e.token_ids] == [0, 1, 2] == feed.progress.token_ids
    assert feed.progress.seq == len(events)


def lose_replies(client: Any, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """The client's next `count` pipelines run in Redis, then raise TimeoutError, as a
    reply lost on its way back does."""
    make = client.pipeline
    left = [count]

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make(*args, **kwargs)
        execute = pipe.execute

        def execute_then_lose(*eargs: Any, **ekwargs: Any) -> Any:
            replies = execute(*eargs, **ekwargs)
            if left[0] > 0:
                left[0] -= 1
                raise redis.TimeoutError("the reply was lost (injected)")
            return replies
        pipe.execute = execute_then_lose
        return pipe
    monkeypatch.setattr(client, "pipeline", pipeline)


def test_a_retried_last_event_whose_reply_was_lost_is_out_not_a_lost_lease(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt's last event releases its lease in the same round trip; Redis ran both and
    the reply was lost. The retry (the task thread's ctx.retry) finds no lease and the
    job's end in the stream: this very event, so it is out (a duplicate), not LeaseLost,
    which would leave the finished job's task unacked, to be delivered again."""
    publisher = EventPublisher(client, NS, maxlen=10_000, ttl_s=60)
    lease = Lease(client, keys.job_lease(NS, "job-last"), "worker-a", ttl_s=30,
                  stream=keys.job_events(NS, "job-last"))
    client.script_load(RELEASE)  # as on a worker that ended a job before: one round trip
    assert lease.take()
    assert publisher.publish(Event(job_id="job-last", seq=0, kind="started"), lease)
    done = Event(job_id="job-last", seq=1, kind="done", data={"finish_reason": "length"})
    lose_replies(client, monkeypatch, 1)
    with pytest.raises(redis.TimeoutError):
        publisher.publish_last(done, lease)
    assert publisher.publish_last(done, lease) is False  # already out
    assert [(e.seq, e.kind) for e in stream_of(client, "job-last")] == [(0, "started"),
                                                                        (1, "done")]
    assert not client.exists(keys.job_lease(NS, "job-last"))
    # Another attempt's event at that seq is no duplicate of this one: the lease is lost.
    other = Event(job_id="job-last", seq=1, kind="error", data={"code": "internal"})
    with pytest.raises(LeaseLost):
        publisher.publish_last(other, lease)
