"""Celery's broker work per task message, made cheaper in the worker (a measured
hot path, bench/README.md "where the time goes": the Celery consumer's Redis calls were
most of a worker's CPU per job).

kombu's Redis transport keeps each delivered message in an `unacked` hash and its index
(what tasks/recovery.py hands back when a worker dies). Stock, each delivery writes them in
a MULTI/EXEC transaction, with the message encoded by the standard `json`, and each ack
removes them in another transaction, from the task's thread: two transactions per job.

Here a delivery writes the same two entries in one write on a connection of the QoS's
own, both replies read before the task runs (the pair needs no transaction: a reader
finding the index entry without the hash entry skips it, as kombu's own restore does),
encoded by orjson (the same JSON). Acks are removed in batches: a task
thread's ack hands its delivery tag to one thread, which removes every tag waiting in one
round trip (ZREM and HDEL take many members). An ack not yet removed when the process dies
leaves the message to the recovery sweep, which hands it back; its job is then terminal
and the new delivery does nothing (workers/runner.py): at most a wasted delivery, never a
lost or doubled job.

kombu's JSON (task messages read; task events, their envelopes and the unacked entries
written) is the standard `json` module's: here orjson's where it reads and writes the same
values. Reading, anything else (kombu's typed values, `__type__`; NaN; a huge number) goes
to kombu's own. Writing, orjson is used only for what holds no UUID or NaN (which it would
write otherwise): a received message's entry, an envelope (strings and numbers of kombu's
own), Celery's task events (EVENT_SERIALIZER); control replies keep kombu's.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Any, NoReturn

import orjson
import redis
from kombu import serialization
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils import json as kombu_json

log = logging.getLogger("tidegate.worker")

THREAD = "tidegate-acks"
RETRY_S = 0.5  # after a failed removal, the next try waits this long
# Tries of one batch before it is dropped (its messages' entries are then the recovery
# sweep's, which finds their jobs terminal): a channel gone for good is not tried forever.
MAX_TRIES = 20
STOP_WAIT_S = 2.0


# orjson hands these to `default`, which refuses them: kombu's encoder then writes them
# as it always did (a datetime as its typed value, a str subclass as a str).
_OPTIONS = (orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
            | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS)


_LONG_NUMBER = re.compile(rb"\d{19}")


def _refuse(value: object) -> NoReturn:
    raise TypeError(type(value).__name__)


def fast_dumps(value: object, **kwargs: object) -> str:
    """kombu.utils.json.dumps, by orjson where that writes the same JSON."""
    if not kwargs:
        try:
            return orjson.dumps(value, default=_refuse, option=_OPTIONS).decode()
        except TypeError:
            pass
    return str(kombu_json.dumps(value, **kwargs))


def fast_loads(raw: str | bytes | bytearray | memoryview, decode_bytes: bool = True,
               **kwargs: object) -> object:
    """kombu.utils.json.loads, by orjson where that reads the same values (JSON's: the
    caller knows their shape)."""
    if isinstance(raw, memoryview | bytearray):
        raw = bytes(raw)
    if isinstance(raw, str):
        raw = raw.encode()
    # kombu's typed values; and 19 digits in a row, which may be an integer past 64 bits,
    # which orjson reads as a float: both read by kombu's own.
    if not kwargs and b"__type__" not in raw and not _LONG_NUMBER.search(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:  # NaN, a huge integer: what only `json` reads
            pass
    return kombu_json.loads(raw, decode_bytes=decode_bytes, **kwargs)


def _dumps(entry: list[object]) -> str:
    return fast_dumps(entry)


EVENT_SERIALIZER = "tidegate-json"  # Celery's task events, by fast_dumps (still JSON)


class BatchedAckQoS(kombu_redis.QoS):
    """kombu's Redis QoS with the cheaper delivery record and batched acks (above)."""

    def append(self, message: virtual.Message, delivery_tag: str) -> None:
        delivery = message.delivery_info
        entry = _dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        commands = [("ZADD", self.unacked_index_key, time.time(), delivery_tag),
                    ("HSET", self.unacked_key, delivery_tag, entry)]
        with self._tg_lock:
            try:
                self._send(commands)
            except (OSError, redis.ConnectionError, redis.TimeoutError):
                self._drop()  # a fresh connection next time; this once, the pool's
                pipe = self.channel._create_client().pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                pipe.execute()
        virtual.QoS.append(self, message, delivery_tag)

    # The delivery record goes out on a connection of this QoS's own, both commands in one
    # write, both replies read before the message is handed on (a record in Redis before
    # the task runs, as kombu's): a pool's checkout, release and health check and a
    # pipeline object per delivery were half of the record's cost (a measured hot path).
    _tg_lock = threading.Lock()
    _tg_conn: redis.connection.AbstractConnection | None = None
    _tg_pool: redis.ConnectionPool | None = None

    def _send(self, commands: list[tuple[Any, ...]]) -> None:
        pool = self.channel.pool
        if self._tg_conn is None or self._tg_pool is not pool:  # the channel reconnected
            self._drop()
            self._tg_conn = pool.connection_class(**pool.connection_kwargs)
            self._tg_pool = pool
        conn = self._tg_conn
        conn.send_packed_command(conn.pack_commands(commands))
        try:
            for _ in commands:
                conn.read_response()
        except redis.ResponseError:  # a reply may be left unread: the connection goes
            self._drop()
            raise

    def _drop(self) -> None:
        if self._tg_conn is not None:
            with contextlib.suppress(Exception):
                self._tg_conn.disconnect()
        self._tg_conn = self._tg_pool = None

    def ack(self, delivery_tag: str) -> None:
        ACKS.add(self, delivery_tag)
        virtual.QoS.ack(self, delivery_tag)


class Acker:
    """The thread that removes acked messages' entries, many per round trip."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[BatchedAckQoS, list[str]]] = {}  # id(qos) -> (qos, tags)
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)  # nothing pending, nothing in flight
        self._busy = False
        self._failures = 0  # consecutive failed batches
        self._thread: threading.Thread | None = None

    def add(self, qos: BatchedAckQoS, tag: str) -> None:
        with self._lock:
            self._pending.setdefault(id(qos), (qos, []))[1].append(tag)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD, daemon=True)
                self._thread.start()
        self._wake.set()

    def flush(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """Waits until every ack so far is removed (a clean stop); False on timeout."""
        self._wake.set()
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending and not self._busy,
                                       timeout=timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                batch, self._pending = self._pending, {}
                self._busy = bool(batch)
            failed = [(qos, tags) for qos, tags in batch.values() if not _remove(qos, tags)]
            self._failures = self._failures + 1 if failed else 0
            if self._failures >= MAX_TRIES:
                log.warning("dropping %d acks after %d tries; the recovery sweep has them",
                            sum(len(tags) for _, tags in failed), MAX_TRIES)
                failed, self._failures = [], 0
            with self._lock:
                for qos, tags in failed:  # back in front of what came meanwhile
                    self._pending.setdefault(id(qos), (qos, []))[1][:0] = tags
                self._busy = False
                self._idle.notify_all()
            if failed:
                time.sleep(RETRY_S)
                self._wake.set()


def _remove(qos: BatchedAckQoS, tags: list[str]) -> bool:
    try:
        with qos.channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            pipe.zrem(qos.unacked_index_key, *tags)
            pipe.hdel(qos.unacked_key, *tags)
            pipe.execute()
        return True
    except Exception as exc:  # Redis away: kept, and tried again
        log.warning("removing %d acked messages failed (%s); trying again", len(tags),
                    type(exc).__name__)
        return False


ACKS = Acker()


def install() -> None:
    """In this worker process: every Redis channel opened from now on uses BatchedAckQoS,
    and kombu's JSON is orjson's where that is the same."""
    kombu_redis.Channel.QoS = BatchedAckQoS
    setattr(kombu_redis, "dumps", fast_dumps)  # noqa: B010 (names the module reads)
    setattr(kombu_redis, "loads", fast_loads)  # noqa: B010
    # Registered under its own name, for the event dispatcher alone (consumer.py); its
    # content type is JSON's, whose decoder is then fast_loads for every message read.
    serialization.register(EVENT_SERIALIZER, fast_dumps, fast_loads,
                           content_type="application/json", content_encoding="utf-8")
