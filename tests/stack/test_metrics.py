"""Metrics by the book, scraped from every process of a running stack: the session stack
(two vLLM workers, finance and chat, one API), a second API process and a scheduler on the
same Redis and database. A small mixed load goes through both APIs, with refused requests;
then every process's /metrics is parsed and checked against docs/operations.md's table (name,
type, unit, labels, which process serves it), and the numbers a user would read: the two
APIs' admissions add up to the jobs submitted, each API counting only its own; the
workers' finished jobs add up to the jobs run; vLLM's own metrics are on the workers'.

`scraped` (module fixture) holds every process's metric families after the load, for any
later check (the dashboard's and the alerts' metric names, at the end of this module).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Stack, answers
from tidegate_tools.procs import (
    Proc,
    free_port,
    start_api,
    start_scheduler,
    tidegate_argv,
    wait_until,
)
from tidegate_tools.stack import api_ready

ROOT = Path(__file__).resolve().parents[2]
Families = dict[str, Metric]  # a scrape: metric families by name (counters without _total)
# Jobs sent through each API: (lane, count).
LOAD = {"api-1": (("finance", 1), ("chat", 2)), "api-2": (("finance", 1), ("chat", 1))}


@dataclass(frozen=True)
class Row:
    """One metric of the docs' table (docs/operations.md, "Metrics")."""

    type: str
    unit: str
    labels: frozenset[str]
    served_by: frozenset[str]  # api, worker, scheduler


def readme_table() -> dict[str, Row]:
    """The table under "## Metrics" in docs/operations.md: name -> Row."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`tidegate_"):
            name, kind, unit, labels, served, _ = cells
            rows[name.strip("`")] = Row(kind, unit, _set(labels), _set(served))
    return rows


def _set(cell: str) -> frozenset[str]:
    return frozenset(part.strip() for part in cell.split(",") if part.strip())


def scrape(url: str) -> Families:
    text = httpx.get(url, timeout=10).raise_for_status().text
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape_all(targets: dict[str, str]) -> dict[str, Families]:
    """{process: its metric families}, for {process: its /metrics URL}."""
    return {process: scrape(url) for process, url in targets.items()}


def value(families: Families, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0: none)."""
    family = families.get(re.sub(r"_(total|bucket|sum|count)$", "", name))
    return sum(s.value for s in (family.samples if family else [])
               if s.name == name and labels.items() <= s.labels.items())


def kind_of(process: str) -> str:
    return process.split("-", 1)[0]  # api-1 -> api, worker-chat -> worker


@pytest.fixture(scope="module")
def targets(stack: Stack, tmp_root: Path) -> Iterator[dict[str, str]]:
    """Every process's /metrics URL: the session stack's API and workers, and a second API
    and a scheduler started here (stopped on the way out)."""
    logs, env = tmp_root / "logs", dict(os.environ)
    port = free_port()
    procs: list[Proc] = [start_api(env, port, logs),
                         start_scheduler({**env, "TIDEGATE_SCHEDULER_TICK_S": "3600"}, logs,
                                         name="scheduler-metrics")]
    try:
        second = f"http://127.0.0.1:{port}"
        wait_until(lambda: api_ready(second, []), 120, "the second API", procs)
        urls = {"api-1": f"{stack.base_url}/metrics", "api-2": f"{second}/metrics",
                "scheduler": f"http://127.0.0.1:{procs[1].metrics_port}/metrics"}
        for proc in stack.procs:
            if proc.name.startswith("worker:") and proc.metrics_port:
                lane = next(lane for lane, name in stack.workers.items()
                            if proc.name == f"worker:{name}")
                urls[f"worker-{lane}"] = f"http://127.0.0.1:{proc.metrics_port}/metrics"
        wait_until(lambda: answers(urls["scheduler"]), 120, "the scheduler's /metrics", procs)
        yield urls
    finally:
        for proc in procs:
            proc.stop()



@dataclass
class Load:
    before: dict[str, Families]
    after: dict[str, Families]
    job_ids: list[str]


@pytest.fixture(scope="module")
def load(stack: Stack, targets: dict[str, str]) -> Load:
    """A few jobs on each lane through each API, one refused request on each, every job
    waited to its end; scrapes before and after."""
    wait_until(lambda: not stack.store.jobs.in_flight_by_lane(), 180,
               "earlier tests' jobs to end (the workers' counts are compared)")
    before = scrape_all(targets)
    job_ids = []
    for api, lanes in LOAD.items():
        base = targets[api].removesuffix("/metrics")
        with httpx.Client(base_url=base, timeout=60,
                          headers={"Authorization": f"Bearer {stack.api_key}"}) as http:
            for lane, count in lanes:
                for i in range(count):
                    resp = http.post("/v1/jobs", json={
                        "lane": lane, "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"metrics {api} {i}"}]})
                    assert resp.status_code == 202, resp.text
                    job_ids.append(resp.json()["job_id"])
            bad = http.post("/v1/jobs", json={"lane": "gold", "messages": [
                {"role": "user", "content": "hi"}]})
            assert bad.status_code == 422
            assert httpx.get(f"{base}/v1/jobs", timeout=10).status_code == 401

    def ended() -> bool:
        return all((job := stack.store.jobs.get_job(j)) is not None and job.terminal
                   for j in job_ids)

    wait_until(ended, 300, "the load's jobs to end", stack.procs)

    def counted() -> bool:  # a worker counts a job just after its row ends
        now = scrape_all({p: u for p, u in targets.items() if kind_of(p) == "worker"})
        return finished(now) - finished(before) >= len(job_ids)

    wait_until(counted, 30, "the workers to count the load's jobs")
    return Load(before, scrape_all(targets), job_ids)


def finished(scrapes: dict[str, Families]) -> float:
    return sum(value(f, "tidegate_jobs_finished_total") for p, f in scrapes.items()
               if kind_of(p) == "worker")


def test_every_scrape_matches_the_readme_table(load: Load) -> None:
    table = readme_table()
    assert len(table) >= 20, "docs/operations.md's metrics table was not found"
    for process, families in load.after.items():
        served = {name for name, row in table.items() if kind_of(process) in row.served_by}
        seen = set()
        for family in families.values():
            if not family.name.startswith("tidegate_"):
                continue
            name = family.name + ("_total" if family.type == "counter" else "")
            seen.add(name)
            assert name in served, f"{process} serves {name}, which the docs' table " \
                                   "does not list for it"
            row = table[name]
            assert family.type == row.type, f"{name}: {family.type}, the docs say {row.type}"
            assert (row.unit == "seconds") == name.endswith("_seconds"), name
            assert "_ms" not in name and "milli" not in name, name
            for sample in family.samples:
                labels = set(sample.labels) - ({"le"} if family.type == "histogram" else set())
                assert labels == row.labels, f"{process} {sample.name}: labels {labels}, " \
                                             f"the docs say {set(row.labels)}"
        assert served <= seen, f"{process} does not serve {sorted(served - seen)}"


def test_admissions_add_up_across_two_api_processes(load: Load) -> None:
    rise = {api: value(load.after[api], "tidegate_jobs_admitted_total")
            - value(load.before[api], "tidegate_jobs_admitted_total") for api in LOAD}
    assert rise == {api: sum(n for _, n in lanes) for api, lanes in LOAD.items()}
    assert sum(rise.values()) == len(load.job_ids)
    for api in LOAD:  # each refused its own bad lane and its own missing key, once
        for reason, status in (("invalid_request", "422"), ("unauthorized", "401")):
            name, labels = "tidegate_requests_rejected_total", {"reason": reason,
                                                                "status": status}
            assert value(load.after[api], name, **labels) \
                - value(load.before[api], name, **labels) == 1, (api, reason)


def test_workers_count_the_jobs_they_ran_with_their_timings(load: Load, stack: Stack) -> None:
    assert finished(load.after) - finished(load.before) == len(load.job_ids)
    for lane in ("finance", "chat"):
        after, before = load.after[f"worker-{lane}"], load.before[f"worker-{lane}"]
        jobs = sum(n for lanes in LOAD.values() for name, n in lanes if name == lane)
        for hist in ("tidegate_time_to_first_token_seconds", "tidegate_e2e_request_latency_seconds",
                     "tidegate_request_queue_time_seconds"):
            assert value(after, f"{hist}_count", lane=lane) \
                - value(before, f"{hist}_count", lane=lane) == jobs, (lane, hist)
        e2e = value(after, "tidegate_e2e_request_latency_seconds_sum", lane=lane) \
            - value(before, "tidegate_e2e_request_latency_seconds_sum", lane=lane)
        assert 0 < e2e < 300 * jobs  # seconds, not milliseconds
        assert value(after, "tidegate_generation_tokens_total", lane=lane) \
            - value(before, "tidegate_generation_tokens_total", lane=lane) >= jobs
        assert value(after, "tidegate_prompt_tokens_total", lane=lane) \
            > value(before, "tidegate_prompt_tokens_total", lane=lane)
        assert value(after, "tidegate_worker_state", state="active") == 1
        assert 0 <= value(after, "tidegate_kv_cache_usage_perc") <= 1
        assert any(name.startswith("vllm:") for name in after), \
            f"the {lane} worker's scrape has no vllm: metric"
        assert value(after, "vllm:request_success_total") > 0


def test_the_scheduler_serves_the_fleet(load: Load, stack: Stack) -> None:
    from tidegate.settings import get_settings

    fleet = load.after["scheduler"]
    for lane in ("finance", "chat"):
        assert value(fleet, "tidegate_workers", lane=lane, pool="vllm", state="active") == 1
        objective = get_settings().lanes[lane].ttft_p99_objective_ms / 1000
        assert value(fleet, "tidegate_lane_ttft_p99_objective_seconds", lane=lane) == objective
        depths = [s for s in fleet["tidegate_queue_depth"].samples if s.labels["lane"] == lane]
        assert sorted(int(s.labels["priority"]) for s in depths) == list(range(10))
    assert value(fleet, "tidegate_jobs_in_flight") == 0  # the load has ended


def test_no_label_carries_a_job_or_tenant_id(load: Load, stack: Stack) -> None:
    tenant = stack.store.tenants.list_tenants()
    names = {t.name for t in tenant if t.id == stack.tenant_id}
    ids = set(load.job_ids) | names
    for process, families in load.after.items():
        for family in families.values():
            for sample in family.samples:
                assert not {"job", "job_id", "tenant", "tenant_id"} & set(sample.labels), \
                    (process, sample)
                assert not ids & set(sample.labels.values()), (process, sample)


def test_every_metric_the_dashboard_and_alerts_read_is_served(load: Load) -> None:
    """Every tidegate_ and vllm: series the Grafana dashboard and the alert rules read
    (tests/promql.py walks their PromQL) is served by some process of the stack."""
    from tests import promql

    exprs = promql.deploy_expressions()
    if not exprs:
        pytest.skip("no dashboard or alert rules under deploy/ yet")
    recorded = {str(rule["record"]) for path in promql.RULE_FILES
                for rule in promql.alert_rules(path) if "record" in rule}
    served = {series for families in load.after.values() for family in families.values()
              for series in promql.family_series(family)}
    wanted = {name for expr in exprs for name in promql.metric_names_in(expr)
              if name.startswith(("tidegate_", "vllm:"))} - recorded
    assert wanted, "no tidegate_ or vllm: metric in the deploy files' expressions"
    assert not wanted - served, "read by the dashboard or alerts, served by no process: " \
                                f"{sorted(wanted - served)}"


def test_a_worker_whose_metrics_port_is_taken_stops_at_start_naming_it(tmp_root: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = tidegate_argv("worker", "--lane", "chat", "--name", "port-taken@tidegate",
                             "--metrics-port", str(port))
        proc = Proc("worker:port-taken", argv, tmp_root / "logs" / "worker-port-taken.log",
                    dict(os.environ))
        try:
            wait_until(lambda: not proc.alive(), 60, "the worker to stop")
            assert proc.popen.returncode != 0
            assert "TIDEGATE_WORKER_METRICS_PORT" in proc.tail() and str(port) in proc.tail()
        finally:
            proc.stop()
