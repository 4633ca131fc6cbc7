"""The batch driver left the API (issue 28): every way of deploying tidegate runs
`tidegate batches` beside the API."""

from __future__ import annotations

import yaml

from tests.unit.test_deploy import COMPOSE, DEPLOY, SYSTEMD, cli_args, of_kind, unit_value


def test_compose_kubernetes_and_systemd_run_the_driver() -> None:
    service = yaml.safe_load(COMPOSE.read_text())["services"]["batches"]
    assert service["command"] == ["batches"]
    assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    driver = deployments["tidegate-batches"]["spec"]
    assert driver["template"]["spec"]["containers"][0]["args"] == ["batches"]
    assert driver["replicas"] == 2  # one drives, one waits to take over
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    assert "batches.yaml" in listed
    exec_start = unit_value(SYSTEMD / "tidegate-batches.service", "ExecStart").split()
    assert exec_start[1:] == ["batches"]
    assert cli_args(["batches"]).cmd == "batches"

