"""The whole path on real parts: HTTP submit -> Redis lane queue -> Celery worker hosting
vLLM on CPU -> token events over a Redis stream and pub/sub -> SSE consumer."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tidegate_client import Client

from tasks.app import make_app, send_generate
from tasks.payloads import GeneratePayload, Sampling
from tests.helpers import Stack, engine_stats, metric, worker_scrape
from tidegate import keys
from tidegate.events import Event
from tidegate.settings import get_settings
from tidegate_tools.procs import wait_until
from workers.vllm_engine import cpu_fp8_kv_supported

# vLLM's CPU build runs an FP8 KV cache only on AVX-512 or AMX; elsewhere the chat worker
# falls back to the weights' dtype and reports it.
CHAT_KV = "fp8" if cpu_fp8_kv_supported() else "auto"
FP8_SKIP = "this CPU has neither AVX-512 nor AMX: vLLM's CPU build has no FP8 KV cache here"

MESSAGES = [{"role": "user", "content": "Where is my order? It has not arrived yet."}]


def submit(stack: Stack, lane: str = "chat", **options: object) -> str:
    with Client(stack.base_url, stack.api_key) as client:
        return client.submit(lane, messages=MESSAGES, **options)["job_id"]


def consume(stack: Stack, job_id: str, last_event_id: int = -1) -> list[Event]:
    with Client(stack.base_url, stack.api_key) as client:
        return list(client.stream(job_id, last_event_id=last_event_id))


def test_events_arrive_in_order_and_match_the_stored_output(stack: Stack) -> None:
    job_id = submit(stack, "finance", max_tokens=24, temperature=0.8, seed=7)
    events = consume(stack, job_id)

    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].kind == "started" and events[-1].kind == "done"
    tokens = [e for e in events if e.kind == "token"]
    assert sum(len(e.token_ids) for e in tokens) == 24
    job = stack.store.jobs.get_job(job_id)
    assert job is not None and job.status == "done"
    assert "".join(e.text for e in tokens) == job.output_text != ""
    assert job.completion_tokens == 24 and job.finish_reason == "length"
    assert job.engine == "vllm" and job.worker == stack.workers["finance"]


def test_job_row_and_done_event_carry_queue_wait_ttft_tpot(stack: Stack) -> None:
    job_id = submit(stack, "chat", max_tokens=16)
    done = consume(stack, job_id)[-1]
    job = stack.store.jobs.get_job(job_id)
    assert job is not None
    for name in ("queue_wait_ms", "ttft_ms", "tpot_ms"):
        value = getattr(job, name)
        assert value is not None and value >= 0, name
        assert done.data[name] == value
    assert done.data["usage"] == {"prompt_tokens": job.prompt_tokens, "completion_tokens": 16,
                                  "cached_tokens": job.cached_tokens}
    assert job.cached_tokens is not None and 0 <= job.cached_tokens < job.prompt_tokens


def test_consumer_connecting_after_done_receives_every_event(stack: Stack) -> None:
    job_id = submit(stack, "chat", max_tokens=12)
    first = consume(stack, job_id)
    late = consume(stack, job_id)  # the job is finished: a late consumer replays it all
    assert late == first and late[-1].kind == "done"


def test_last_event_id_resumes_with_exactly_the_remainder(stack: Stack) -> None:
    job_id = submit(stack, "chat", max_tokens=20)
    everything = consume(stack, job_id)
    for cut in (0, 5, len(everything) - 2):
        assert consume(stack, job_id, last_event_id=cut) == everything[cut + 1:]


def same(ours: list[Event], sdk: list[Any]) -> bool:
    """Events read from Redis (tidegate.events.Event) and the SDK's (its own model): the
    same fields, in the same order."""
    def fields(e: Any) -> tuple[Any, ...]:
        return (e.job_id, e.seq, e.kind, e.text, list(e.token_ids), e.data)

    return [fields(e) for e in ours] == [fields(e) for e in sdk]


def test_pubsub_subscribers_see_the_same_events_live(stack: Stack) -> None:
    pubsub = stack.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(keys.job_live_pattern(stack.namespace))
    job_id = submit(stack, "chat", max_tokens=10)
    streamed = consume(stack, job_id)
    live: list[Event] = []
    deadline = time.monotonic() + 20
    while (not live or not live[-1].terminal) and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)  # None also for the subscribe confirmation
        if message is not None and message["type"] == "pmessage":
            event = Event.from_json(message["data"])
            if event.job_id == job_id:
                live.append(event)
    pubsub.close()
    assert same(live, streamed)


def test_delete_during_generation_ends_the_stream_cancelled_and_frees_the_engine(
        stack: Stack) -> None:
    """The engine's abort itself is the contract suite's (test_engine_contract.py). Chat,
    whose lane yields the CPU: a finance job at full speed on two cores starves this process
    (and the API) for seconds, so its DELETE landed at the job's very end, where the worker's
    cancel poll can miss it."""
    check_delete_during_generation(stack, "chat", 256)


def check_delete_during_generation(stack: Stack, lane: str, max_tokens: int) -> None:
    """A DELETE once the job started: its stream ends cancelled, early, its row says so and
    its engine holds nothing of it."""
    worker = stack.workers[lane]
    job_id = submit(stack, lane, max_tokens=max_tokens)
    with Client(stack.base_url, stack.api_key) as client:
        events = []
        for event in client.stream(job_id):
            events.append(event)
            if event.kind == "started":
                assert client.cancel(job_id)["status"] == "cancelled"
    assert events[-1].kind == "done" and events[-1].data["finish_reason"] == "cancelled"
    assert sum(len(e.token_ids) for e in events) < max_tokens
    job = stack.store.jobs.get_job(job_id)
    assert job is not None and job.status == "cancelled"
    # The engine no longer holds the request.
    assert engine_stats(worker, stack.broker_url)["unfinished"] == 0


def test_32_jobs_in_flight_run_batched(stack: Stack) -> None:
    """The engine's running count, sampled while this test's jobs are in flight (the
    engine idle before them), shows several of them in one step."""
    worker = stack.workers["chat"]
    wait_until(lambda: engine_stats(worker)["running"] == 0, 30, "the chat engine to be idle")
    with ThreadPoolExecutor(32) as pool:
        job_ids = list(pool.map(lambda _: submit(stack, "chat", max_tokens=64), range(32)))
        streams = [pool.submit(consume, stack, j) for j in job_ids]
        running = []
        while not all(f.done() for f in streams):
            running.append(engine_stats(worker)["running"])
        results = [f.result() for f in streams]
    assert all(r[-1].kind == "done" for r in results)
    assert all(sum(len(e.token_ids) for e in r) == 64 for r in results)
    assert max(running) > 1, f"running counts seen during the load: {sorted(set(running))}"


def test_an_engine_error_reaches_the_consumer_as_an_error_event(stack: Stack) -> None:
    """A prompt the engine refuses (longer than the model's context: the API refuses those,
    so it is sent as a task directly) ends the job `error` with the engine's reason, heard
    by its consumer; the worker goes on serving."""
    job_id = str(uuid.uuid4())
    stack.store.jobs.create_job(job_id, stack.tenant_id, "chat", "chat.vllm", 5, None,
                                {"max_tokens": 8}, 2500)
    payload = GeneratePayload(job_id=job_id, lane="chat", prompt=" refund" * 2500,
                              prompt_tokens=2500, sampling=Sampling(max_tokens=8))
    send_generate(make_app(get_settings()), payload, "chat.vllm", 5)
    events = consume(stack, job_id)
    assert [e.kind for e in events] == ["started", "error"]
    error = events[-1].data
    assert error["code"] == "engine_rejected" and error["message"]
    job = stack.store.jobs.get_job(job_id)
    assert job is not None and job.status == "error" and job.error == error["message"]
    assert consume(stack, submit(stack, "chat", max_tokens=4))[-1].kind == "done"


def test_top_p_reaches_the_engine(stack: Stack) -> None:
    """Through the API: a tiny top_p leaves one candidate per step, so two seeds give the
    same tokens at temperature 1; with top_p 1 they sample otherwise."""
    def ids(**sampling: object) -> list[int]:
        events = consume(stack, submit(stack, "chat", max_tokens=16, temperature=1.0,
                                       **sampling))
        return [i for e in events for i in e.token_ids]

    assert ids(top_p=0.001, seed=1) == ids(top_p=0.001, seed=2)
    assert ids(top_p=1.0, seed=1) != ids(top_p=1.0, seed=2)


def test_a_second_delivery_of_a_finished_job_does_not_generate_again(stack: Stack) -> None:
    worker = stack.workers["chat"]
    job_id = submit(stack, "chat", max_tokens=8)
    events = consume(stack, job_id)
    job = stack.store.jobs.get_job(job_id)
    stats = engine_stats(worker)
    assert job is not None
    payload = GeneratePayload(job_id=job_id, lane="chat", prompt="redelivered", prompt_tokens=2,
                              sampling=Sampling(max_tokens=8))
    send_generate(make_app(get_settings()), payload, "chat.vllm", 5)

    skipped = stats["outcomes"].get("skipped-terminal", 0)
    wait_until(lambda: engine_stats(worker)["outcomes"].get("skipped-terminal", 0) > skipped,
               20, "the worker to take the second delivery")
    after = engine_stats(worker)
    assert sum(after["finished_by_reason"].values()) == sum(stats["finished_by_reason"].values())
    assert same(stack.stream_events(job_id), events)
    again = stack.store.jobs.get_job(job_id)
    assert again is not None and again.attempts == job.attempts == 1


def wait_idle(stack: Stack, lane: str) -> None:
    """No job of the lane's worker in flight, so what changes next is the test's own."""
    worker = stack.workers[lane]
    wait_until(lambda: engine_stats(worker, stack.broker_url)["in_flight"] == 0, 60,
               f"{worker} to be idle")


def check_metrics_count_one_job(stack: Stack, lane: str) -> None:
    """Scrapes the API and the lane's worker before and after one job: each of the
    worker's histograms counts it once, in seconds, with the row's figures; the API's
    admitted and the worker's finished counters rise by one."""
    wait_idle(stack, lane)
    with stack.http() as http:
        before_api, before = http.get("/metrics").text, worker_scrape(stack, lane)
        job_id = submit(stack, lane, max_tokens=8)
        consume(stack, job_id)

        def rise(text: str, name: str, was: str = before, **labels: str) -> float:
            return metric(text, name, lane=lane, **labels) - metric(was, name, lane=lane,
                                                                     **labels)

        wait_until(lambda: rise(worker_scrape(stack, lane),
                                "tidegate_e2e_request_latency_seconds_count") > 0, 10,
                   "the worker to count the finished job")
        after, after_api = worker_scrape(stack, lane), http.get("/metrics").text
    job = stack.store.jobs.get_job(job_id)
    assert job is not None and job.finished_at is not None and job.tpot_ms is not None
    figures = {"request_queue_time": job.queue_wait_ms, "time_to_first_token": job.ttft_ms,
               "inter_token_latency": job.tpot_ms,
               "e2e_request_latency": (job.finished_at - job.enqueued_at).total_seconds() * 1000}
    for name, ms in figures.items():
        assert ms is not None, name
        assert rise(after, f"tidegate_{name}_seconds_count") == 1, name
        assert rise(after, f"tidegate_{name}_seconds_sum") == pytest.approx(ms / 1000,
                                                                            abs=1e-5), name
    assert rise(after_api, "tidegate_jobs_admitted_total", was=before_api) == 1
    assert rise(after, "tidegate_jobs_finished_total", status="done") == 1
    assert rise(after, "tidegate_generation_tokens_total") == job.completion_tokens


def test_metrics_count_one_job_with_its_rows_figures(stack: Stack) -> None:
    check_metrics_count_one_job(stack, "chat")


def test_kv_gauges_follow_a_running_load(stack: Stack) -> None:
    """While jobs run, their worker's KV cache usage shows above 0 on its /metrics, and
    back at 0 once they ended; their prompts' tokens were looked up in the prefix cache.
    (Chat: its lane yields the CPU, so this process scrapes while the jobs run.)"""
    worker = stack.workers["chat"]
    wait_idle(stack, "chat")

    def gauge(name: str) -> float:
        return metric(worker_scrape(stack, "chat"), name, worker=worker)

    wait_until(lambda: gauge("tidegate_kv_cache_usage_perc") == 0, 10,
               "KV cache usage at 0 before the jobs")
    queries = gauge("tidegate_prefix_cache_queries_total")
    with ThreadPoolExecutor(8) as pool:
        job_ids = list(pool.map(lambda _: submit(stack, "chat", max_tokens=256), range(8)))
        streams = [pool.submit(consume, stack, j) for j in job_ids]
        wait_until(lambda: gauge("tidegate_kv_cache_usage_perc") > 0, 30,
                   "KV cache usage above 0 while the jobs run")
        assert all(f.result()[-1].kind == "done" for f in streams)
    wait_until(lambda: gauge("tidegate_kv_cache_usage_perc") == 0, 10,
               "KV cache usage back at 0 after the jobs")
    prompt_tokens = sum(job.prompt_tokens for j in job_ids if (job := stack.store.jobs.get_job(j)))
    assert gauge("tidegate_prefix_cache_queries_total") >= queries + prompt_tokens


def test_a_refused_request_is_counted_by_its_type_and_status(stack: Stack) -> None:
    with stack.http() as http:
        before = http.get("/metrics").text
        resp = http.post("/v1/jobs", json={"lane": "chat", "messages": MESSAGES,
                                           "max_tokens": 0})
        assert resp.status_code == 422
        after = http.get("/metrics").text
    name = "tidegate_requests_rejected_total"
    labels = {"reason": "invalid_request", "status": "422"}
    assert metric(after, name, **labels) == metric(before, name, **labels) + 1
    assert metric(after, name) == metric(before, name) + 1  # counted once, nowhere else


def test_readyz_reports_each_dependency_and_fleetz_the_workers(stack: Stack) -> None:
    with stack.http() as http:
        body = http.get("/readyz").json()
        fleet = http.get("/fleetz").json()
    assert body["ready"] is True
    assert set(body["checks"]) == {"redis", "database", "tokenizer"}  # no worker in it
    for lane, name in stack.workers.items():
        assert fleet["lanes"][lane]["ready"] is True
        assert fleet["lanes"][lane]["active"] == {"vllm": [name]}
    assert fleet["workers"]["active"] >= len(stack.workers)
    heartbeat = json.loads(stack.redis.get(keys.worker_heartbeat(stack.namespace,
                                                                 stack.workers["chat"])))
    assert heartbeat["kv_cache_dtype"] == CHAT_KV and heartbeat["state"] == "active"


def test_stream_of_another_tenant_is_not_found(stack: Stack) -> None:
    job_id = submit(stack, "chat", max_tokens=2)
    consume(stack, job_id)
    _, other_key = stack.store.tenants.create_tenant(f"other-{threading.get_ident()}", ["chat"])
    with Client(stack.base_url, other_key) as other:
        for call in (lambda: other.job(job_id), lambda: list(other.stream(job_id))):
            try:
                call()
                raise AssertionError("another tenant's job was visible")
            except Exception as exc:  # TidegateError
                assert getattr(exc, "status", None) == 404


@pytest.mark.skipif(not cpu_fp8_kv_supported(), reason=FP8_SKIP)
def test_status_shows_fp8_kv_cache_holding_about_twice_the_tokens(stack: Stack) -> None:
    def capacity(lane: str) -> int:
        body = json.loads(stack.redis.get(keys.worker_heartbeat(stack.namespace,
                                                                stack.workers[lane])))
        return int(body["stats"]["kv_capacity_tokens"])

    fp16, fp8 = capacity("finance"), capacity("chat")
    assert fp16 > 0 and 1.8 <= fp8 / fp16 <= 2.2
    out = subprocess.run([sys.executable, "-m", "tidegate_tools.cli", "status"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    table = out.split("\n\n")[0]  # the workers; the scheduler's actions may follow
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert str(fp8) in rows[stack.workers["chat"]] and " fp8 " in rows[stack.workers["chat"]]
    assert str(fp16) in rows[stack.workers["finance"]]
    assert " float16 " in rows[stack.workers["finance"]]


def _worker_tree(stack: Stack, lane: str) -> list[Any]:
    import psutil

    supervisor = next(p for p in stack.procs if p.name == f"worker:{stack.workers[lane]}")
    return psutil.Process(supervisor.popen.pid).children(recursive=True)


def _autogroup(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/autogroup").read()
    except OSError:
        return ""  # a kernel without autogroup scheduling


def test_chat_worker_and_its_engine_run_at_the_lanes_cpu_nice(stack: Stack) -> None:
    """The tests' lanes give chat cpu_nice 10 and finance none: ps shows it on the worker
    and on vLLM's engine processes it started, and on the session's autogroup."""
    chat, finance = _worker_tree(stack, "chat"), _worker_tree(stack, "finance")
    assert any(p.name().startswith("VLLM::") for p in chat)  # the engine is in the tree
    assert {p.nice() for p in chat} == {10}
    assert {p.nice() for p in finance} == {0}
    if _autogroup(chat[0].pid):
        assert _autogroup(chat[0].pid).split()[-1] == "10"
        assert _autogroup(finance[0].pid).split()[-1] == "0"


def test_seeded_long_prompts_arriving_at_once_do_not_break_the_engine(stack: Stack) -> None:
    """Long prompts arriving together overflow one step's prefill budget; with a seed each,
    a chunked prefill would kill vLLM's CPU engine core."""
    long_messages = [{"role": "user", "content": "Please summarise the invoice totals and "
                      "the refund status. " * 80}]  # about 1,200 tokens

    def one(seed: int) -> list[Event]:
        with Client(stack.base_url, stack.api_key) as client:
            job = client.submit("chat", messages=long_messages, max_tokens=8, seed=seed,
                                temperature=0.9)
            return list(client.stream(job["job_id"]))

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    assert all(r[-1].kind == "done" for r in results)
    assert engine_stats(stack.workers["chat"])["unfinished"] == 0


def _gauge(metrics: str, name: str, worker: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_prefix_hits_and_allocation_latency_show_in_status_metrics_and_jobs(stack: Stack) -> None:
    """A load sharing one long system prompt: the chat worker's prefix cache hit rate and
    cache allocation latency appear in `/metrics` and `tidegate status` while it runs, and
    the jobs record the prompt tokens they found cached."""
    system = {"role": "system", "content": "You answer for the shop's customer service desk. "
              "Be short, polite and exact about orders, refunds and delivery dates. " * 12}
    worker = stack.workers["chat"]

    def one(n: int) -> str:
        with Client(stack.base_url, stack.api_key) as client:
            job = client.submit("chat", messages=[system, {"role": "user",
                                "content": f"Where is order {n}?"}], max_tokens=32)
            list(client.stream(job["job_id"]))
            return str(job["job_id"])

    def visible() -> bool:
        body = json.loads(stack.redis.get(keys.worker_heartbeat(stack.namespace, worker)))
        s = body["stats"]
        return s["prefix_hits_tokens"] > 0 and s["avg_cache_allocation_latency_ms"] is not None

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(one, n) for n in range(48)]
        wait_until(visible, 120, "the chat worker's heartbeat to show prefix hits")
        metrics = worker_scrape(stack, "chat")
        status = subprocess.run([sys.executable, "-m", "tidegate_tools.cli", "status"], text=True,
                                capture_output=True, timeout=60, check=True).stdout
        job_ids = [f.result() for f in jobs]

    assert (_gauge(metrics, "tidegate_prefix_cache_hits_total", worker) or 0) > 0
    assert (_gauge(metrics, "tidegate_cache_allocation_latency_seconds", worker) or 0) > 0
    row = next(line for line in status.splitlines() if line.startswith(worker))
    hit_cell, alloc_cell = row.split()[11:13]
    assert hit_cell.endswith("%") and float(hit_cell[:-1]) > 0 and float(alloc_cell) > 0
    assert " session " in row
    rows = [stack.store.jobs.get_job(job_id) for job_id in job_ids]
    assert all(r is not None and r.status == "done" for r in rows)
    assert sum(1 for r in rows if r and (r.cached_tokens or 0) > 0) >= len(rows) // 2
