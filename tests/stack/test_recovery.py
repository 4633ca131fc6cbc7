"""Every accepted job ends, whatever dies on the way: a worker killed mid-generation
(SIGKILL, its engine processes with it) has its job taken over by another within seconds,
and the consumer's stream goes on with no gap and no repeat; a second delivery of a
running job neither drops it nor runs it twice; a job that keeps killing its workers
ends `poison`.

Two workers of the `recovery` lane of their own (tests/lanes.toml), started once for the
module; the tests kill them, so no other module shares them. Where a test needs a job to
be mid-generation at a given moment, it freezes the worker's vLLM engine processes
(SIGSTOP), whatever the engine's speed; the worker's own threads run on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from tidegate_client import Client

from tasks.app import celery_app, queue_lengths, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.helpers import (
    Stack,
    engine_processes,
    engine_stats,
    hold,
    job_spans,
    metric,
    worker_scrape,
)
from tests.otlp import OtlpReceiver
from tidegate import keys
from tidegate.events import Event
from tidegate.fleet import read_heartbeat
from tidegate.records import WorkerState
from tidegate.settings import get_settings
from tidegate_tools.procs import Proc, start_worker, wait_until
from workers.faults import frozen

LANE, QUEUE = "recovery", "recovery.vllm"
PROMPT = "Please tell me where my parcel is and when the refund arrives"
MAX_TOKENS = 1800  # the lane's longest: seconds of generation to catch a job in
MAX_ATTEMPTS = 2  # the module's workers' (TIDEGATE_MAX_ATTEMPTS): two real deaths make poison
pytestmark = pytest.mark.timeout(600)


@dataclass
class Pair:
    key: str  # an API key of a tenant allowed the lane
    traces: OtlpReceiver  # where the workers send their spans (the session stack's too)
    procs: dict[str, Proc] = field(default_factory=dict)  # worker name -> process

    def start(self, name: str, tmp_root: Path, cpus: str) -> None:
        env = {**os.environ, "TIDEGATE_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
               "TIDEGATE_OTLP_ENDPOINT": self.traces.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        self.procs[name] = start_worker(env, LANE, name, tmp_root / "logs", cpus=cpus)

    def kill(self, name: str) -> None:
        """SIGKILL to the worker's process group: supervisor, worker, engine core."""
        os.killpg(self.procs[name].popen.pid, signal.SIGKILL)

    def engine(self, name: str) -> list[psutil.Process]:
        """The worker's vLLM engine core and the processes it spawned."""
        return engine_processes(self.procs[name])

    def frozen(self, name: str) -> contextlib.AbstractContextManager[None]:
        """The worker's engine stopped (SIGSTOP), its own threads and heartbeat running."""
        return frozen(self.engine(name))


@pytest.fixture(scope="module")
def pair(stack: Stack, tmp_root: Path, traces: OtlpReceiver) -> Iterator[Pair]:
    _, key = stack.store.tenants.create_tenant("recovery-tenant", [LANE])
    p = Pair(key, traces)
    try:
        for core, name in enumerate(("recover-a@tidegate", "recover-b@tidegate")):
            p.start(name, tmp_root, str(core))
        wait_until(lambda: all(_active(stack, n) for n in p.procs), 240,
                   "both recovery workers to be active", list(p.procs.values()), poll_s=0.5)
        yield p
    finally:
        for proc in p.procs.values():
            proc.stop()


def _active(stack: Stack, name: str) -> bool:
    hb = read_heartbeat(stack.redis, stack.namespace, name)
    return hb is not None and hb.state == WorkerState.ACTIVE


class Reader(threading.Thread):
    """Consumes a job's SSE stream as a client would, keeping every event."""

    def __init__(self, stack: Stack, key: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.key, self.job_id = stack.base_url, key, job_id
        self.events: list[Event] = []

    def run(self) -> None:
        with Client(self.base_url, self.key) as client:
            for event in client.stream(self.job_id):
                self.events.append(event)

    def tokens(self) -> list[int]:
        return [i for e in list(self.events) if e.kind == "token" for i in e.token_ids]

    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].terminal


def submit(stack: Stack, key: str) -> str:
    with Client(stack.base_url, key) as client:
        return str(client.submit(LANE, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                 temperature=0.0)["job_id"])


def read_to_end(stack: Stack, key: str, job_id: str, procs: list[Proc]) -> Reader:
    reader = Reader(stack, key, job_id)
    reader.start()
    wait_until(reader.ended, 120, f"job {job_id} to end", procs)
    return reader


def worker_of(stack: Stack, job_id: str) -> str:
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.worker is not None, f"job {job_id} has no worker yet"
    return row.worker


HELD_AFTER = 30  # tokens a job streams before its worker holds it


@contextlib.contextmanager
def mid_job(stack: Stack, pair: Pair) -> Iterator[tuple[str, Reader, str]]:
    """A job held by its worker after its first tokens, however fast the engine: (its id,
    its reader, the worker). A job's events can carry many tokens each when the engine runs
    ahead of its worker, so counting events catches no job mid-generation for sure. The
    other worker is released at once (a job resumed there runs through); every hold is let
    go when the block ends."""
    names = list(pair.procs)
    hold(names, HELD_AFTER)
    try:
        job_id = submit(stack, pair.key)
        reader = Reader(stack, pair.key, job_id)
        reader.start()
        wait_until(lambda: any(engine_stats(n)["held"] == job_id for n in names), 60,
                   f"a worker to hold job {job_id}", list(pair.procs.values()), poll_s=0.05)
        worker = worker_of(stack, job_id)
        hold([n for n in names if n != worker], 0)
        row = stack.store.jobs.get_job(job_id)
        assert row is not None and row.status == "running"
        yield job_id, reader, worker
    finally:
        hold([n for n, proc in pair.procs.items() if proc.alive()], 0)


RESUMED, POISON = "tidegate_jobs_resumed_total", "tidegate_poison_jobs_total"
RECOVERIES = "tidegate_recoveries_total"


def counted(pair: Pair, name: str, counter: str, **labels: str) -> float:
    """A counter on the worker's own /metrics (0 before it first counts)."""
    port = pair.procs[name].metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return metric(text, counter, **labels)


def counters(stack: Stack, pair: Pair, names: list[str]) -> dict[str, float]:
    """The recovery counters of the recovery workers `names`: jobs they resumed, jobs they
    ended poison; and the dead workers' messages handed back by the sweep of any live
    worker (one per period runs it: these, or the session stack's)."""
    stack_scrapes = [worker_scrape(stack, lane) for lane in stack.workers]
    return {"resumed": sum(counted(pair, n, RESUMED, lane=LANE, worker=n) for n in names),
            "poison": sum(counted(pair, n, POISON, lane=LANE, worker=n) for n in names),
            "restored": sum(counted(pair, n, RECOVERIES, action="restored") for n in names)
            + sum(metric(text, RECOVERIES, action="restored") for text in stack_scrapes)}


def counted_since(stack: Stack, pair: Pair, names: list[str],
                  before: dict[str, float]) -> dict[str, float]:
    """What was counted since `before` (counters() of the same workers)."""
    after = counters(stack, pair, names)
    return {k: after[k] - before[k] for k in after}


def check_stream(events: list[Event]) -> None:
    """Contiguous sequence numbers from 0, one start, one end: no gap, no repeat."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.kind for e in events].count("started") == 1 and events[0].kind == "started"
    assert events[-1].kind == "done" and not any(e.terminal for e in events[:-1])


def test_a_job_outliving_its_lease_keeps_it_and_runs_once(stack: Stack, pair: Pair) -> None:
    with mid_job(stack, pair) as (job_id, reader, worker), pair.frozen(worker):
        # The job runs on, in no hurry, for two lease lifetimes.
        lease = keys.job_lease(stack.namespace, job_id)
        owner = stack.redis.get(lease)
        lease_s = keys.lease_ttl_s(get_settings().heartbeat_s)
        until = time.time() + 2 * lease_s
        wait_until(lambda: beat_at(stack, worker) > until, 4 * lease_s,
                   "the frozen worker's heartbeat to go on past two lease lifetimes")
        assert owner is not None and stack.redis.get(lease) == owner  # renewed, not taken
    wait_until(reader.ended, 120, "the job to end", list(pair.procs.values()))
    check_stream(reader.events)
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "done" and row.attempts == 1
    assert len(reader.tokens()) == MAX_TOKENS


def beat_at(stack: Stack, name: str) -> float:
    hb = read_heartbeat(stack.redis, stack.namespace, name)
    return hb.ts if hb else 0.0


def test_a_second_delivery_of_a_running_job_waits_and_does_not_run_it_again(
        stack: Stack, pair: Pair) -> None:
    skipped_before = skipped(pair)
    with mid_job(stack, pair) as (job_id, reader, worker), pair.frozen(worker):
        # Still running when the second delivery arrives.
        payload = GeneratePayload(job_id=job_id, lane=LANE, prompt=PROMPT, prompt_tokens=12,
                                  sampling=Sampling(max_tokens=MAX_TOKENS, temperature=0.0))
        send_generate(celery_app(), payload, QUEUE, 5)  # what a visibility timeout does
        wait_until(lambda: queue_lengths(stack.redis, [QUEUE])[QUEUE] == 0, 30,
                   "a worker to take the second delivery")
    wait_until(reader.ended, 120, "the job to end", list(pair.procs.values()))
    check_stream(reader.events)
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "done" and row.attempts == 1
    assert len(reader.tokens()) == MAX_TOKENS
    wait_until(lambda: skipped(pair) > skipped_before, 30,
               "the second delivery to end, doing nothing")


def skipped(pair: Pair) -> int:
    """Deliveries that found their job finished, on either worker (either may get one)."""
    return sum(engine_stats(name)["outcomes"].get("skipped-terminal", 0) for name in pair.procs)


def test_a_job_taken_up_too_often_ends_poison(stack: Stack, pair: Pair) -> None:
    job_id = str(uuid.uuid4())
    tenant = stack.store.tenants.tenant_by_key(pair.key)
    assert tenant is not None
    stack.store.jobs.create_job(job_id, tenant.id, LANE, QUEUE, 5, None, {"max_tokens": 8}, 12)
    for attempt in range(MAX_ATTEMPTS):  # each died with its worker (faked: the row only)
        stack.store.runs.claim_job(job_id, f"dead-{attempt}@gone", "vllm")
    payload = GeneratePayload(job_id=job_id, lane=LANE, prompt=PROMPT, prompt_tokens=12,
                              sampling=Sampling(max_tokens=8, temperature=0.0))
    before = counters(stack, pair, list(pair.procs))
    send_generate(celery_app(), payload, QUEUE, 5)
    reader = read_to_end(stack, pair.key, job_id, list(pair.procs.values()))
    assert [e.kind for e in reader.events] == ["error"]  # never started: nothing to resume
    assert reader.events[-1].data["code"] == "poison"
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "error"
    assert row.attempts == MAX_ATTEMPTS + 1
    # Whichever worker took it counted one poison job (and one taken-over attempt: the
    # attempt number is past the first); no sweep handed anything back.
    assert counted_since(stack, pair, list(pair.procs), before) == {
        "resumed": 1, "poison": 1, "restored": 0}


def test_a_stalled_worker_loses_its_job_and_cannot_write_to_it_when_it_wakes(
        stack: Stack, pair: Pair) -> None:
    """The whole worker stopped (SIGSTOP to its process group: its heartbeat and lease
    renewal stop too, as in a long GC pause or a frozen VM): its lease lapses, the other
    worker resumes the job, and when the stalled one wakes its attempt is fenced off: the
    stream stays whole, with no event of the old attempt after the takeover."""
    with mid_job(stack, pair) as (job_id, reader, stalled):
        group = pair.procs[stalled].popen.pid
        os.killpg(group, signal.SIGSTOP)
        try:
            survivor = next(n for n in pair.procs if n != stalled)
            wait_until(reader.ended, 180, "the stalled worker's job to end on the other",
                       [pair.procs[survivor]])
        finally:
            os.killpg(group, signal.SIGCONT)
    check_stream(reader.events)
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "done" and row.attempts == 2
    assert row.worker == survivor
    assert len(reader.tokens()) == MAX_TOKENS == row.completion_tokens
    # Awake again, the stalled worker gives the job up (its engine request aborted) and
    # goes back to work; the job's stream gained nothing from it.
    wait_until(lambda: _active(stack, stalled) and engine_stats(stalled)["unfinished"] == 0,
               120, "the woken worker to drop the job and be active", [pair.procs[stalled]])
    entries = stack.redis.xrange(keys.job_events(stack.namespace, job_id))
    assert len(entries) == len(reader.events)


def test_a_killed_workers_job_resumes_on_the_other_with_no_gap_or_repeat(
        stack: Stack, pair: Pair) -> None:
    with mid_job(stack, pair) as (job_id, reader, victim):
        survivor = next(n for n in pair.procs if n != victim)
        before = counters(stack, pair, [survivor])
        pair.kill(victim)
        pair.procs.pop(victim).stop()  # gone for the module's later tests, pass or fail
    wait_until(reader.ended, 120, "the job to end after its worker was killed",
               [pair.procs[survivor]])

    check_stream(reader.events)
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "done" and row.attempts == 2
    assert row.worker == survivor
    assert row.output_text == "".join(e.text for e in reader.events if e.kind == "token")
    assert len(reader.tokens()) == MAX_TOKENS == row.completion_tokens
    # A live worker's sweep handed the dead worker's message back (one message), and the
    # survivor took the job over (one resumed job on its /metrics); no poison.
    assert counted_since(stack, pair, [survivor], before) == {
        "resumed": 1, "poison": 0, "restored": 1}
    # One trace still: the survivor's attempt continues the submit's (the trace context
    # travels in the message the sweep handed back), the dead attempt's span died with it.
    assert row.trace_id is not None
    spans = job_spans(pair.traces, job_id)
    assert [(s.trace_id, s.attributes["tidegate.attempt"], s.attributes["tidegate.worker"])
            for s in spans] == [(row.trace_id, 2, survivor)]
    assert any(s.service == "tidegate-api" and s.trace_id == row.trace_id
               for s in pair.traces.received())
    # The same request, uninterrupted, on the survivor: greedy, so the same tokens.
    other_id = submit(stack, pair.key)
    uninterrupted = read_to_end(stack, pair.key, other_id, [pair.procs[survivor]])
    check_stream(uninterrupted.events)
    other = stack.store.jobs.get_job(other_id)
    assert other is not None and other.completion_tokens == len(uninterrupted.tokens())
    assert reader.tokens() == uninterrupted.tokens()
    # The dead worker's lease is gone and nothing of the job waits in the lane queue.
    assert not stack.redis.exists(keys.job_lease(stack.namespace, job_id))


def test_a_job_whose_workers_die_max_attempts_times_ends_poison(
        stack: Stack, pair: Pair, tmp_root: Path) -> None:
    """Real deaths, not claims written by hand: the job's worker is SIGKILLed mid-job,
    the job resumes on another, whose worker is SIGKILLed mid-job too; the third taker
    finds it taken up more than MAX_ATTEMPTS times and ends it poison, after the tokens
    the two dead attempts streamed. Two more workers join the one this module has left."""
    for core, name in enumerate(("recover-c@tidegate", "recover-d@tidegate")):
        pair.start(name, tmp_root, str(core))
    names = list(pair.procs)
    wait_until(lambda: all(_active(stack, n) for n in names), 240,
               "three recovery workers to be active", list(pair.procs.values()), poll_s=0.5)
    poisoned = {n: counted(pair, n, POISON, lane=LANE, worker=n) for n in names}
    hold(names, HELD_AFTER)  # each will hold the first job to pass 30 tokens on it
    try:
        job_id = submit(stack, pair.key)
        reader = Reader(stack, pair.key, job_id)
        reader.start()
        for death in range(MAX_ATTEMPTS):
            wait_until(lambda: holder(pair, job_id) is not None, 120,
                       f"a worker to hold job {job_id} (death {death + 1})",
                       list(pair.procs.values()), poll_s=0.05)
            victim = holder(pair, job_id)
            assert victim is not None and worker_of(stack, job_id) == victim
            pair.kill(victim)
            pair.procs.pop(victim).stop()
        wait_until(reader.ended, 120, "the job to end poison", list(pair.procs.values()))
    finally:
        hold([n for n, proc in pair.procs.items() if proc.alive()], 0)
    events = reader.events
    assert [e.seq for e in events] == list(range(len(events))), "events missing or repeated"
    assert [e.kind for e in events].count("started") == 1 and events[0].kind == "started"
    assert events[-1].kind == "error" and events[-1].data["code"] == "poison"
    assert len(reader.tokens()) >= HELD_AFTER  # what the dead attempts streamed stays
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "error"
    assert row.attempts == MAX_ATTEMPTS + 1
    assert row.completion_tokens == len(reader.tokens())
    # The worker that took it up last counted it, once (the dead ones' counters died).
    assert sum(counted(pair, n, POISON, lane=LANE, worker=n) - poisoned[n]
               for n in pair.procs) == 1


def holder(pair: Pair, job_id: str) -> str | None:
    """The live worker holding `job_id` (workers/faults.py TokenHold), if any."""
    return next((n for n, proc in pair.procs.items()
                 if proc.alive() and engine_stats(n)["held"] == job_id), None)

