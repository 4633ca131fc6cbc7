"""The PromQL of the deploy files: the Grafana dashboard's queries and the Prometheus alert
rules, ready to parse, and the metric names each one reads.

Used by tests/unit/test_dashboard.py (every expression parses, names only catalogued
metrics) and by the stack test of the metrics, which checks those names against a live
scrape of every process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import yaml
from prometheus_client import Metric

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana").rglob("*.json"))
RULE_FILES = sorted(p for p in (DEPLOY / "prometheus").glob("*.yml")
                    if p.name != "prometheus.yml" and not p.name.endswith("_test.yml"))

# Values for Grafana's template variables, so a dashboard query parses as Prometheus
# would receive it: the interval variables stand in a range selector, the others in a
# label matcher's string.
_SAMPLE_VALUES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h",
                  "__range_s": "3600"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
# Grafana's Prometheus variable functions around a PromQL selector or expression.
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\((.*)\)\s*$", re.S)

# The metric catalogue (docs/operations.md, "Metrics"): every family the processes
# export, with its type; histograms are read through their _bucket/_sum/_count series.
CATALOGUE = {
    "tidegate_jobs_admitted_total": "counter",
    "tidegate_requests_rejected_total": "counter",
    "tidegate_sse_streams": "gauge",
    "tidegate_request_queue_time_seconds": "histogram",
    "tidegate_time_to_first_token_seconds": "histogram",
    "tidegate_inter_token_latency_seconds": "histogram",
    "tidegate_e2e_request_latency_seconds": "histogram",
    "tidegate_prompt_tokens_total": "counter",
    "tidegate_generation_tokens_total": "counter",
    "tidegate_jobs_finished_total": "counter",
    "tidegate_jobs_resumed_total": "counter",
    "tidegate_usage_tokens_total": "counter",
    "tidegate_num_requests_running": "gauge",
    "tidegate_num_requests_waiting": "gauge",
    "tidegate_kv_cache_usage_perc": "gauge",
    "tidegate_prefix_cache_queries_total": "counter",
    "tidegate_prefix_cache_hits_total": "counter",
    "tidegate_cache_allocation_latency_seconds": "gauge",
    "tidegate_worker_state": "gauge",
    "tidegate_queue_depth": "gauge",
    "tidegate_jobs_in_flight": "gauge",
    "tidegate_workers": "gauge",
    "tidegate_lane_ttft_p99_objective_seconds": "gauge",
    "tidegate_recoveries_total": "counter",
    "tidegate_poison_jobs_total": "counter",
    "tidegate_webhook_backlog": "gauge",
    "tidegate_webhook_oldest_pending_seconds": "gauge",
}


def series_names() -> set[str]:
    """Every series name a query may read: the catalogue, histograms by their suffixes."""
    names: set[str] = set()
    for family, kind in CATALOGUE.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        names.update(family + suffix for suffix in suffixes)
    return names


# The series names a family of each type exposes (a counter's family name lacks `_total`
# in prometheus_client's parser).
_SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("", "_sum", "_count")}


def family_series(family: Metric) -> set[str]:
    """The series names a query may select from a scraped family (prometheus_client's
    parser): its samples' names, and the names it would have with no sample yet (a
    labelled counter nothing has counted, such as the poison jobs)."""
    suffixes = _SERIES_SUFFIXES.get(family.type, ("",))
    return {sample.name for sample in family.samples} | {family.name + s for s in suffixes}


def scraped_names(text: str) -> set[str]:
    """Every series name a query may select from a scrape in the text format."""
    from prometheus_client.parser import text_string_to_metric_families

    return {name for family in text_string_to_metric_families(text)
            for name in family_series(family)}


def family_of(name: str) -> str:
    """The catalogue family a series name belongs to (a histogram's, for its suffixes)."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and CATALOGUE.get(base) == "histogram":
            return base
    return name


def substitute(expr: str) -> str:
    """`expr` with Grafana's template variables replaced by sample values."""
    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return _SAMPLE_VALUES.get(name, "finance")

    return _VARIABLE.sub(value, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def _variable_query(variable: dict[str, Any]) -> str | None:
    if variable.get("type") != "query":
        return None
    query = variable.get("query")
    text = query.get("query", "") if isinstance(query, dict) else str(query or "")
    for wrapper in (_LABEL_VALUES, _QUERY_RESULT):
        if match := wrapper.match(text):
            return match.group(1)
    return text or None


def dashboard_expressions(path: Path) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: its panels' targets and its query
    variables, template variables still in."""
    board = json.loads(path.read_text())
    exprs = [target["expr"] for panel in _panels(board.get("panels", []))
             for target in panel.get("targets", []) if target.get("expr")]
    variables = board.get("templating", {}).get("list", [])
    exprs += [q for q in map(_variable_query, variables) if q]
    return exprs


def alert_rules(path: Path) -> list[dict[str, Any]]:
    """The rules of a Prometheus rule file, in the order written."""
    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def deploy_expressions() -> list[str]:
    """Every PromQL expression of the deploy files (dashboards, then rules), with Grafana's
    template variables replaced, ready for promql_parser.parse."""
    exprs = [e for board in DASHBOARDS for e in dashboard_expressions(board)]
    exprs += [str(rule["expr"]) for path in RULE_FILES for rule in alert_rules(path)]
    return [substitute(e) for e in exprs]


def metric_names_in(expr: str) -> set[str]:
    """The metric names an expression selects (vector and range selectors)."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        selector = node.vector_selector if isinstance(node, promql_parser.MatrixSelector) \
            else node
        if isinstance(selector, promql_parser.VectorSelector):
            names.update(_selector_names(selector))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _selector_names(selector: promql_parser.VectorSelector) -> set[str]:
    if selector.name:
        return {selector.name}
    # `{__name__="..."}`: the name as an equality matcher
    return {m.value for m in selector.matchers.matchers
            if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal}
