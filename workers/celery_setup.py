"""Everything Celery calls in a worker process, registered on its app: the generate task
(workers/task.py), the consumer (workers/consumer.py), the engine bootstep and its options
(workers/bootsteps.py), the signals (workers/signals.py) and the control commands
(workers/control.py; workers/fault_commands.py when the settings ask for them). Each
reaches the process's one `Worker` (workers/worker.py `current`)."""

from __future__ import annotations

import click
from celery import Celery

from tasks.payloads import GENERATE
from tidegate.settings import Settings
from workers import broker, consumer, fault_commands
from workers import control as control  # noqa: F401 - its commands register at import
from workers import signals as signals  # noqa: F401 - its handlers connect at import
from workers.bootsteps import OPTIONS, EngineStep
from workers.task import TextFreeRequest, generate


def register(app: Celery, settings: Settings) -> None:
    """The generate task, the engine bootstep and its options, the consumer, and the
    fault-injection commands if `settings.fault_commands`, on this process's app."""
    app.task(name=GENERATE, bind=True, acks_late=True, Request=TextFreeRequest)(generate)
    broker.install()  # kombu's per-message work, cheaper (workers/broker.py)
    app.conf.worker_consumer = \
        f"{consumer.__name__}:{consumer.EventBatchingConsumer.__name__}"
    app.steps["worker"].add(EngineStep)
    for option in OPTIONS:  # Celery's own option parser learns `--tidegate-lane`
        app.user_options["worker"].add(
            click.Option((f"--tidegate-{option}",), default="", help=f"tidegate {option}"))
    if settings.fault_commands:
        fault_commands.install()
