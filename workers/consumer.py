"""The worker's Celery consumer: task events sent together, a loop that turns when a task
thread acks, and a BRPOP woken when a queue is added."""

from __future__ import annotations

import time

from celery.events.dispatcher import EventDispatcher
from celery.worker.consumer import Consumer
from kombu.asynchronous import Hub

from workers import broker

EVENTS_FLUSH_S = 0.1  # task events wait at most this long to go out together
EVENTS_BUFFER_LIMIT = 4096  # task events buffered before a flush that does not wait
LOST_FLUSH_S = 1.0  # a flush this late was lost: the next event schedules another


class EventBatchingConsumer(Consumer):
    """Celery's consumer, sending the task events it buffers (a task's received, started
    and succeeded: what Flower shows) together at most every EVENTS_FLUSH_S. Celery's
    own asks its event loop to flush after each buffered event: a wake of the loop and a
    broker publish per event, from a task thread, which cost 8% of a worker's CPU under
    load (bench/README.md, "third round"). Flower sees an event up to 0.1 s later."""

    _events_flush_at: float | None = None  # when the scheduled flush runs; None: none is
    _event_dispatcher: EventDispatcher | None = None

    @property
    def event_dispatcher(self) -> EventDispatcher | None:
        return self._event_dispatcher

    @event_dispatcher.setter
    def event_dispatcher(self, dispatcher: EventDispatcher | None) -> None:
        # Celery's dispatcher also publishes whenever 24 task events wait (buffer_limit):
        # under load that was a publish every 8 jobs, beside the timed flush. The timed
        # flush alone sends them, a publish per EVENTS_FLUSH_S (EVENTS_BUFFER_LIMIT only
        # bounds the buffer).
        if dispatcher is not None:
            dispatcher.buffer_limit = EVENTS_BUFFER_LIMIT
            dispatcher.serializer = broker.EVENT_SERIALIZER  # orjson (workers/broker.py)
            if dispatcher.producer is not None:
                dispatcher.producer.serializer = broker.EVENT_SERIALIZER
        self._event_dispatcher = dispatcher

    def __init__(self, *args: object, **kwargs: object) -> None:  # Celery's own arguments
        super().__init__(*args, **kwargs)
        global _consumer_hub
        _consumer_hub = self.hub

    def on_send_event_buffered(self) -> None:
        if self.hub is None:
            return
        now = time.monotonic()
        due = self._events_flush_at
        # A flush long overdue was lost with the loop's timers (the consumer restarted
        # after a broker outage): this event schedules a new one.
        if due is not None and now < due + LOST_FLUSH_S:
            return
        self._events_flush_at = now + EVENTS_FLUSH_S
        # Called from task threads: the loop's own thread schedules the flush (call_soon
        # is the hub's thread-safe entry, as in Celery's on_send_event_buffered).
        self.hub.call_soon(self._schedule_events_flush)

    def _schedule_events_flush(self) -> None:
        self.hub.call_later(EVENTS_FLUSH_S, self._flush_buffered_events)

    def _flush_buffered_events(self) -> None:
        self._events_flush_at = None
        self._flush_events()

    def shutdown(self) -> None:
        self._flush_events()  # what waits in the buffer goes out before the dispatcher closes
        super().shutdown()


_consumer_hub: Hub | None = None  # the consumer's event loop, once it has one


def turn_consumer_loop() -> None:
    """A turn of the consumer's loop, from any thread (call_soon is the hub's thread-safe
    entry and wakes its poll)."""
    hub = _consumer_hub
    if hub is not None:
        hub.call_soon(_noop)


def _noop() -> None:
    pass


def wake_consumer(consumer: Consumer) -> None:
    """kombu's Redis consumer waits in one BRPOP over the queues it had (up to its 1 s
    timeout) before it sends one that names the queue just added: a job published there
    meanwhile waits. CLIENT UNBLOCK ends that BRPOP now, as a timeout would, and kombu's
    next one names the new queue. Its connection is found by its address; behind a proxy
    that hides it, the BRPOP ends on its timeout as before."""
    channel = consumer.task_consumer.channel
    sock = getattr(getattr(channel, "_in_poll", None), "_sock", None)
    if sock is None:  # not waiting in a BRPOP now
        return
    host, port = sock.getsockname()[:2]
    with channel.conn_or_acquire() as client:
        for entry in client.client_list(_type="normal"):
            addr_host, _, addr_port = str(entry.get("addr", "")).rpartition(":")
            if addr_port == str(port) and addr_host.strip("[]") == host:
                client.client_unblock(int(entry["id"]))
                return
