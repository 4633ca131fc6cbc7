"""The live API fuzzed from its own OpenAPI schema (schemathesis, api/openapi.py): no request
that a client can make may get a 5xx, and every error carries the API's JSON error shape
`{"error": {"type", "field", "message"}}` (api/errors.py).

One schemathesis run with its default budget, as `schemathesis run` would do it: every
operation's examples, coverage and fuzzing phases (up to 100 cases each), then the stateful
phase, which follows the schema's links (submit -> read / cancel -> event stream) with the
ids the API returned. It runs in-process through schemathesis' engine: its pytest loader for
a schema known only once a fixture has run (`from_fixture`) fails on pytest 9.2.

Fuzzed submits are real jobs. The fuzzing tenant may use only the `support` lane, which no
worker of the session's stack serves: a heartbeat advertised for the test lets the router
accept its jobs, and they wait in the queue, so hundreds of submits load no engine. The
event stream is reached with a real id only through a cancel (the schema links it from
there, and the run infers no other link): a cancelled job's stream holds its terminal
event and ends at once, where a queued job's would stay open until the job ends. At the
end the tenant's jobs are cancelled and the queue emptied, so the `support` workers that a
later module starts (test_router_live.py) find none of them.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator

import pytest
import schemathesis
from schemathesis import CheckContext, Response
from schemathesis.engine import events, from_schema
from schemathesis.engine.recorder import ScenarioRecorder

from tests.helpers import Stack, make_tenant
from tidegate import keys
from tidegate.settings import get_settings

LANE = "support"
FAKE_WORKER = "support-fuzz@test"
HEARTBEAT_TTL_S = 600  # outlives the run if the fixture's cleanup never ran

CONFIG = """
[checks]
# Lane limits, the model's context and the tenant's lanes are checked after the schema,
# against the lanes file, the tokenizer and the store: a schema-valid body may get a 4xx.
positive_data_acceptance.enabled = false
# A cancelled job is kept (status `cancelled`), not deleted: reading it after is a 200.
use_after_free.enabled = false

[phases.stateful.inference]
# Only the schema's links: one inferred from a submit to its event stream would open the
# stream of a job that never runs.
algorithms = []

[[operations]]
include-operation-id = "jobEvents"
# For the same reason, no job id a submit returned reaches the event stream outside the
# links: the other phases fuzz it with ids they make up.
phases.coverage.extra-data-sources.responses = false
phases.fuzzing.extra-data-sources.responses = false
"""


# `make test` replays one seed, so that CI's verdict is the code's and not the draw's;
# TIDEGATE_FUZZ_SEED=random draws a new one (printed on a failure), or names one to replay.
SEED = 20261203


def fuzz_seed() -> int:
    raw = os.environ.get("TIDEGATE_FUZZ_SEED", "")
    if raw == "random":
        return random.SystemRandom().getrandbits(64)
    return int(raw) if raw else SEED


@schemathesis.check
def error_shape(ctx: CheckContext, response: Response, case: schemathesis.Case) -> bool | None:
    """Every 4xx and 5xx is JSON `{"error": {"type", "field", "message"}}`."""
    if response.status_code < 400:
        return None
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    if not (isinstance(error, dict) and {"type", "field", "message"} <= error.keys()):
        raise AssertionError(f"{response.status_code} is not in the JSON error shape: "
                             f"{response.content[:200]!r}")
    return None


@pytest.fixture(scope="module")
def fuzz_key(stack: Stack) -> Iterator[str]:
    """An API key whose tenant may use only the `support` lane, and a worker of that lane
    advertised but absent: its jobs are accepted and never run."""
    tenant_id, key = make_tenant(stack.store, "fuzz-tenant", [LANE])
    heartbeat = keys.worker_heartbeat(stack.namespace, FAKE_WORKER)
    stack.redis.set(heartbeat, _heartbeat(), ex=HEARTBEAT_TTL_S)
    try:
        yield key
    finally:
        stack.redis.delete(heartbeat)
        _clear_jobs(stack, tenant_id)


def _heartbeat() -> str:
    return json.dumps({"name": FAKE_WORKER, "state": "active", "lanes": [LANE],
                       "pool": "primary", "engine": "vllm", "slots": 64, "ts": time.time()})


def _clear_jobs(stack: Stack, tenant_id: int) -> None:
    for job in stack.store.jobs_of_tenant(tenant_id, limit=100_000):
        stack.store.cancel_job(job.id)
    lane = get_settings().lanes[LANE]
    for pool in lane.pools:
        stack.redis.delete(*keys.queue_sublists(keys.pool_queue(lane.queue, pool)))


def test_fuzzed_requests_get_no_5xx_and_errors_in_shape(stack: Stack, fuzz_key: str) -> None:
    config = schemathesis.Config.from_str(f"seed = {fuzz_seed()}\n{CONFIG}")
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json", config=config)
    schema.config.update(headers={"Authorization": f"Bearer {fuzz_key}"})
    failures, calls = [], 0
    for event in from_schema(schema).execute():
        recorder = getattr(event, "recorder", None)
        if recorder is not None:
            calls += len(recorder.interactions)
            failures += _failures(recorder)
        elif isinstance(event, events.NonFatalError):  # a timeout, a dropped connection
            failures.append(f"{event.label}: {event.info.title}: {event.info.message}")
        elif isinstance(event, events.FatalError):
            failures.append(f"schemathesis stopped: {event.exception!r}")
    assert not failures, (f"{len(failures)} failures (seed {config.seed}):\n"
                          + "\n".join(failures))
    assert calls > 300, f"schemathesis made only {calls} requests"


def _failures(recorder: ScenarioRecorder) -> list[str]:
    """Each failed check as `check: operation -> status: title` and the request's curl."""
    found = []
    for case_id, nodes in recorder.checks.items():
        response = recorder.find_response(case_id=case_id)
        status = response.status_code if response is not None else "no response"
        for node in nodes:
            if node.failure_info is not None:
                failure = node.failure_info.failure
                found.append(f"{node.name}: {failure.operation} -> {status}: {failure.title}\n"
                             f"  {node.failure_info.code_sample}")
    return found
