"""The deploy files (deploy/) checked offline: the Kubernetes manifests against a current
Kubernetes schema, the compose file, the systemd units and the Dockerfiles against what
tidegate itself takes (its settings, its command line, its ports, its restart code).
No process of tidegate and no network; `docker-compose` and `systemd-analyze`, where
installed, check the compose file and the units as their own tools read them."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from tests.promql import metric_names_in, series_names
from tidegate.lanes import Lane, load_lanes, load_service_tiers
from tidegate.records import RESTART_EXIT
from tidegate.settings import Settings
from tidegate_tools.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yml"
SYSTEMD = DEPLOY / "systemd"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
# The newest Kubernetes whose schemas the installed kubernetes-validate ships.
K8S_VERSION = latest_version()
# Lanes with workers of their own (a lane with `runs_on` uses its host's workers).
WORKER_LANES = sorted(n for n, lane in load_lanes().items() if lane.runs_on is None)
FIELDS = Settings.model_fields
# Variables the deploy files may set that are not tidegate's: the images' own and the
# libraries' (Postgres, Grafana, Python, pip, CUDA, OpenTelemetry, Hugging Face, vLLM).
OTHER_VARS = re.compile(r"^(POSTGRES_\w+|GF_\w+|PYTHON\w+|PIP_\w+|CUDA_VISIBLE_DEVICES|"
                        r"OTEL_\w+|HF_\w+|VLLM_\w+|REDISCLI_AUTH)$")


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object of deploy/k8s, less the CRDs of optional/ (a schema of the
    core API cannot check them) and kustomize's own file."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if "optional" in path.relative_to(K8S).parts:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] != "Kustomization":
                docs.append((f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}",
                             doc))
    return docs


DOCS = k8s_docs()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def containers() -> list[dict[str, Any]]:
    pods = [d["spec"]["template"]["spec"] for d in of_kind("Deployment")]
    pods += [j["spec"]["template"]["spec"] for j in of_kind("Job")]
    return [c for pod in pods for c in pod["containers"]]


def worker_deployments() -> dict[str, dict[str, Any]]:
    """Lane -> its worker Deployment."""
    return {d["metadata"]["labels"]["tidegate.io/lane"]: d for d in of_kind("Deployment")
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def unit(path: Path) -> list[tuple[str, str, str]]:
    """A systemd unit as (section, key, value) lines, repeated keys kept in order."""
    section, lines = "", []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            lines.append((section, key.strip(), value.strip()))
    return lines


def unit_value(path: Path, key: str) -> str:
    values = [v for _, k, v in unit(path) if k == key]
    assert len(values) == 1, f"{path.name}: {key} {values}"
    return values[0]


def env_files() -> list[Path]:
    return sorted(SYSTEMD.glob("*.env.example"))


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    return {k: v for k, v in pairs}


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def dockerfile_env(path: Path) -> dict[str, str]:
    env = {}
    for instruction, args in dockerfile(path):
        if instruction == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S*)", args)))
    return env


# ---- Kubernetes -------------------------------------------------------------------------


def test_schemas_are_of_a_current_kubernetes() -> None:
    major, minor = (int(p) for p in K8S_VERSION.split(".")[:2])
    assert (major, minor) >= (1, 33), f"kubernetes-validate ships schemas up to {K8S_VERSION}"


@pytest.mark.parametrize("doc", [d for _, d in DOCS], ids=[name for name, _ in DOCS])
def test_manifest_validates(doc: dict[str, Any]) -> None:
    # strict: a field the schema does not know (a typo) is an error, not ignored
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_refused() -> None:
    """The control: the same check refuses a Deployment without its selector, and one
    with a misspelt probe, which a cluster would reject or silently ignore."""
    deployment = of_kind("Deployment")[0]
    no_selector = copy.deepcopy(deployment)
    del no_selector["spec"]["selector"]
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["livenesprobe"] = {"httpGet": {"path": "/healthz", "port": 8000}}
    for broken in (no_selector, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present - {"secret.example.yaml"}


def test_every_worker_lane_has_gpu_workers_that_drain_within_the_grace_period() -> None:
    workers = worker_deployments()
    assert sorted(workers) == WORKER_LANES
    lanes = load_lanes()
    for lane, deployment in workers.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        # SIGTERM drains: running jobs get their lane's whole deadline to finish
        assert pod["terminationGracePeriodSeconds"] > lanes[lane].deadline_s
        assert cli_args(container["args"]).lane == lane


def test_autoscalers_scale_each_lane_on_its_queue_depth() -> None:
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind("HorizontalPodAutoscaler")}
    for lane, deployment in worker_deployments().items():
        hpa = hpas[deployment["metadata"]["name"]]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["external"]["metric"]["name"] == "tidegate_queue_depth"
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"lane": lane}


def autoscaling_queries() -> list[str]:
    """The adapter rule's query, its template filled as the adapter fills it for an HPA's
    selector, and the KEDA alternative's."""
    adapter = yaml.safe_load((K8S / "adapter" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    filled = rule["metricsQuery"].replace("<<.Series>>", rule["name"]["as"]) \
        .replace("<<.LabelMatchers>>", 'lane="chat"')
    keda = yaml.safe_load((K8S / "optional" / "keda-worker-chat.yaml").read_text())
    return [filled, *(t["metadata"]["query"] for t in keda["spec"]["triggers"])]


def test_autoscaling_queries_parse_and_read_the_queue_depth() -> None:
    for query in autoscaling_queries():
        promql_parser.parse(query)  # raises on a syntax error
        assert metric_names_in(query) == {"tidegate_queue_depth"}, query
        assert "tidegate_queue_depth" in series_names()  # a metric the scheduler exports


def test_disruption_budgets_cover_the_api_and_every_worker_lane() -> None:
    selected = [p["spec"]["selector"]["matchLabels"] for p in of_kind("PodDisruptionBudget")]
    for deployment in [*worker_deployments().values(), *by_component("api")]:
        assert deployment["spec"]["selector"]["matchLabels"] in selected


def by_component(component: str) -> list[dict[str, Any]]:
    return [d for d in of_kind("Deployment")
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]


def test_api_probes_and_ports() -> None:
    (api,) = by_component("api")
    (container,) = api["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"] == [{"name": "http", "containerPort": FIELDS["api_port"].default}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TIDEGATE_API_HOST"] == "0.0.0.0"


def test_metrics_ports_are_the_settings_defaults() -> None:
    expected = {"worker": FIELDS["worker_metrics_port"].default,
                "scheduler": FIELDS["scheduler_metrics_port"].default,
                "api": FIELDS["api_port"].default}
    for deployment in of_kind("Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        if component not in expected:
            continue
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        assert [p["containerPort"] for p in container["ports"]] == [expected[component]]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == \
            str(expected[component])
    config = {d["metadata"]["name"]: d["data"] for d in of_kind("ConfigMap")}
    assert int(config["tidegate-config"]["TIDEGATE_WORKER_METRICS_PORT"]) == expected["worker"]


def configmap_lanes(tmp_path: Path) -> dict[str, Lane]:
    """The lanes of the ConfigMap, as tidegate reads them."""
    config = {d["metadata"]["name"]: d["data"] for d in of_kind("ConfigMap")}
    copied = tmp_path / "lanes.toml"
    copied.write_text(config["tidegate-lanes"]["lanes.toml"])
    return load_lanes(copied)


# What the ConfigMap's lanes keep of the shipped file; their precision and limits are
# sized for the model the ConfigMap names instead.
KEPT = ("queue", "pools", "default_priority", "ttft_p99_objective_ms", "runs_on",
        "min_workers", "max_workers", "peak_spare_workers", "cpu_nice", "share_prefix_cache",
        "keep_on_disconnect", "dtype", "kv_cache_dtype", "batch_min_share")


def test_the_lanes_configmap_keeps_the_shipped_lanes(tmp_path: Path) -> None:
    """Compared as tidegate reads them, so a comment edit needs no copy; a lane added,
    renamed, or moved to another queue, pool, priority or objective does."""
    lanes, shipped = configmap_lanes(tmp_path), load_lanes()
    assert list(lanes) == list(shipped)
    for name, lane in lanes.items():
        assert {f: getattr(lane, f) for f in KEPT} == \
            {f: getattr(shipped[name], f) for f in KEPT}, name
    assert load_service_tiers(tmp_path / "lanes.toml", lanes) == \
        load_service_tiers(None, shipped)


def test_the_lanes_configmap_is_sized_for_its_70b_model(tmp_path: Path) -> None:
    """The example names a 70B model: its lanes take its longer prompts and answers, load
    FP8 weights (a 70B's FP16 weights fit no one GPU, and a worker runs one engine on one
    GPU), and every lane's prompt and answer fit the engine's context."""
    env = k8s_env()
    assert "70b" in env["TIDEGATE_MODEL"]
    context = int(env["TIDEGATE_MAX_MODEL_LEN"])
    lanes, shipped = configmap_lanes(tmp_path), load_lanes()
    for name, lane in lanes.items():
        assert lane.max_prompt_tokens + lane.max_output_tokens <= context, name
        assert lane.max_prompt_tokens > shipped[name].max_prompt_tokens, name
        assert lane.max_output_tokens > shipped[name].max_output_tokens, name
        assert lane.quantization == "fp8", name
    assert lanes["finance"].kv_cache_dtype == "auto"  # the finance KV cache stays FP16
    slots = int(env["TIDEGATE_ENGINE_SLOTS"])
    chat_hpa = next(h for h in of_kind("HorizontalPodAutoscaler")
                    if h["spec"]["scaleTargetRef"]["name"] == "tidegate-worker-chat")
    assert int(chat_hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"]) == slots
    for lane, deployment in worker_deployments().items():
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > lanes[lane].deadline_s, lane


# ---- every variable is a setting, every command one the CLI takes ------------------------


def k8s_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for doc in of_kind("ConfigMap"):
        if doc["metadata"]["name"] == "tidegate-config":
            env.update(doc["data"])
    for doc in of_kind("Secret"):
        env.update(doc["stringData"])
    for container in containers():
        env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def compose_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for service in compose()["services"].values():
        env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    return env


ENV_SOURCES = {"k8s": k8s_env, "compose": compose_env,
               "systemd": lambda: {k: v for p in env_files() for k, v in env_file(p).items()},
               "docker": lambda: {k: v for p in DOCKERFILES for k, v in dockerfile_env(p).items()}}


@pytest.mark.parametrize("source", sorted(ENV_SOURCES))
def test_every_variable_is_a_setting_or_a_known_one(source: str) -> None:
    env = ENV_SOURCES[source]()
    assert env, source
    for name in env:
        if name.startswith("TIDEGATE_"):
            known = name.removeprefix("TIDEGATE_").lower() in FIELDS
            assert known, f"{source}: {name} is not a setting (tidegate/settings.py)"
        else:
            assert OTHER_VARS.match(name), f"{source}: {name} is neither tidegate's nor known"


@pytest.mark.parametrize("source", sorted(ENV_SOURCES))
def test_every_setting_value_is_valid(source: str) -> None:
    """The values as tidegate reads them at start (those filled in at deploy time aside)."""
    values = {name.removeprefix("TIDEGATE_").lower(): value
              for name, value in ENV_SOURCES[source]().items()
              if name.startswith("TIDEGATE_") and "${" not in value}
    Settings.model_validate(values)  # raises naming the bad one


def cli_args(argv: list[str]) -> Any:
    """The command line parsed as `tidegate` parses it; an unknown option fails."""
    try:
        return _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`tidegate {' '.join(argv)}` is not a command tidegate takes")


def commands() -> list[list[str]]:
    found = [c["args"] for c in containers()]
    found += [s["command"] for s in compose()["services"].values()
              if s.get("image", "").startswith("tidegate")]
    for path in SYSTEMD.glob("*.service"):
        exec_start = unit_value(path, "ExecStart").replace("%i", "finance").split()
        found.append(exec_start[1:])
    for path in DOCKERFILES:
        found += [json.loads(a) for i, a in dockerfile(path) if i == "CMD"]
    return found


def test_every_command_is_one_the_cli_takes() -> None:
    found = commands()
    assert len(found) > 15
    for argv in found:
        cli_args(argv)
    assert {argv[0] for argv in found} >= {"api", "worker", "scheduler", "webhooks", "flower",
                                          "db"}


# ---- compose ----------------------------------------------------------------------------


def test_compose_has_every_service() -> None:
    services = compose()["services"]
    assert {"redis", "postgres", "migrate", "api", "scheduler", "flower", "webhooks",
            "prometheus", "grafana"} <= set(services)
    assert {f"worker-{lane}" for lane in WORKER_LANES} <= set(services)
    assert services["prometheus"]["profiles"] == ["monitoring"]
    for lane in WORKER_LANES:
        worker = services[f"worker-{lane}"]
        assert cli_args(worker["command"]).lane == lane
        grace_s = int(worker["stop_grace_period"].removesuffix("s"))
        assert grace_s > load_lanes()[lane].deadline_s


def test_compose_waits_for_migrations_and_needs_a_flower_password() -> None:
    services = compose()["services"]
    for name in ("api", "scheduler", "webhooks", *(f"worker-{lane}" for lane in WORKER_LANES)):
        assert services[name]["depends_on"]["migrate"]["condition"] == \
            "service_completed_successfully", name
    password = services["flower"]["environment"]["TIDEGATE_FLOWER_PASSWORD"]
    assert password.startswith("${TIDEGATE_FLOWER_PASSWORD:?")


def test_compose_health_checks_use_the_settings_ports() -> None:
    services = compose()["services"]
    ports = {"api": FIELDS["api_port"].default,
             "scheduler": FIELDS["scheduler_metrics_port"].default,
             **{f"worker-{lane}": FIELDS["worker_metrics_port"].default
                for lane in WORKER_LANES}}
    for name, port in ports.items():
        assert f"127.0.0.1:{port}/" in " ".join(services[name]["healthcheck"]["test"]), name


# ---- systemd ----------------------------------------------------------------------------


def test_worker_unit_restarts_on_the_restart_code_and_drains() -> None:
    worker = SYSTEMD / "tidegate-worker@.service"
    assert unit_value(worker, "RestartForceExitStatus") == str(RESTART_EXIT)
    assert unit_value(worker, "Restart") == "on-failure"
    assert unit_value(worker, "KillSignal") == "SIGTERM"
    assert unit_value(worker, "KillMode") == "mixed"  # SIGTERM to the supervisor alone
    longest = max(load_lanes()[lane].deadline_s for lane in WORKER_LANES)
    assert int(unit_value(worker, "TimeoutStopSec")) > longest
    files = [v for _, k, v in unit(worker) if k == "EnvironmentFile"]
    assert files[0] == "/etc/tidegate/tidegate.env"


def test_every_unit_reads_the_env_file() -> None:
    names = {p.name for p in SYSTEMD.glob("*.service")}
    assert {"tidegate-api.service", "tidegate-worker@.service", "tidegate-scheduler.service",
            "tidegate-webhooks.service", "tidegate-flower.service"} <= names
    for path in SYSTEMD.glob("*.service"):
        assert ("Service", "EnvironmentFile", "/etc/tidegate/tidegate.env") in unit(path)


def test_two_workers_of_one_machine_have_two_metrics_ports() -> None:
    ports = [int(env_file(p)["TIDEGATE_WORKER_METRICS_PORT"])
             for p in SYSTEMD.glob("worker-*.env.example")]
    assert len(ports) == len(set(ports)) == len(WORKER_LANES)
    assert FIELDS["worker_metrics_port"].default in ports


# ---- Dockerfiles ------------------------------------------------------------------------


def package_folders() -> set[str]:
    """The folders `pip install .` packages (pyproject's package-dir), and the entry one."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {*pyproject["tool"]["setuptools"]["package-dir"].values(), "tidegate_server"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_installs_tidegate_and_runs_it_unprivileged(path: Path) -> None:
    lines = dockerfile(path)
    copied = {args.split()[0].rstrip("/") for i, args in lines if i == "COPY"}
    assert package_folders() <= copied
    users = [args for i, args in lines if i == "USER"]
    assert users and all(u not in ("root", "0") for u in users)
    entrypoints = [json.loads(args) for i, args in lines if i == "ENTRYPOINT"]
    assert entrypoints and all(e[-1] == "tidegate" for e in entrypoints)
