"""What a worker registers with Celery (workers/celery_setup.py), without a worker: the
generate task at its edge, the control commands, the fault-injection ones only when the
setting asks, and a restart that waits for its reply instead of a fixed sleep."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.exceptions import Reject
from celery.worker.control import Panel

from tasks.payloads import GENERATE, GeneratePayload, Sampling
from tidegate.records import AttemptOutcome
from tidegate.settings import Settings
from workers import celery_setup, control, fault_commands, worker
from workers.bootsteps import EngineStep
from workers.consumer import EventBatchingConsumer
from workers.task import TextFreeRequest, generate

FAULTS = ("tidegate_fault", "tidegate_store_fault", "tidegate_hold")
STEERING = ("tidegate_stats", "tidegate_warm", "tidegate_consume",
            "tidegate_reset_prefix_cache", "tidegate_restart_engine")


@pytest.fixture
def no_faults() -> Iterator[None]:
    """Celery's control panel is process-wide: the fault commands leave it after the test."""
    saved = {name: (Panel.data.pop(name, None), Panel.meta.pop(name, None)) for name in FAULTS}
    yield
    for name, (fun, meta) in saved.items():
        Panel.data.pop(name, None)
        Panel.meta.pop(name, None)
        if fun is not None:
            Panel.data[name], Panel.meta[name] = fun, meta


def registered(faults: bool, monkeypatch: pytest.MonkeyPatch) -> Celery:
    monkeypatch.setattr(celery_setup.broker, "install", lambda: None)  # kombu stays as is
    app = Celery("tidegate-test", set_as_current=False)
    celery_setup.register(app, Settings(fault_commands=faults))
    return app


@pytest.mark.usefixtures("no_faults")
def test_a_production_worker_has_the_steering_commands_and_no_fault_commands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = registered(False, monkeypatch)
    assert all(name in Panel.data for name in STEERING)
    assert not any(name in Panel.data for name in FAULTS)
    task = app.tasks[GENERATE]
    assert task.acks_late and task.Request is TextFreeRequest
    assert app.conf.worker_consumer == "workers.consumer:EventBatchingConsumer"
    assert EventBatchingConsumer.__module__ == "workers.consumer"
    assert EngineStep in app.steps["worker"]


@pytest.mark.usefixtures("no_faults")
def test_the_fault_commands_register_when_the_setting_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registered(True, monkeypatch)
    assert Panel.data["tidegate_hold"] is fault_commands.tidegate_hold
    assert [name for name, _ in Panel.meta["tidegate_store_fault"].args] == \
        ["failures", "outage_s"]


class FakeWorker:
    name = "w1"

    def __init__(self, outcome: AttemptOutcome) -> None:
        self.outcome, self.ran = outcome, []

    def run(self, payload: GeneratePayload) -> AttemptOutcome:
        self.ran.append(payload)
        return self.outcome


def run_task(outcome: AttemptOutcome, monkeypatch: pytest.MonkeyPatch) -> tuple[str, FakeWorker]:
    me = FakeWorker(outcome)
    monkeypatch.setattr("workers.task.current", lambda: me)
    body = GeneratePayload(job_id="job-1", lane="chat", prompt="hi", prompt_tokens=1,
                           sampling=Sampling(max_tokens=4, stop=("x",))).to_dict()
    task = SimpleNamespace(request=SimpleNamespace(id="job-1"))
    return generate(task, body), me


def test_the_task_body_is_parsed_at_the_edge_and_the_outcome_returned_as_its_string(
        monkeypatch: pytest.MonkeyPatch) -> None:
    result, me = run_task(AttemptOutcome.SKIPPED_TERMINAL, monkeypatch)
    assert result == "skipped-terminal" and type(result) is str
    assert me.ran[0].sampling.stop == ("x",)  # the typed payload, its tuples back


def test_a_requeued_attempt_rejects_its_message_back_to_the_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Reject) as raised:
        run_task(AttemptOutcome.REQUEUED, monkeypatch)
    assert raised.value.requeue


def test_a_restart_exits_once_its_reply_is_out_not_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scheduled: list[Callable[[], object]] = []
    exited = threading.Event()
    me = SimpleNamespace(phase=None, stop=lambda: None)
    monkeypatch.setattr(control, "current", lambda: me)
    monkeypatch.setattr(control.os, "_exit", lambda code: exited.set())
    state = SimpleNamespace(consumer=SimpleNamespace(call_soon=scheduled.append))
    assert control.tidegate_restart_engine(state) == {"ok": True, "restarting": True}
    assert me.phase is worker.Phase.RESTARTING
    assert not exited.wait(0.3)  # the consumer's loop has not sent the reply yet
    for callback in scheduled:  # its next turn, after the reply
        callback()
    assert exited.wait(5)
