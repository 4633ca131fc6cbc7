"""The Celery app shared by the API, workers, beat and Flower.

Broker options must be identical in every process that talks to the broker: they are
built here from the settings and nowhere else. One app per process: `celery_app()` for
a process that runs on the environment's settings (a worker, Flower), `make_app` where a
process holds its own settings object (the API and the scheduler take theirs at start).
"""

from __future__ import annotations

import base64
import functools
import os
import uuid
from bisect import bisect
from typing import Any

import redis
from celery import Celery, signals
from celery.utils.nodenames import anon_nodename
from kombu import Exchange, Queue
from kombu.utils.json import dumps as kombu_dumps
from redis.client import Pipeline

from tasks import broker  # noqa: F401 - registers the fixed Redis transports with kombu
from tasks.payloads import GENERATE, GeneratePayload
from tidegate import keys, redisconn
from tidegate.lanes import Lane, pool_queue
from tidegate.settings import Settings, get_settings


def visibility_timeout_s(lanes: dict[str, Lane]) -> int:
    """Longer than queue wait plus the longest generation, or Redis redelivers a job
    that is still running. A lane's deadline bounds both."""
    return int(2 * max(lane.deadline_s for lane in lanes.values())) + 300


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def _first_lane_pool(lanes: dict[str, Lane]) -> tuple[Lane, str]:
    lane = next(iter(lanes.values()))
    return lane, lane.pools[-1]


def make_app(settings: Settings) -> Celery:
    # A Sentinel URL becomes kombu's sentinel:// broker plus the master's name.
    # Kombu's connections get the Redis timeouts (its BRPOP blocks 1 s, within them).
    broker_url, broker_options = redisconn.celery_broker(settings.redis_url,
                                                         settings.redis_timeouts)
    app = Celery("tidegate", broker=broker_url, set_as_current=False)
    lanes = settings.lanes
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,  # job state lives in the store and the event stream
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # prefetch breaks priority order
        task_default_priority=5,  # unset would mean 0, the top (Redis step, not public)
        task_queue_max_priority=9,
        task_default_queue=pool_queue(*_first_lane_pool(lanes)),
        task_queues=[_queue(pool_queue(lane, pool)) for lane in lanes.values()
                     for pool in lane.pools],
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "priority_steps": list(keys.PRIORITY_STEPS),
            "sep": keys.PRIORITY_SEP,
            "queue_order_strategy": "priority",
            "visibility_timeout": visibility_timeout_s(lanes),
            **broker_options,
        },
        # No result backend today (task_ignore_result): should one be set, its Redis calls
        # are bounded as the broker's are.
        redis_socket_connect_timeout=settings.redis_connect_timeout_s,
        redis_socket_timeout=settings.redis_socket_timeout_s,
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # Flower shows tasks
        # No `task-sent` events: one more broker publish on every submit, measured as a
        # large share of the API's submit time; Flower still sees received/started/done.
        task_send_sent_event=False,
        broker_pool_limit=64,  # API handler threads publish at once
    )
    return app


@functools.lru_cache(maxsize=1)
def celery_app() -> Celery:
    """This process's app, on the environment's settings."""
    return make_app(get_settings())


def run_celery(app: Celery, argv: list[str]) -> None:
    """`celery <argv>` (a worker, with or without its beat, or Flower) in the log format
    the process set up before (tidegate/logs.py `setup_logging`): a receiver of Celery's
    `setup_logging` signal keeps Celery from configuring logging itself (its plain format
    on the root and task loggers); `-q` drops the startup banner it prints past every
    logger; the warm-shutdown notice it prints on SIGTERM is turned off once it is ready."""
    signals.setup_logging.connect(_logging_is_set_up, weak=False)
    signals.worker_ready.connect(_quiet_shutdown, weak=False)
    app.start(["-q", *argv])


def _logging_is_set_up(**_: object) -> None:
    """Celery's setup_logging signal: nothing to do, tidegate.logs did it."""


def _quiet_shutdown(sender: object = None, **_: object) -> None:
    from celery.apps.worker import install_worker_term_handler

    worker = getattr(sender, "controller", None)  # the consumer's WorkController
    if worker is not None:
        install_worker_term_handler(worker, verbose=False)


def queue_lengths(client: redis.Redis, queues: list[str]) -> dict[str, int]:
    """Messages waiting per queue, summed over its ten priority sub-lists."""
    return {q: sum(steps) for q, steps in queue_lengths_by_step(client, queues).items()}


def queue_lengths_by_step(client: redis.Redis, queues: list[str]) -> dict[str, list[int]]:
    """Messages waiting per queue and Redis priority step (index 0 is served first), in one
    pipeline."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        for sublist in keys.queue_sublists(queue):
            pipe.llen(sublist)
    counts = [int(n) for n in pipe.execute()]
    n = len(keys.PRIORITY_STEPS)
    return {q: counts[i * n:(i + 1) * n] for i, q in enumerate(queues)}


def send_generate(app: Celery, payload: GeneratePayload, queue: str, priority: int) -> None:
    """Publish one job; the Celery task id is the job id, so a redelivery is the same job."""
    app.send_task(
        GENERATE,
        args=[payload.to_dict()],
        task_id=payload.job_id,
        queue=queue,
        priority=priority,
        # Celery copies `argsrepr`/`kwargsrepr` (else the first 1 KB of the arguments: the
        # prompt) into every task event, which Flower and any event consumer show.
        argsrepr=task_repr(payload),
        kwargsrepr="{}",
    )
    # No Celery `expires`: an expired message would be dropped without a trace and its
    # job row would stay `queued` forever. The worker ends late jobs `expired` instead.


# -- the same message, written straight to Redis -------------------------------------
#
# send_task costs the API about a sixth of a submit's CPU (Celery's routing, kombu's
# producer, its retry wrapper), and takes a Redis round trip of its own. The message it
# publishes here is fixed: task protocol 2, JSON, to a direct queue, which kombu sends on
# its anonymous exchange, straight onto the queue's list for the priority (no binding
# lookup). `generate_message` builds that message, and `push_generate` adds its LPUSH to a
# pipeline, so the API sends it in the round trip that counts the submit's traffic.
# tests/unit/test_direct_publish.py holds it equal to what send_task publishes.

NO_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@functools.lru_cache(maxsize=8)
def writes_to(app: Celery, redis_url: str) -> bool:
    """Whether `app` publishes to the Redis that `redisconn.sync_client(redis_url)` reaches:
    make_app builds its broker from that URL (redisconn.celery_broker), unless Celery's
    CELERY_BROKER_URL / CELERY_BROKER_WRITE_URL override it, or a key prefix renames the
    queues. Where it does not, the API publishes through send_task."""
    options = app.conf.broker_transport_options or {}
    return (app.conf.broker_write_url == redisconn.celery_broker(redis_url)[0]
            and not options.get("global_keyprefix") and "body_encoding" not in options)


def push_generate(pipe: Pipeline, app: Celery, payload: GeneratePayload, queue: str,
                  priority: int) -> None:
    """Adds to a redis-py pipeline on the broker's Redis (see `writes_to`) the LPUSH that
    send_generate's publish is."""
    sublist, message = generate_message(app, payload, queue, priority)
    pipe.lpush(sublist, message)


def generate_message(app: Celery, payload: GeneratePayload, queue: str,
                     priority: int) -> tuple[str, str]:
    """The list kombu's Redis transport pushes send_generate's message onto, and the message
    as it pushes it (kombu/transport/virtual/base.py `basic_publish`, redis.py `_put`), with
    the headers and properties Celery's send_task gives it (celery/app/amqp.py
    `as_task_v2`, `send_task_message`)."""
    job_id, argsrepr = payload.job_id, task_repr(payload)
    body = kombu_dumps([[payload.to_dict()], {}, NO_EMBED])
    headers: dict[str, Any] = {
        "lang": "py", "task": GENERATE, "id": job_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": job_id, "parent_id": None,
        "argsrepr": argsrepr, "kwargsrepr": "{}", "origin": _origin(os.getpid()),
        "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None,
        "stamps": {},
    }
    properties = {
        "correlation_id": job_id, "reply_to": app.thread_oid,
        # send_task hands its options on as message properties, these two among them.
        "argsrepr": argsrepr, "kwargsrepr": "{}",
        "priority": priority, "delivery_mode": 2,  # persistent: Celery's default
        "delivery_info": {"exchange": "", "routing_key": queue},
        "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
    }
    message = {"body": base64.b64encode(body.encode()).decode(),
               "content-encoding": "utf-8", "content-type": "application/json",
               "headers": headers, "properties": properties}
    return priority_sublist(queue, priority), kombu_dumps(message)


def priority_sublist(queue: str, priority: int) -> str:
    """kombu's list for a message of this Redis priority (`_q_for_pri`: clamped to 0-9,
    then the highest of the app's priority steps not above it)."""
    step = keys.PRIORITY_STEPS[bisect(keys.PRIORITY_STEPS, max(0, min(int(priority), 9))) - 1]
    return f"{queue}{keys.PRIORITY_SEP}{step}" if step else queue


@functools.lru_cache(maxsize=4)
def _origin(pid: int) -> str:
    """The `origin` header: Celery's name of this process (`gen<pid>@<host>`)."""
    return anon_nodename()


def task_repr(payload: GeneratePayload) -> str:
    """What task events and Flower show of a job: ids and counts, never its text."""
    return (f"job={payload.job_id} lane={payload.lane} prompt_tokens={payload.prompt_tokens} "
            f"max_tokens={payload.sampling.max_tokens}")
