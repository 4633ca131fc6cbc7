"""Usage and budgets (issue 30): a stack of its own (the API, the batch driver and a chat
worker hosting vLLM on CPU, on its own Redis database, or 27 for PostgreSQL) runs jobs of two
tenants
through the native route, the OpenAI chat route and the Batch API, and a job cancelled
while it runs. The usage ledger, read back through GET /admin/v1/usage (JSON and CSV) and
GET /v1/usage, equals the sum of the job rows' tokens and ends exactly; a spent monthly
budget answers 429 `quota_exceeded` on the three routes; the `openai` client reads the
x-ratelimit-* headers, and the max_tokens a job did not use come back to its tenant's
token window when it ends."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from store import Store, upgrade
from store.tenants import Tenants
from tests.helpers import Stack, own_db, postgres_or_skip
from tidegate.ratelimit import TOKENS, RateLimits
from tidegate_tools.pg import private_database
from tidegate_tools.procs import wait_until
from tidegate_tools.stack import WorkerSpec, running_stack

MODEL = "tidegate-test"
USER: Any = [{"role": "user", "content": "Where is my parcel?"}]
WORKER = "chat-usage@tidegate"
KINDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "jobs_done", "jobs_error",
         "jobs_cancelled", "jobs_expired")
TPM, RPM = 100_000, 1000


class UsageStack:
    def __init__(self, stack: Stack, admin_key: str) -> None:
        self.stack, self.admin_key = stack, admin_key
        self.store = stack.store

    def tenant(self, name: str, **limits: Any) -> tuple[int, str]:
        record, key = self.store.tenants.create_tenant(name, ["chat", "batch"], **limits)
        return record.id, key

    def get(self, path: str, key: str, **params: str) -> httpx.Response:
        return httpx.get(f"{self.stack.base_url}{path}", params=params, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})

    def sdk(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.stack.base_url}/v1", api_key=key,
                             max_retries=0, timeout=120)


def _database(kind: str, tmp_root: Path) -> Any:
    """A database of the module's own: PostgreSQL's private one, or a SQLite file."""
    if kind == "postgresql":
        postgres_or_skip()
        return private_database("tidegate_usage")
    path = tmp_root / "usage.db"
    path.unlink(missing_ok=True)
    return contextlib.nullcontext(f"sqlite:///{path}")


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql",
                                                               marks=pytest.mark.postgres)])
def usage(request: pytest.FixtureRequest, redis_server: str, model_path: Path,
          tmp_root: Path) -> Iterator[UsageStack]:
    kind = request.param
    db = own_db(__name__, kind)
    redis_url = redis_server.rsplit("/", 1)[0] + f"/{db}"
    namespace = f"tgusage{db}"
    with _database(kind, tmp_root) as url:
        upgrade(url)
        store = Store(url)
        admin_key = Tenants(store).create_admin_key("usage-admin")
        env = {**os.environ, "TIDEGATE_DATABASE_URL": url, "TIDEGATE_REDIS_URL": redis_url,
               "TIDEGATE_NAMESPACE": namespace}
        client = redis.Redis.from_url(redis_url)
        try:
            with running_stack(env, [WorkerSpec("chat", WORKER, cpus="1")],
                               tmp_root / "logs") as running:
                stack = Stack(running.base_url, "", 0, client, store, namespace,
                              {"chat": WORKER}, running.procs, broker_url=redis_url)
                yield UsageStack(stack, admin_key)
        finally:
            client.flushdb()
            store.engine.dispose()  # before a PostgreSQL database is dropped


# -- helpers ------------------------------------------------------------------------------


def submit(u: UsageStack, key: str, max_tokens: int = 6, **extra: Any) -> httpx.Response:
    return httpx.post(f"{u.stack.base_url}/v1/jobs", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"lane": "chat", "messages": USER, "max_tokens": max_tokens,
                            "temperature": 0, **extra})


def wait_ended(u: UsageStack, tenant_id: int) -> None:
    """Every job of the tenant has its end written (finished_at)."""
    def ended() -> bool:
        jobs = u.store.jobs.list_jobs(tenant_id, limit=1000)
        return bool(jobs) and all(job.finished_at is not None for job in jobs)

    wait_until(ended, 180, "the tenant's jobs to end", u.stack.procs, poll_s=0.3)


def row_sums(u: UsageStack, tenant_id: int) -> dict[str, dict[str, int]]:
    """Per lane, what the ledger must hold: the tenant's job rows' tokens and ends (a job's
    prompt tokens count once a worker took it)."""
    sums: dict[str, Counter[str]] = {}
    for job in u.store.jobs.list_jobs(tenant_id, limit=1000):
        lane = sums.setdefault(job.lane, Counter())
        lane["prompt_tokens"] += job.prompt_tokens if job.started_at is not None else 0
        lane["cached_tokens"] += job.cached_tokens or 0
        lane["completion_tokens"] += job.completion_tokens or 0
        lane[f"jobs_{job.status.value}"] += 1
    return {lane: {k: counts[k] for k in KINDS} for lane, counts in sums.items()}


def ledger_sums(rows: list[dict[str, Any]], tenant: str) -> dict[str, dict[str, int]]:
    """The ledger's rows of `tenant`, per lane, over the days asked."""
    sums: dict[str, Counter[str]] = {}
    for row in rows:
        if row["tenant"] == tenant:
            lane = sums.setdefault(row["lane"], Counter())
            for k in KINDS:
                lane[k] += int(row[k])
    return {lane: {k: counts[k] for k in KINDS} for lane, counts in sums.items()}


def days() -> dict[str, str]:
    """A range around today (UTC): a job that ended just before midnight is in it."""
    today = datetime.now(UTC).date()
    return {"start_date": (today - timedelta(days=1)).isoformat(),
            "end_date": (today + timedelta(days=1)).isoformat()}


def run_batch(u: UsageStack, key: str, lines: int) -> str:
    client = u.sdk(key)
    body = "\n".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 5, "temperature": 0,
                 "messages": [{"role": "user", "content": f"Order {i}: where is it?"}]}})
        for i in range(lines)).encode()
    upload = client.files.create(file=("orders.jsonl", io.BytesIO(body)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")

    def ended() -> bool:
        return client.batches.retrieve(batch.id).status in ("completed", "failed",
                                                           "cancelled", "expired")

    wait_until(ended, 240, "the batch to end", u.stack.procs, poll_s=0.5)
    assert client.batches.retrieve(batch.id).status == "completed"
    return batch.id


def cancel_while_running(u: UsageStack, key: str, tenant_id: int) -> None:
    """A long job cancelled once a worker has it: its worker writes its end (and usage)."""
    job_id = submit(u, key, max_tokens=256).json()["job_id"]
    wait_until(lambda: (job := u.store.jobs.get_job(job_id)) is not None
               and job.started_at is not None, 120, "the long job to start", u.stack.procs)
    gone = httpx.delete(f"{u.stack.base_url}/v1/jobs/{job_id}", timeout=30,
                        headers={"Authorization": f"Bearer {key}"})
    assert gone.status_code == 200, gone.text


# -- the ledger ---------------------------------------------------------------------------


def test_the_ledger_equals_the_job_rows_per_tenant_and_lane(usage: UsageStack) -> None:
    a_id, a_key = usage.tenant("usage-a")
    b_id, b_key = usage.tenant("usage-b")
    for _ in range(2):
        assert submit(usage, a_key).status_code == 202
    usage.sdk(a_key).chat.completions.create(model=MODEL, messages=USER, max_tokens=7,
                                             temperature=0)
    cancel_while_running(usage, a_key, a_id)
    assert submit(usage, b_key, max_tokens=9).status_code == 202
    usage.sdk(b_key).chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                             temperature=0)
    run_batch(usage, b_key, lines=2)
    wait_ended(usage, a_id)
    wait_ended(usage, b_id)

    listed = usage.get("/admin/v1/usage", usage.admin_key, **days())
    assert listed.status_code == 200, listed.text
    rows = listed.json()["data"]
    want_a, want_b = row_sums(usage, a_id), row_sums(usage, b_id)
    assert set(want_a) == {"chat"} and set(want_b) == {"chat", "batch"}
    assert want_a["chat"]["jobs_done"] >= 3 and want_b["batch"]["jobs_done"] == 2
    assert want_a["chat"]["jobs_done"] + want_a["chat"]["jobs_cancelled"] == 4
    assert want_a["chat"]["completion_tokens"] > 0 and want_b["batch"]["prompt_tokens"] > 0
    assert ledger_sums(rows, "usage-a") == want_a
    assert ledger_sums(rows, "usage-b") == want_b
    total = listed.json()["total"]
    assert total["total_tokens"] == sum(r["total_tokens"] for r in rows)

    # CSV: the same rows.
    as_csv = usage.get("/admin/v1/usage", usage.admin_key, format="csv", **days())
    assert as_csv.status_code == 200 and as_csv.headers["content-type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [{k: str(v) for k, v in row.items()} for row in rows] == parsed

    # A tenant sees its own usage only, and the same figures.
    own_b = usage.get("/v1/usage", b_key, **days())
    assert own_b.status_code == 200, own_b.text
    assert {row["tenant"] for row in own_b.json()["data"]} == {"usage-b"}
    assert ledger_sums(own_b.json()["data"], "usage-b") == want_b
    batch_only = usage.get("/v1/usage", b_key, lane="batch", **days()).json()["data"]
    assert ledger_sums(batch_only, "usage-b") == {"batch": want_b["batch"]}
    one = usage.get("/admin/v1/usage", usage.admin_key, tenant="usage-a", **days()).json()
    assert {row["tenant"] for row in one["data"]} == {"usage-a"}


def test_bad_usage_queries_are_400s_naming_the_field(usage: UsageStack) -> None:
    _, key = usage.tenant("usage-queries")
    cases = [({"start_date": "2026-13-01"}, "start_date"), ({"end_date": "yesterday"}, "end_date"),
             ({"start_date": "2026-12-06", "end_date": "2026-12-01"}, "end_date"),
             ({"start_date": "2024-01-01", "end_date": "2026-01-01"}, "end_date"),
             ({"lane": "nope"}, "lane"), ({"format": "xml"}, "format"),
             ({"tenant": "usage-a"}, "tenant")]  # an admin's parameter, not a tenant's
    for params, field in cases:
        resp = usage.get("/v1/usage", key, **params)
        assert resp.status_code == 400, (params, resp.text)
        assert resp.json()["error"]["field"] == field
    assert usage.get("/admin/v1/usage", key).status_code == 401  # a tenant's key
    assert usage.get("/v1/usage", usage.admin_key).status_code == 401  # an admin's key
    unknown = usage.get("/admin/v1/usage", usage.admin_key, tenant="no-such-tenant")
    assert unknown.status_code == 404


# -- budgets --------------------------------------------------------------------------------


def test_a_spent_budget_answers_429_quota_exceeded_on_every_route(usage: UsageStack) -> None:
    tenant_id, key = usage.tenant("usage-budget")
    set_budget = httpx.patch(f"{usage.stack.base_url}/admin/v1/tenants/usage-budget",
                             json={"monthly_token_budget": 1}, timeout=30,
                             headers={"Authorization": f"Bearer {usage.admin_key}"})
    assert set_budget.status_code == 200 and set_budget.json()["monthly_token_budget"] == 1
    assert submit(usage, key).status_code == 202  # nothing used yet this month
    wait_ended(usage, tenant_id)

    refused: list[httpx.Response] = []

    def spent() -> bool:  # the API reads a month's usage at most every 2 s
        resp = submit(usage, key)
        if resp.status_code == 429:
            refused.append(resp)
        return bool(refused)

    wait_until(spent, 30, "the spent budget to be refused", usage.stack.procs, poll_s=0.5)
    error = refused[0].json()["error"]
    assert error["type"] == "quota_exceeded" and "1 tokens this month" in error["message"]
    assert int(refused[0].headers["Retry-After"]) > 0
    jobs = usage.store.jobs.count_jobs()

    client = usage.sdk(key)
    with pytest.raises(openai.RateLimitError) as chat:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert chat.value.code == "quota_exceeded"
    assert chat.value.response.headers["x-should-retry"] == "false"
    upload = client.files.create(file=("b.jsonl", io.BytesIO(json.dumps({
        "custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": USER, "max_tokens": 2}}).encode())),
        purpose="batch")
    with pytest.raises(openai.RateLimitError) as batch:
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert batch.value.code == "quota_exceeded"
    assert usage.store.jobs.count_jobs() == jobs  # nothing enqueued

    raised = httpx.patch(f"{usage.stack.base_url}/admin/v1/tenants/usage-budget",
                         json={"monthly_token_budget": 10_000_000}, timeout=30,
                         headers={"Authorization": f"Bearer {usage.admin_key}"})
    assert raised.status_code == 200
    wait_until(lambda: submit(usage, key).status_code == 202, 30,
               "a raised budget to admit again", usage.stack.procs, poll_s=0.5)


# -- rate limit headers and the refund --------------------------------------------------------


def test_the_openai_client_reads_rate_limit_headers_and_a_refund_shows(
        usage: UsageStack) -> None:
    tenant_id, key = usage.tenant("usage-limited", requests_per_minute=RPM,
                                  tokens_per_minute=TPM)
    started = time.monotonic()
    # A long job cancelled early: its worker gives back the max_tokens it did not use.
    cancel_while_running(usage, key, tenant_id)
    wait_ended(usage, tenant_id)
    (long_job,) = usage.store.jobs.list_jobs(tenant_id)
    assert long_job.completion_tokens is not None and long_job.completion_tokens < 256
    used = long_job.prompt_tokens + long_job.completion_tokens  # charged, less the refund
    limiter = RateLimits(usage.stack.redis, usage.stack.namespace)
    wait_until(lambda: limiter.window(TOKENS, tenant_id, TPM).remaining >= TPM - used, 10,
               "the unused max_tokens to come back", usage.stack.procs)

    raw = usage.sdk(key).chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0)
    done = raw.parse()
    headers = raw.headers
    assert headers["x-ratelimit-limit-requests"] == str(RPM)
    assert headers["x-ratelimit-limit-tokens"] == str(TPM)
    assert headers["x-ratelimit-remaining-requests"] == str(RPM - 2)
    remaining = int(headers["x-ratelimit-remaining-tokens"])
    charged = done.usage.prompt_tokens + 4 if done.usage else 0
    if time.monotonic() - started < 50:  # one window: no weighing of a previous one
        assert remaining == TPM - used - charged
    else:  # the window moved on: the older charges weigh less, never more
        assert TPM - used - charged <= remaining <= TPM
    assert remaining > TPM - (long_job.prompt_tokens + 256) - charged  # the refund shows
    for kind in ("requests", "tokens"):
        reset = headers[f"x-ratelimit-reset-{kind}"]
        assert reset.endswith("s") and reset[0].isdigit(), reset  # `1m59.9s`, `59s`, `20ms`


def test_no_rate_limit_headers_without_limits(usage: UsageStack) -> None:
    _, key = usage.tenant("usage-unlimited")
    raw = usage.sdk(key).chat.completions.with_raw_response.create(
        model=MODEL, messages=USER, max_tokens=2, temperature=0)
    assert not [name for name in raw.headers if name.startswith("x-ratelimit-")]
