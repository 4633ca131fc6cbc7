"""What one tenant may do to a lane it shares with others (issue 28, finding 6 and a point
9 item): its session ids are its own (keyed by tenant and id: another tenant's use of the
same id is another session, never a 403 that tells it the id exists), and it asks no
priority above its highest (a tenant setting; unset, the lane's default), refused before
anything is enqueued.

The API runs in-process on its own Redis database and a SQLite database of its own, with a chat
worker's heartbeat advertised and no worker consuming: jobs stay queued, and the queues
show exactly what was enqueued."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.auth import tenant_for_key
from api.deps import lane_rank
from store.tenants import Tenants
from tasks.app import queue_lengths
from tasks.payloads import GeneratePayload
from tests.helpers import InProcessApi, advertise, in_process_api, own_db
from tidegate import keys
from tidegate_tools.procs import tidegate_argv

WORKER = "chat-sessions@test"
ASK = [{"role": "user", "content": "Where is my parcel?"}]
QUEUES = ["chat.vllm", "chat.trtllm", keys.direct_queue("tgtest", WORKER)]


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[InProcessApi]:
    with in_process_api(redis_server, tmp_root / "tenant-sessions.db", own_db(__name__, "10"),
                        "sessions-acme",
                        ["chat"]) as running:
        advertise(running.redis, running.settings.namespace, WORKER, "chat", "vllm")
        yield running


@pytest.fixture(autouse=True)
def empty_queues(api: InProcessApi) -> Iterator[None]:
    yield
    for queue in QUEUES:
        api.redis.delete(*keys.queue_sublists(queue))


def tenant(api: InProcessApi, name: str, **settings: Any) -> tuple[int, str]:
    record, key = api.store.tenants.create_tenant(name, ["chat"], **settings)
    return record.id, key


def submit(api: InProcessApi, key: str, **fields: Any) -> Any:
    return api.http.post("/v1/jobs", json={"lane": "chat", "messages": ASK, "max_tokens": 4,
                                           **fields},
                         headers={"Authorization": f"Bearer {key}"})


def accepted(resp: Any) -> dict[str, Any]:
    assert resp.status_code == 202, resp.text
    body: dict[str, Any] = resp.json()
    return body


def queued(api: InProcessApi) -> int:
    return sum(queue_lengths(api.redis, QUEUES).values())


# -- sessions ------------------------------------------------------------------------


def test_two_tenants_use_one_session_id_as_two_sessions(api: InProcessApi) -> None:
    """globex takes "crm-1" first; acme's first turn of its own "crm-1" is accepted (it
    was a 403 that told acme the id existed), counted as turn 1 of acme's session, and
    neither tenant's turns, affinity or job list show the other's."""
    globex, globex_key = tenant(api, "sessions-globex")
    for _ in range(2):
        accepted(submit(api, globex_key, session_id="crm-1"))
    # globex's session ran on the advertised worker: its next turn sticks there.
    api.store.sessions.set_session_worker("crm-1", globex, WORKER)

    mine = accepted(submit(api, api.key, session_id="crm-1"))
    job = api.store.jobs.get_job(mine["job_id"])
    assert job is not None and job.tenant_id == api.tenant_id
    # Turn 1 of acme's session (the task's payload carries it), on the pool, not globex's
    # worker: nothing of globex's session reached acme's job.
    payload = GeneratePayload.from_dict(api.store.jobs.job_payload(job.id) or {})
    assert payload.turn == 1 and payload.session_key == f"{api.tenant_id}:crm-1"
    assert job.queue == "chat.vllm" and "session affinity" not in (job.route_reason or "")
    ours, theirs = (api.store.sessions.get_session("crm-1", t) for t in (api.tenant_id, globex))
    assert ours is not None and (ours.turns, ours.last_worker) == (1, None)
    assert theirs is not None and (theirs.turns, theirs.last_worker) == (2, WORKER)

    # globex's next turn is its third, on its worker; acme's list holds acme's job only.
    again = accepted(submit(api, globex_key, session_id="crm-1"))
    assert again["queue"] == keys.direct_queue(api.settings.namespace, WORKER)
    assert GeneratePayload.from_dict(api.store.jobs.job_payload(again["job_id"]) or {}).turn == 3
    listed = api.http.get("/v1/jobs", params={"session_id": "crm-1"},
                          headers={"Authorization": f"Bearer {api.key}"})
    assert listed.status_code == 200, listed.text
    assert [j["id"] for j in listed.json()["data"]] == [mine["job_id"]]


def test_another_tenants_session_id_is_never_a_403(api: InProcessApi) -> None:
    """The probe finding 6 describes: an id another tenant holds answers as any new id."""
    _, owner_key = tenant(api, "sessions-owner")
    accepted(submit(api, owner_key, session_id="order-4711"))
    _, prober_key = tenant(api, "sessions-prober")
    taken = submit(api, prober_key, session_id="order-4711")
    fresh = submit(api, prober_key, session_id="order-never-used")
    assert (taken.status_code, fresh.status_code) == (202, 202), taken.text
    assert taken.json().keys() == fresh.json().keys()


# -- priority ------------------------------------------------------------------------


def test_priority_above_the_tenants_highest_is_refused_before_anything_is_enqueued(
        api: InProcessApi) -> None:
    """On Redis 0 is served first; the public scale is the other way: 9 is the most urgent
    (tidegate.lanes.redis_priority). chat's default is 4: a tenant with no grant asks 4 at
    most; 9 is refused naming `priority`, with no job row and no message."""
    _, key = tenant(api, "sessions-eager")
    jobs_before = api.store.jobs.count_jobs()
    refused = submit(api, key, priority=9)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["field"] == "priority" and "priority: 9" in error["message"]
    assert api.store.jobs.count_jobs() == jobs_before and queued(api) == 0

    # Through the OpenAI-compatible route too: 400 naming the param, nothing enqueued.
    openai = api.http.post("/v1/chat/completions",
                           json={"model": "tidegate-test", "messages": ASK, "max_tokens": 4,
                                 "priority": 5},
                           headers={"Authorization": f"Bearer {key}"})
    assert openai.status_code == 400, openai.text
    assert openai.json()["error"]["param"] == "priority"
    assert api.store.jobs.count_jobs() == jobs_before and queued(api) == 0

    # At or below the highest: accepted; without one, the lane's default.
    assert accepted(submit(api, key, priority=4))["priority"] == 4
    assert accepted(submit(api, key, priority=0))["priority"] == 0
    assert accepted(submit(api, key))["priority"] == 4


def test_an_admin_grants_and_caps_a_tenants_priority(api: InProcessApi) -> None:
    """max_priority through the admin API (PATCH, announced: the API's cached tenant is
    read again) and the `tidegate tenant` CLI; a cap below the lane's default also caps
    the default its jobs get."""
    admin = Tenants(api.store).create_admin_key("sessions-ops")
    created = api.http.post("/admin/v1/tenants", json={"name": "sessions-granted",
                                                       "lanes": ["chat"], "max_priority": 9},
                            headers={"Authorization": f"Bearer {admin}"})
    assert created.status_code == 201, created.text
    assert created.json()["max_priority"] == 9
    key = created.json()["key"]["secret"]
    assert accepted(submit(api, key, priority=9))["priority"] == 9

    capped = api.http.patch("/admin/v1/tenants/sessions-granted", json={"max_priority": 2},
                            headers={"Authorization": f"Bearer {admin}"})
    assert capped.status_code == 200 and capped.json()["max_priority"] == 2, capped.text
    assert submit(api, key, priority=3).status_code == 422
    assert accepted(submit(api, key))["priority"] == 2  # the lane's 4, capped

    cli = subprocess.run(
        tidegate_argv("tenant", "max-priority", "sessions-granted"),
        env={**os.environ, "TIDEGATE_DATABASE_URL": api.settings.database_url,
             "TIDEGATE_REDIS_URL": api.settings.redis_url},
        capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0, cli.stderr
    record = Tenants(api.store).get("sessions-granted")
    assert record is not None and record.max_priority is None  # back to the lane's default
    assert accepted(submit(api, key))["priority"] == 4


def test_a_priority_above_the_tenants_highest_waits_no_higher_in_admission(
        api: InProcessApi) -> None:
    """The admission queue ranks a submit by its priority before the submit's checks run:
    a request asking above its tenant's highest (to be refused) must not wait ahead of
    the lane's other submits; a granted one keeps its rank."""
    deps = api.http.app.state.deps
    plain, granted = (tenant_for_key(deps.store, tenant(api, name, max_priority=grant)[1])
                      for name, grant in (("sessions-ranked", None), ("sessions-vip", 9)))
    assert lane_rank(deps, "chat", 9, plain) == lane_rank(deps, "chat", 4)
    assert lane_rank(deps, "chat", 9, granted) == lane_rank(deps, "chat", 9)
    assert lane_rank(deps, "chat", 9, granted) < lane_rank(deps, "chat", 4)  # ahead
