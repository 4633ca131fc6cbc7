"""The live API fuzzed from its own OpenAPI schema (schemathesis, api/openapi.py): every
route, the OpenAI-compatible ones (chat and text completions, models, files, batches) and
the admin API included. No request that a client can make may get a 5xx, and every error
carries its path's JSON error shape: OpenAI's `{"error": {"message", "type", "param",
"code"}}` on the OpenAI paths (api/openai_answers.py `error_body`), the API's own
`{"error": {"type", "field", "message"}}` elsewhere (api/errors.py).

One schemathesis run, as `schemathesis run` would do it, on a small budget (a few examples
per operation, so the run stays within a few minutes on two cores): every operation's
examples, coverage and fuzzing phases, then the stateful phase, which follows the schema's
links (submit -> read / cancel -> event stream, upload -> batch -> read / cancel, tenant
-> key -> rotate / revoke) with the ids the API returned. It runs in-process through
schemathesis' engine: its pytest loader for a schema known only once a fixture has run
(`from_fixture`) fails on pytest 9.2. The tenant's key signs the tenant routes and an
admin key the admin routes (the schema's two security schemes).

The API runs in this process on its own Redis database and a SQLite file of its own, and one
real worker (vLLM on CPU, the test checkpoint) serves the fuzzing tenant's lanes (chat, and
batch on chat's workers), so every accepted job, completion and event stream ends, and a
non-streaming completion never waits on a job nobody runs. The lanes are the tests' own
with outputs of at most a few tokens (LANES_TOML), so hundreds of fuzzed jobs cost seconds;
`finance` has no worker and the tenant may not use it (a 403 to fuzz). Everything is
stopped and emptied on the way out.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import schemathesis
from fastapi.routing import APIRoute
from schemathesis import CheckContext, Response
from schemathesis.engine import events, from_schema
from schemathesis.engine.recorder import ScenarioRecorder

from api.app import create_app
from api.openai_routes import is_openai_path
from store.tenants import Tenants
from tests.helpers import api_of_its_own, own_db
from tidegate.settings import Settings
from tidegate_tools.procs import start_worker, wait_until
from tidegate_tools.stack import api_ready

REDIS_DB = own_db(__name__, "11")
LANES = ["chat", "batch"]  # both served by the one chat worker (batch runs on chat's)
WORKER = "chat-fuzz@test"
LANES_TOML = """
[lanes.chat]
queue = "chat"
dtype = "float16"
kv_cache_dtype = "fp8"
pools = ["vllm"]
default_priority = 4
max_prompt_tokens = 512
max_output_tokens = 4
deadline_s = 60

[lanes.batch]
queue = "chat"
runs_on = "chat"
dtype = "float16"
kv_cache_dtype = "fp8"
pools = ["vllm"]
default_priority = 0
max_prompt_tokens = 512
max_output_tokens = 4
deadline_s = 86400

[lanes.finance]
queue = "finance"
dtype = "float16"
kv_cache_dtype = "auto"
pools = ["vllm"]
default_priority = 7
max_prompt_tokens = 512
max_output_tokens = 4
deadline_s = 60

[service_tiers]
priority = "finance"
default = "chat"
auto = "chat"
flex = "batch"
"""

CONFIG = """
# Every job the run makes ends in a moment (a worker serves its lanes), so does its event
# stream: a request still unanswered after this is a failure, never a wait.
request-timeout = 60

[generation]
# A few cases per operation: the coverage phase adds each schema's boundary values.
max-examples = 12
# Text that is UTF-8 (no lone surrogate, which the API refuses with a 400 as it should).
codec = "utf-8"

[auth]
auto-signup = false

[auth.openapi.bearer]
bearer = "{tenant_key}"

[auth.openapi.admin]
bearer = "{admin_key}"

# A batch input file uploaded before the run: half the batches made name it (the others
# name made-up files, or the files the run uploads).
[dictionaries.files]
values = ["{file_id}"]

[parameters]
"body.input_file_id" = { dictionary = "files", probability = 0.5 }

[checks]
# Lane limits, the model's context and the tenant's lanes are checked after the schema,
# against the lanes file, the tokenizer and the store: a schema-valid body may get a 4xx.
positive_data_acceptance.enabled = false
# A cancelled job or batch is kept (status `cancelled`), not deleted: reading it after is a
# 200; a revoked tenant or key is kept too.
use_after_free.enabled = false

[phases.stateful]
max-steps = 20

[phases.stateful.inference]
# Only the schema's links.
algorithms = []

[[operations]]
include-path-regex = "^/admin/"
# Not with names other responses carried: GET /admin/v1/tenants lists the fuzzing tenant,
# which a PATCH or DELETE fed with its name would change or revoke half-way through the run.
# The stateful phase still follows the links from the tenants and keys the run creates.
phases.coverage.extra-data-sources.responses = false
phases.fuzzing.extra-data-sources.responses = false
"""

# `make test` replays one seed, so that CI's verdict is the code's and not the draw's;
# TIDEGATE_FUZZ_SEED=random draws a new one (printed on a failure), or names one to replay.
SEED = 20261203


# Operations that make something: each one is answered 2xx at least once in a run.
MADE = {"POST /v1/jobs", "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/files",
        "POST /v1/batches", "POST /admin/v1/tenants", "POST /admin/v1/tenants/{name}/keys",
        "POST /admin/v1/tenants/{name}/keys/{key_id}/rotate"}


def fuzz_seed() -> int:
    raw = os.environ.get("TIDEGATE_FUZZ_SEED", "")
    if raw == "random":
        return random.SystemRandom().getrandbits(64)
    return int(raw) if raw else SEED


@schemathesis.check
def error_shape(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool | None:
    """Every 4xx and 5xx is JSON in its path's error shape."""
    if response.status_code < 400:
        return None
    openai = is_openai_path(case.formatted_path)
    fields = {"message", "type", "param", "code"} if openai else {"type", "field", "message"}
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    if not (isinstance(error, dict) and fields <= error.keys()):
        shape = "OpenAI's" if openai else "the API's"
        raise AssertionError(f"{response.status_code} is not in {shape} JSON error shape: "
                             f"{response.content[:200]!r}")
    return None


@dataclass
class Fuzzed:
    base_url: str
    tenant_key: str
    admin_key: str
    file_id: str  # a batch input file of the tenant's


INPUT_FILE = "".join(
    json.dumps({"custom_id": f"order-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "chat", "max_tokens": 2,
                         "messages": [{"role": "user", "content": "Where is my parcel?"}]}})
    + "\n" for i in range(2))


@pytest.fixture(scope="module")
def fuzzed(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Fuzzed]:
    """The API in this process and a vLLM worker serving its lanes, on its own Redis database; a
    tenant (a name no fuzzed case will guess) and an admin key."""
    lanes = tmp_root / "fuzz-lanes.toml"
    lanes.write_text(LANES_TOML)
    # The run's unauthenticated cases (hundreds) would pass the limit on 401s per address
    # (TIDEGATE_AUTH_FAILURES) and turn its later 401s into 429s; and its batches, which no
    # driver runs here, would fill the tenant's open-batch quota before the links reach one.
    with api_of_its_own(redis_server, tmp_root, "fuzz", REDIS_DB, [], lanes_file=lanes,
                        auth_failures=1_000_000, tenant_max_open_batches=1_000_000) as api:
        _, tenant_key = api.store.tenants.create_tenant(f"fuzz-{secrets.token_hex(8)}", LANES)
        admin_key = Tenants(api.store).create_admin_key("fuzz-admin")
        settings = api.app.state.deps.settings
        env = {**os.environ, "TIDEGATE_REDIS_URL": settings.redis_url,
               "TIDEGATE_NAMESPACE": api.namespace, "TIDEGATE_LANES_FILE": str(lanes),
               "TIDEGATE_DATABASE_URL": settings.database_url}
        worker = start_worker(env, "chat", WORKER, tmp_root / "logs", pool="vllm")
        try:
            wait_until(lambda: api_ready(api.base_url, [WORKER]), 600, "the vLLM worker",
                       [worker])
            uploaded = httpx.post(f"{api.base_url}/v1/files", data={"purpose": "batch"},
                                  files={"file": ("orders.jsonl", INPUT_FILE.encode())},
                                  headers={"Authorization": f"Bearer {tenant_key}"}, timeout=30)
            assert uploaded.status_code == 200, uploaded.text
            yield Fuzzed(api.base_url, tenant_key, admin_key, uploaded.json()["id"])
        finally:
            worker.stop()


def test_fuzzed_requests_get_no_5xx_and_errors_in_shape(fuzzed: Fuzzed) -> None:
    config = schemathesis.Config.from_str(
        f"seed = {fuzz_seed()}\n"
        + CONFIG.replace("{tenant_key}", fuzzed.tenant_key)
        .replace("{admin_key}", fuzzed.admin_key).replace("{file_id}", fuzzed.file_id))
    schema = schemathesis.openapi.from_url(f"{fuzzed.base_url}/openapi.json", config=config)
    run = Run()
    for event in from_schema(schema).execute():
        run.add(event)
    summary = f"{run.calls} requests to {len(run.tried)} operations (seed {config.seed})"
    assert not run.failures, (f"{len(run.failures)} failures in {summary}:\n"
                              + "\n".join(run.failures))
    assert run.calls > 300 and len(run.tried) == len(list(schema.get_all_operations())), summary
    # Meaningful cases: what makes something was answered 2xx (a job and completions run
    # to their end, a file uploaded and batched, a tenant and its keys made and rotated).
    assert set(run.succeeded) >= MADE, sorted(MADE - set(run.succeeded))
    if run.known:
        pytest.xfail("only findings already reported remain:\n" + "\n".join(sorted(run.known)))


def test_every_route_is_in_the_schema_with_its_contract(tmp_root: Path) -> None:
    """The OpenAI, Files, Batches and admin routes were left out of /openapi.json; now
    every route the app serves is there, described (no `x-undocumented`), each operation
    behind its security scheme but the probes and /metrics."""
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/11",
                              database_url=f"sqlite:///{tmp_root / 'schema.db'}"))
    try:
        doc = app.openapi()  # built from the routes: nothing is served or connected
    finally:
        app.state.deps.admission.close()  # the one thing create_app started
    # A path parameter's convertor (`{model:path}`: a model id may hold a slash) is the
    # router's business; the schema names the parameter alone.
    served = {(re.sub(r":\w+}", "}", route.path), method.lower()) for route in app.routes
              if isinstance(route, APIRoute) for method in route.methods}
    documented = {(path, method) for path, methods in doc["paths"].items() for method in methods}
    assert served == documented
    open_to_all = {"/healthz", "/readyz", "/fleetz", "/metrics"}
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            assert "x-undocumented" not in operation, (method, path)
            assert operation["operationId"]
            schemes = {name for need in operation.get("security", []) for name in need}
            expected = (set() if path in open_to_all
                        else {"admin"} if path.startswith("/admin/") else {"bearer"})
            assert schemes == expected, (method, path)
            if method in ("post", "patch") and path != "/v1/webhook-secret" \
                    and not path.endswith("/cancel"):  # these two take no body
                assert operation["requestBody"]["required"], (method, path)


def test_an_admin_patch_the_store_cannot_hold_is_a_422_naming_its_field(
        fuzzed: Fuzzed) -> None:
    """Found by the fuzz run: `{"lanes": null}` and a limit past what the store's column
    holds reached the store and were 500s. Null clears a limit (requests_per_minute: null),
    never the lanes; and a bool is not an integer."""
    admin = {"Authorization": f"Bearer {fuzzed.admin_key}"}
    base = f"{fuzzed.base_url}/admin/v1/tenants"
    made = httpx.post(base, json={"name": "null-lanes", "lanes": ["chat"]}, headers=admin,
                      timeout=30)
    assert made.status_code == 201, made.text
    for body, field_name in (({"lanes": None}, "lanes"),
                             ({"max_priority": False}, "max_priority"),
                             ({"tokens_per_minute": 2**63}, "tokens_per_minute")):
        refused = httpx.patch(f"{base}/null-lanes", json=body, headers=admin, timeout=30)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["field"] == field_name
    tenant = httpx.get(f"{base}/null-lanes", headers=admin, timeout=30).json()
    assert tenant["lanes"] == ["chat"] and tenant["max_priority"] is None


@dataclass
class Run:
    """What a schemathesis run found, event by event."""

    calls: int = 0
    failures: list[str] = field(default_factory=list)
    known: set[str] = field(default_factory=set)  # KNOWN findings seen (their reasons)
    tried: set[str] = field(default_factory=set)  # operations with a request made
    succeeded: Counter[str] = field(default_factory=Counter)  # 2xx answers by operation

    def add(self, event: events.EngineEvent) -> None:
        recorder = getattr(event, "recorder", None)
        if recorder is not None:
            self.calls += len(recorder.interactions)
            self.tried |= {case.value.operation.label for case in recorder.cases.values()}
            self.succeeded.update(_succeeded(recorder))
            self._checks(recorder)
        elif isinstance(event, events.NonFatalError):  # a timeout, a dropped connection
            self.failures.append(f"{event.label}: {event.info.title}: {event.info.message}")
        elif isinstance(event, events.FatalError):
            self.failures.append(f"schemathesis stopped: {event.exception!r}")

    def _checks(self, recorder: ScenarioRecorder) -> None:
        """Each failed check as `check: operation -> status: title` and the request's
        curl; one of the KNOWN findings is set aside."""
        for case_id, nodes in recorder.checks.items():
            case = recorder.cases[case_id].value
            response = recorder.find_response(case_id=case_id)
            status = response.status_code if response is not None else "no response"
            for node in nodes:
                if node.failure_info is None:
                    continue
                reason = known_finding(node.name, case.operation.label, case.body)
                if reason is not None:
                    self.known.add(reason)
                    continue
                failure = node.failure_info.failure
                self.failures.append(f"{node.name}: {failure.operation} -> {status}: "
                                     f"{failure.title}\n  {node.failure_info.code_sample}")


def _succeeded(recorder: ScenarioRecorder) -> list[str]:
    """The operation of each request answered 2xx."""
    return [recorder.cases[case_id].value.operation.label
            for case_id, interaction in recorder.interactions.items()
            if interaction.response is not None and interaction.response.status_code < 300]


# Findings of this test in code other helpers own, reported to the lead and open when this
# test was written: each matched narrowly (its check, operation and the body's fault), so
# any other failure of the same operation still fails the run. Delete an entry once fixed.
ALL_CHECKS_OF_A_500 = ("not_a_server_error", "error_shape", "status_code_conformance")


def known_finding(check: str, operation: str, body: object) -> str | None:
    return None
