"""Everything Celery calls in a worker process, in one module: the generate task, the
bootstep that loads the engine before the consumer starts, the signals, and the control
commands the scheduler steers workers with. Each reaches the process's one `Worker`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import click
from celery import Celery, bootsteps
from celery.backends.base import DisabledBackend
from celery.exceptions import Reject
from celery.signals import task_postrun, task_prerun, worker_ready, worker_shutting_down
from celery.worker.consumer import Consumer
from celery.worker.control import control_command, inspect_command
from celery.worker.request import Request
from opentelemetry.trace import SpanKind

from tasks.payloads import GENERATE
from tidegate import logs, tracing
from tidegate.lanes import Lane, hosted_lanes
from tidegate.records import RESTART_EXIT
from tidegate.settings import get_settings
from workers import broker
from workers import metrics as worker_metrics
from workers.engine import Engine, EngineConfig
from workers.runner import REQUEUED
from workers.warmed import Warmed
from workers.worker import Phase, Worker, current, set_current

log = logging.getLogger("tidegate.worker")

ENGINES = ("vllm", "trtllm", "sim")  # sim: no model, GPU timings (workers/sim_engine.py)
OPTIONS = ("lane", "pool", "engine", "metrics-port")  # `--tidegate-<option>`, to EngineStep


def register(app: Celery) -> None:
    """The generate task, the engine bootstep and its options, and the consumer, on this
    process's app."""
    app.task(name=GENERATE, bind=True, acks_late=True, Request=TextFreeRequest)(generate)
    broker.install()  # kombu's per-message work, cheaper (workers/broker.py)
    app.conf.worker_consumer = f"{__name__}:{EventBatchingConsumer.__name__}"
    app.steps["worker"].add(EngineStep)
    for option in OPTIONS:  # Celery's own option parser learns `--tidegate-lane`
        app.user_options["worker"].add(
            click.Option((f"--tidegate-{option}",), default="", help=f"tidegate {option}"))


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
    _event_dispatcher: Any = None

    @property
    def event_dispatcher(self) -> Any:
        return self._event_dispatcher

    @event_dispatcher.setter
    def event_dispatcher(self, dispatcher: Any) -> None:
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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

    def info(self, safe: bool = False) -> dict[str, Any]:
        return super().info(safe=True)

    def acknowledge(self) -> None:
        super().acknowledge()
        turn_consumer_loop()

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue)
        turn_consumer_loop()


_consumer_hub: Any = None  # the consumer's event loop (kombu's Hub), once it has one


def turn_consumer_loop() -> None:
    """A turn of the consumer's loop, from any thread (call_soon is the hub's thread-safe
    entry and wakes its poll)."""
    hub = _consumer_hub
    if hub is not None:
        hub.call_soon(_noop)


def _noop() -> None:
    pass


def generate(task: Any, body: dict[str, Any]) -> str:
    me = current()
    # One span per attempt, under the submit's trace (the payload's trace context).
    attrs = {"job_id": str(body.get("job_id")), "lane": str(body.get("lane")),
             "worker": me.name}
    with tracing.span("tidegate.job", attrs, parent=body.get("trace_context"),
                      kind=SpanKind.CONSUMER) as span:
        outcome = me.run(body)
        span.set_attribute("tidegate.outcome", outcome)
    if outcome == REQUEUED:
        # The job could not be ended (store or Redis down past the retries): rejected with
        # requeue, kombu puts the message back on its queue; acked, the job would be lost.
        raise Reject(f"job {task.request.id}: requeued, the store or Redis is failing",
                     requeue=True)
    return outcome


def _tool_parsers(lanes: dict[str, Lane], lane: str) -> tuple[str, ...]:
    """The tool parsers of the lane and of every lane that runs on its workers."""
    names = (lanes[name].tool_parser for name in hosted_lanes(lanes, lane))
    return tuple(sorted({name for name in names if name is not None}))


def make_engine(lane: str, kind: str) -> Engine:
    settings = get_settings()
    profile = settings.lanes[lane]
    config = EngineConfig(
        model=str(settings.model_path), dtype=profile.dtype,
        kv_cache_dtype=profile.kv_cache_dtype, max_model_len=settings.max_model_len,
        slots=settings.engine_slots, kv_cache_gib=settings.kv_cache_gib,
        cpu_executor=settings.vllm_cpu_executor,
        quantization=profile.quantization, lora_adapters=settings.lora,
        kv_policy=settings.kv_policy, kv_params=profile.kv_policy,
        kv_cache_blocks=settings.kv_cache_blocks or None,
        kv_block_size=settings.kv_block_size or None,
        cuda_graphs=profile.cuda_graphs,
        tool_parsers=_tool_parsers(settings.lanes, lane),
    )
    if kind == "trtllm":
        from workers.trtllm_engine import TrtllmEngine

        return TrtllmEngine(config)
    if kind == "sim":
        from workers.sim_engine import SimEngine

        # On a replay clock the profile's load and activation times play, compressed.
        scale = settings.replay_speedup if settings.clock.replay else None
        return SimEngine(config, profile=settings.sim_profile, startup_scale=scale)
    from workers.vllm_engine import VllmEngine

    return VllmEngine(config)


class EngineStep(bootsteps.StartStopStep):
    """Loads and warms the engine before the consumer takes any task."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, tidegate_lane: str = "chat", tidegate_pool: str = "",
                 tidegate_engine: str = "vllm", tidegate_metrics_port: str = "",
                 **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.lane, self.engine = tidegate_lane, tidegate_engine
        self.pool = tidegate_pool or tidegate_engine
        self.metrics_port = int(tidegate_metrics_port or 0)  # 0: no /metrics

    def start(self, worker: Any) -> None:
        share_result_backend(worker.app)
        me = Worker(get_settings(), worker.hostname, self.lane, self.pool, worker)
        me.metrics_port = self.metrics_port  # announced in its heartbeat from the first beat
        set_current(me)
        me.load(make_engine(self.lane, self.engine))
        # After the engine's load, so its engine-core process starts without the exporter.
        tracing.setup_tracing(get_settings(), "tidegate-worker")
        if self.metrics_port:  # on the socket bound before the load (workers/metrics.py)
            worker_metrics.serve(get_settings().metrics_host, self.metrics_port, lambda: me)

    def stop(self, worker: Any) -> None:
        current().stop()
        broker.ACKS.flush()  # the acks still waiting go out before the process ends


def share_result_backend(app: Celery) -> None:
    """One result backend for the generate task in every pool thread. The app has none
    (task_ignore_result: job state lives in the store), but Celery still looks one up in
    each new task thread (its backends are thread-local unless thread-safe), and the look-up
    reads every installed package's entry points: 6.6% of a worker's CPU while its pool
    grew under load (bench/README.md, "fourth round"). The disabled backend holds no
    state, so one serves every thread; a backend configured on purpose is left per thread."""
    backend = app.backend
    if isinstance(backend, DisabledBackend):
        app.tasks[GENERATE].backend = backend


@worker_ready.connect
def _ready(**_: Any) -> None:
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
def _draining(**_: Any) -> None:
    current().phase = Phase.DRAINING


# (task id, thread) -> its log context's token (tidegate/logs.py); a redelivered job can
# run in two threads at once.
_job_logs: dict[tuple[str, int], Any] = {}


@task_prerun.connect
def _job_logs_open(task_id: str, task: Any, args: Any = (), **_: Any) -> None:
    """Every line logged while a job's task runs carries its job id and lane, Celery's
    own "succeeded" line among them (both signals come in the task's thread)."""
    if task.name == GENERATE:
        body = args[0] if args and isinstance(args[0], dict) else {}
        _job_logs[task_id, threading.get_ident()] = logs.open_context(
            job_id=task_id, lane=body.get("lane"))


@task_postrun.connect
def _job_logs_close(task_id: str, **_: Any) -> None:
    token = _job_logs.pop((task_id, threading.get_ident()), None)
    if token is not None:
        logs.close_context(token)


# -- control commands (app.control.broadcast(name, destination=[worker])) -------------


@inspect_command(name="tidegate_stats")
def tidegate_stats(state: Any) -> dict[str, Any]:
    """Engine stats on demand, with the worker's state, jobs in flight and outcomes."""
    me = current()
    stats = me.engine_stats()
    in_flight, outcomes = me.counts()
    return {**(stats.to_dict() if stats else {}), "state": me.state(), "outcomes": outcomes,
            "in_flight": in_flight, "store_faults": me.store_fault.fired, "held": me.hold.held}


@control_command(args=[("prompts", list), ("system_prompts", list)],
                 signature="<prompts> <system_prompts>")
def tidegate_warm(state: Any, prompts: list[str] | None = None,
                  system_prompts: list[str] | None = None) -> dict[str, Any]:
    """Runs prompts through the engine so their prefixes sit in its KV cache; system
    prompts are first rendered as the start of a chat with the model's template."""
    return warm(prompts or [], system_prompts or [])


def warm(prompts: list[str], system_prompts: list[str]) -> dict[str, Any]:
    started, me = time.monotonic(), current()
    texts = list(prompts) + [render_system(p) for p in system_prompts]
    kind = me.host.engine.kind
    todo = _warmed.missing(texts, kind, me.engine_stats())  # what is warm is not run again
    if todo:
        me.host.warm(todo)
        _warmed.add(todo, kind, me.engine_stats())
    return {"ok": True, "warmed": len(todo), "already": len(texts) - len(todo),
            "ms": (time.monotonic() - started) * 1000}


_warmed = Warmed()  # the prompts this process's engine warmed and still holds


@control_command(args=[("queue", str)], signature="<queue>")
def tidegate_consume(state: Any, queue: str) -> dict[str, Any]:
    """Celery's `add_consumer`, and once the queue is consumed, the fleet told at once
    (scheduler/control.py `add_consumer` waits for that, not for a heartbeat period). The
    add runs in the consumer's loop after this reply, as Celery's own command does it."""
    state.consumer.call_soon(_consume, state.consumer, queue)
    return {"ok": True}


def _consume(consumer: Any, queue: str) -> None:
    consumer.add_task_queue(queue)
    try:
        wake_consumer(consumer)
    except Exception as exc:  # CLIENT LIST refused (a managed Redis): the BRPOP times out
        log.warning("could not wake the consumer for %s: %s", queue, exc)
    try:
        current().announce()
    except Exception:  # the heartbeat says it at its next beat all the same
        log.exception("could not announce consuming %s at once", queue)


def wake_consumer(consumer: Any) -> None:
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


_tokenizers: dict[str, Any] = {}


def render_system(prompt: str) -> str:
    """The chat-template rendering of a conversation's system turn: the prefix every
    request of that conversation starts with."""
    model = str(get_settings().model_path)
    if model not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[model] = AutoTokenizer.from_pretrained(model)
    tok = _tokenizers[model]
    if not getattr(tok, "chat_template", None):
        return prompt
    return str(tok.apply_chat_template([{"role": "system", "content": prompt}], tokenize=False))


@control_command()
def tidegate_reset_prefix_cache(state: Any) -> dict[str, Any]:
    """The cheap fix for a slow allocator: drop the cached prefixes."""
    _warmed.forget()
    return {"ok": bool(current().host.reset_prefix_cache())}


@control_command()
def tidegate_restart_engine(state: Any) -> dict[str, Any]:
    """Restarts the worker with a fresh engine; the scheduler drains it first.

    The worker process exits with RESTART_EXIT and its supervisor (`tidegate worker`)
    starts a fresh one in standby. A second engine inside the same process, or in the same
    pid after exec, hung here while its engine core started; a new process does not.
    """
    current().phase = Phase.RESTARTING
    threading.Thread(target=_exit_for_restart, name="restart", daemon=True).start()
    return {"ok": True, "restarting": True}


def _exit_for_restart() -> None:
    time.sleep(0.5)  # let the control reply reach the scheduler
    try:
        current().stop()  # the engine core is a child process: stop it first
    except Exception:
        log.exception("engine shutdown before restart failed; restarting anyway")
    log.warning("worker process exits to be restarted by its supervisor")
    os._exit(RESTART_EXIT)


@control_command(args=[("alloc_latency_ms", float)], signature="<alloc_latency_ms>")
def tidegate_fault(state: Any, alloc_latency_ms: float | None = None) -> dict[str, Any]:
    """Fault injection: report this allocation latency until the next engine restart."""
    current().forced_alloc_latency_ms = alloc_latency_ms
    log.warning("fault injected: reporting allocation latency %s ms", alloc_latency_ms)
    return {"ok": True}


@control_command(args=[("failures", int), ("outage_s", float)], signature="<failures> <outage_s>")
def tidegate_store_fault(state: Any, failures: int = 0, outage_s: float = 0.0) -> dict[str, Any]:
    """Fault injection: the next `failures` store statements of this worker fail, or all of
    them for `outage_s` seconds from the next one (workers/faults.py `StoreFault`)."""
    current().store_fault.arm(failures=failures, outage_s=outage_s)
    log.warning("fault injected: store statements fail (%d, or for %.1f s)", failures, outage_s)
    return {"ok": True}


@control_command(args=[("after_tokens", int), ("freeze_engine", bool)],
                 signature="<after_tokens> [freeze_engine]")
def tidegate_hold(state: Any, after_tokens: int = 0,
                  freeze_engine: bool = False) -> dict[str, Any]:
    """Fault injection: the next job to stream `after_tokens` tokens waits there until a
    `tidegate_hold` with 0 lets it go, its engine stopped meanwhile if `freeze_engine`
    (workers/faults.py `TokenHold`)."""
    hold = current().hold
    if after_tokens > 0:
        hold.arm(after_tokens, freeze_engine)
    else:
        hold.release()
    log.warning("fault injected: hold a job after %d tokens", after_tokens)
    return {"ok": True}
