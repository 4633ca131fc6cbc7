"""The monitoring deploy files: the Grafana dashboard (deploy/grafana/dashboards/) and the
Prometheus alert rules (deploy/prometheus/). Every expression parses and reads only metrics
of the catalogue, the dashboard shows every catalogued metric, each alert links a runbook
section that exists in docs/operations.md, and, where promtool is installed, Prometheus' own
checker accepts the files and the alerts fire on the series their unit tests feed them.
The stack test of the metrics checks the same names against a live scrape.
"""

from __future__ import annotations

import json
import re

import promql_parser
import pytest

from tests.promql import (
    CATALOGUE,
    DASHBOARDS,
    DEPLOY,
    ROOT,
    RULE_FILES,
    alert_rules,
    dashboard_expressions,
    deploy_expressions,
    family_of,
    metric_names_in,
    scraped_names,
    series_names,
    substitute,
)

RUNBOOK_BASE = "https://github.com/tidegate/tidegate/blob/main/docs/operations.md#"
OPERATIONS = ROOT / "docs" / "operations.md"
PROMETHEUS = DEPLOY / "prometheus"


def _rules() -> list[dict]:
    return [rule for path in RULE_FILES for rule in alert_rules(path)]


def _ops_section(heading: str) -> str:
    """docs/operations.md's text under `heading` (a `## ` line), up to the next `## `."""
    text = OPERATIONS.read_text()
    start = text.index(f"\n{heading}\n")
    end = re.search(r"\n## ", text[start + 1:])
    return text[start: start + 1 + end.start()] if end else text[start:]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_deploy_files_are_found() -> None:
    assert [p.name for p in DASHBOARDS] == ["tidegate.json"]
    assert [p.name for p in RULE_FILES] == ["alerts.yml"]
    assert len(deploy_expressions()) > 30


@pytest.mark.parametrize("expr", deploy_expressions())
def test_every_expression_parses(expr: str) -> None:
    promql_parser.parse(expr)


@pytest.mark.parametrize("expr", [
    'sum by (lane (rate(tidegate_jobs_admitted_total[5m]))',  # unbalanced parenthesis
    "rate(tidegate_jobs_admitted_total[$__rate_interval])",  # a variable left in
    'histogram_quantile(0.99, tidegate_time_to_first_token_seconds_bucket{lane=~"$lane"}) >',
])
def test_a_broken_expression_fails_to_parse(expr: str) -> None:
    with pytest.raises(ValueError):
        promql_parser.parse(expr)


def test_template_variables_become_sample_values() -> None:
    assert substitute('rate(x{lane=~"$lane"}[$__rate_interval])') == \
        'rate(x{lane=~"finance"}[5m])'
    assert substitute('x{lane=~"${lane:regex}"}') == 'x{lane=~"finance"}'


def test_metric_names_come_from_every_selector() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, lane) (rate(a_bucket[5m]))) '
            '> on (lane) max by (lane) (b) unless {__name__="c"}')
    assert metric_names_in(expr) == {"a_bucket", "b", "c"}


def test_a_scrape_names_the_series_of_families_with_no_sample_yet() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    Counter("tidegate_poison_jobs_total", "", ["lane"], registry=registry)
    Histogram("tidegate_e2e_request_latency_seconds", "", ["lane"], registry=registry)
    Gauge("tidegate_webhook_backlog", "", registry=registry).set(3)
    names = scraped_names(generate_latest(registry).decode())
    assert {"tidegate_poison_jobs_total", "tidegate_e2e_request_latency_seconds_bucket",
            "tidegate_e2e_request_latency_seconds_count",
            "tidegate_webhook_backlog"} <= names


def test_every_metric_read_is_catalogued_and_the_dashboard_shows_them_all() -> None:
    used = {name for expr in deploy_expressions() for name in metric_names_in(expr)}
    assert used - series_names() == set()
    shown = {family_of(name) for board in DASHBOARDS
             for expr in dashboard_expressions(board) for name in metric_names_in(substitute(expr))}
    assert set(CATALOGUE) - shown == set()


def test_the_docs_metrics_table_lists_the_catalogue() -> None:
    section = _ops_section("## Metrics")
    listed = set(re.findall(r"\btidegate_[a-z0-9_]+", section))
    if not listed:
        pytest.skip("docs/operations.md's Metrics section has no metric table yet")
    assert set(CATALOGUE) - listed == set()


def test_the_dashboard_is_importable_and_filters_by_lane() -> None:
    board = json.loads(DASHBOARDS[0].read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["lane"]["includeAll"] and variables["lane"]["allValue"] == ".*"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    queried = [p for p in panels if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in queried)
    # every query of a lane-labelled metric follows the lane picker
    exprs = [t["expr"] for p in queried for t in p["targets"]]
    assert [e for e in exprs if "lane" in e and 'lane=~"$lane"' not in e] == []


def _panel_reading(board: dict, metric: str) -> dict:
    return next(p for p in board["panels"] if any(metric in t.get("expr", "")
                                                  for t in p.get("targets", [])))


def test_the_allocation_panel_draws_the_200_ms_line_and_ttft_its_objective() -> None:
    board = json.loads(DASHBOARDS[0].read_text())
    panel = _panel_reading(board, "tidegate_cache_allocation_latency_seconds")
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "s"
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 0.2]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    ttft = _panel_reading(board, "tidegate_time_to_first_token_seconds_bucket")
    assert any("tidegate_lane_ttft_p99_objective_seconds" in t["expr"] for t in ttft["targets"])


def test_every_alert_is_complete_and_links_a_docs_runbook() -> None:
    section = _ops_section("## Alerts and runbooks")
    anchors = {_anchor(h) for h in re.findall(r"^### (.+)$", section, re.M)}
    for rule in _rules():
        assert rule["alert"].startswith("Tidegate"), rule
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK_BASE), rule["alert"]
        assert url.removeprefix(RUNBOOK_BASE) in anchors, rule["alert"]
        assert rule["alert"] in section, f"the runbooks do not name {rule['alert']}"


def test_the_issue_alerts_are_all_there() -> None:
    assert [r["alert"] for r in _rules()] == [
        "TidegateKVCacheAllocationLatencyHigh", "TidegateFinanceTTFTOverObjective",
        "TidegateLaneWithoutActiveWorker", "TidegateQueueDepthRising", "TidegatePoisonJobs",
        "TidegateWebhookBacklog"]


