"""The generate task: the body Celery runs for each job message, and the request class
that keeps prompts out of what `inspect` and Flower show."""

from __future__ import annotations

from celery import Task
from celery.exceptions import Reject
from celery.worker.request import Request
from opentelemetry.trace import SpanKind

from tasks.payloads import GeneratePayload
from tidegate import tracing
from tidegate.records import AttemptOutcome
from workers.consumer import turn_consumer_loop
from workers.worker import current


class TextFreeRequest(Request):
    """A task request whose `info()` (what `inspect active/reserved/query_task` answer, and
    Flower shows on a worker's page) carries the task's `argsrepr`, never its arguments:
    a generate task's argument is the prompt (tasks.app.task_repr).

    Its ack (or requeue) wakes the consumer's loop. A task thread acks: with every slot's
    message unacked the consumer stops popping (the prefetch window is the slot count),
    and kombu registers its next BRPOP only on a turn of its loop, which an ack from
    another thread does not cause. The loop slept until its next timer (the task events'
    flush, up to 0.1 s; otherwise a second), so a freed slot stayed idle that long while
    jobs waited: bench/fairness.py measured a waiting job's queue wait at 200-540 ms with
    a full engine where the next slot freed within ~40 ms."""

    def info(self, safe: bool = False) -> dict[str, object]:  # Celery's own shape
        return dict(super().info(safe=True))

    def acknowledge(self) -> None:
        super().acknowledge()
        turn_consumer_loop()

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue)
        turn_consumer_loop()


def generate(task: Task, body: dict[str, object]) -> str:
    """The task's edge: the message's JSON body becomes a GeneratePayload here, and the
    rest of the worker sees only the typed payload."""
    payload = GeneratePayload.from_dict(body)
    me = current()
    # One span per attempt, under the submit's trace (the payload's trace context).
    attrs = {"job_id": payload.job_id, "lane": payload.lane, "worker": me.name}
    with tracing.span("tidegate.job", attrs, parent=payload.trace_context,
                      kind=SpanKind.CONSUMER) as span:
        outcome = me.run(payload)
        span.set_attribute("tidegate.outcome", outcome.value)
    if outcome is AttemptOutcome.REQUEUED:
        # The job could not be ended (store or Redis down past the retries): rejected with
        # requeue, kombu puts the message back on its queue; acked, the job would be lost.
        raise Reject(f"job {task.request.id}: requeued, the store or Redis is failing",
                     requeue=True)
    return outcome.value
