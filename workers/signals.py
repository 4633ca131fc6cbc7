"""Celery's signals in a worker process, connected when this module is imported
(workers/celery_setup.py): the worker's phase at ready and at shutdown, and the log context
of each job's task."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from contextvars import Token
from typing import Any

from celery import Task
from celery.signals import task_postrun, task_prerun, worker_ready, worker_shutting_down

from tasks.payloads import GENERATE
from tidegate import logs
from tidegate.settings import get_settings
from workers.warming import warm
from workers.worker import Phase, current

log = logging.getLogger("tidegate.worker")


@worker_ready.connect
def _ready(**_: object) -> None:
    me = current()
    if me.pool_queue not in me.consumed():
        # A standby worker: its lane's prompts are warm (and the tokenizer that renders
        # them loaded) before it says standby, not at its activation (seconds on a busy
        # host), which then finds them warm (workers/warmed.py).
        try:
            done = warm([], get_settings().lanes[me.lane].warm_prompts)
            log.info("standby: the lane's prompts warmed in %.0f ms", done["ms"])
        except Exception:  # the activation warms them all the same
            log.exception("warming the lane's prompts in standby failed")
    me.phase = Phase.READY


@worker_shutting_down.connect
def _draining(**_: object) -> None:
    current().phase = Phase.DRAINING


# (task id, thread) -> its log context's token (tidegate/logs.py); a redelivered job can
# run in two threads at once.
_job_logs: dict[tuple[str, int], Token[Mapping[str, Any]]] = {}


@task_prerun.connect
def _job_logs_open(task_id: str, task: Task, args: tuple[object, ...] = (),
                   **_: object) -> None:
    """Every line logged while a job's task runs carries its job id and lane, Celery's
    own "succeeded" line among them (both signals come in the task's thread)."""
    if task.name == GENERATE:
        body = args[0] if args and isinstance(args[0], dict) else {}
        _job_logs[task_id, threading.get_ident()] = logs.open_context(
            job_id=task_id, lane=body.get("lane"))


@task_postrun.connect
def _job_logs_close(task_id: str, **_: object) -> None:
    token = _job_logs.pop((task_id, threading.get_ident()), None)
    if token is not None:
        logs.close_context(token)
