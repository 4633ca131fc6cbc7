"""Tenants and keys through the admin API, on an in-process API with its own Redis DB and
database (a chat worker's heartbeat advertised, none consuming): several named keys per
tenant, shown once; rotating keeps the tenant's jobs and sessions; a revoked key, or a
lane taken away, is refused at once although the key was just found valid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from store import Store, upgrade
from store.tenants import Tenants
from tests.helpers import own_redis_url
from tests.stack.test_api_validation import advertise_worker
from tidegate.settings import Settings

JOB = {"lane": "chat", "prompt": "Where is my parcel?", "max_tokens": 4}


class Admin:
    def __init__(self, http: TestClient, admin_key: str) -> None:
        self.http, self.admin_key = http, admin_key

    def call(self, method: str, path: str, key: str | None = None, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return self.http.request(method, path, headers=headers, **kwargs)

    def submit(self, key: str, **fields: Any) -> Any:
        return self.call("POST", "/v1/jobs", key, json={**JOB, **fields})

    def jobs(self, key: str) -> list[str]:
        resp = self.call("GET", "/v1/jobs", key)
        assert resp.status_code == 200, resp.text
        return [job["id"] for job in resp.json()["data"]]


@pytest.fixture(scope="module")
def admin(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Admin]:
    url = f"sqlite:///{tmp_root / 'admin.db'}"
    upgrade(url)
    redis_url = own_redis_url(redis_server, __name__, "5")
    settings = Settings(redis_url=redis_url, database_url=url)
    admin_key = Tenants(Store(url)).create_admin_key("ops")
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_worker(client, settings)
    try:
        with TestClient(create_app(settings)) as http:
            yield Admin(http, admin_key)
    finally:
        client.flushdb()


def new_tenant(admin: Admin, name: str, **fields: Any) -> dict[str, Any]:
    resp = admin.call("POST", "/admin/v1/tenants", json={"name": name, "lanes": ["chat"],
                                                          **fields})
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def test_admin_and_tenant_keys_do_not_cross(admin: Admin) -> None:
    tenant = new_tenant(admin, "crossing")
    key = tenant["key"]["secret"]
    assert admin.call("GET", "/admin/v1/tenants", key).status_code == 401
    assert admin.submit(admin.admin_key).status_code == 401
    assert admin.call("GET", "/admin/v1/tenants", "tga_wrong").status_code == 401
    assert admin.submit(key).status_code == 202


def test_rotating_a_key_keeps_jobs_and_sessions_and_ends_the_old_key_at_once(
        admin: Admin) -> None:
    tenant = new_tenant(admin, "rotating")
    old = tenant["key"]
    made = admin.submit(old["secret"], session_id="crm-rotate-1")
    assert made.status_code == 202
    rotated = admin.call("POST", f"/admin/v1/tenants/rotating/keys/{old['id']}/rotate", json={})
    assert rotated.status_code == 201 and rotated.json()["name"] == old["name"]
    new = rotated.json()["secret"]
    assert admin.submit(old["secret"]).status_code == 401  # found valid a moment ago
    assert admin.jobs(new) == [made.json()["job_id"]]
    # The session stays the tenant's: the new key continues it (its second turn). Another
    # tenant's "crm-rotate-1" is a session of its own (sessions are keyed by tenant).
    store = admin.http.app.state.deps.store
    continued = admin.submit(new, session_id="crm-rotate-1")
    assert continued.status_code == 202
    assert store.jobs.job_payload(continued.json()["job_id"])["turn"] == 2
    other = new_tenant(admin, "rotating-other")["key"]["secret"]
    theirs = admin.submit(other, session_id="crm-rotate-1")
    assert theirs.status_code == 202
    assert store.jobs.job_payload(theirs.json()["job_id"])["turn"] == 1


def test_a_rotation_with_an_overlap_keeps_both_keys_until_it_ends(admin: Admin) -> None:
    tenant = new_tenant(admin, "overlapping")
    old = tenant["key"]
    rotated = admin.call("POST", f"/admin/v1/tenants/overlapping/keys/{old['id']}/rotate",
                         json={"overlap_s": 3600})
    assert rotated.status_code == 201
    assert admin.submit(old["secret"]).status_code == 202
    assert admin.submit(rotated.json()["secret"]).status_code == 202
    keys = admin.call("GET", "/admin/v1/tenants/overlapping").json()["keys"]
    assert [k["active"] for k in keys] == [True, True] and keys[0]["expires_at"]
    assert keys[0]["last_used_at"] is not None
    assert all("secret" not in k for k in keys)  # shown once, when made


def test_named_keys_are_revoked_one_at_a_time(admin: Admin) -> None:
    tenant = new_tenant(admin, "named")
    ci = admin.call("POST", "/admin/v1/tenants/named/keys", json={"name": "ci"})
    assert ci.status_code == 201
    assert admin.submit(ci.json()["secret"]).status_code == 202
    revoked = admin.call("DELETE", f"/admin/v1/tenants/named/keys/{ci.json()['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert admin.submit(ci.json()["secret"]).status_code == 401
    assert admin.submit(tenant["key"]["secret"]).status_code == 202  # the other key works
    assert len(admin.jobs(tenant["key"]["secret"])) == 2


def test_a_lane_taken_away_is_refused_at_once(admin: Admin) -> None:
    key = new_tenant(admin, "narrowed", requests_per_minute=100)["key"]["secret"]
    assert admin.submit(key).status_code == 202
    changed = admin.call("PATCH", "/admin/v1/tenants/narrowed", json={"lanes": ["finance"]})
    assert changed.status_code == 200 and changed.json()["lanes"] == ["finance"]
    assert changed.json()["requests_per_minute"] == 100  # what was not sent stays
    refused = admin.submit(key)
    assert refused.status_code == 403 and refused.json()["error"]["field"] == "lane"


def test_a_tenants_fair_weight_is_set_shown_and_reset(admin: Admin) -> None:
    created = new_tenant(admin, "weighted", fair_weight=5)
    assert created["fair_weight"] == 5
    assert admin.call("GET", "/admin/v1/tenants/weighted").json()["fair_weight"] == 5
    reset = admin.call("PATCH", "/admin/v1/tenants/weighted", json={"fair_weight": None})
    assert reset.status_code == 200 and reset.json()["fair_weight"] == 1  # null: the default
    assert new_tenant(admin, "unweighted")["fair_weight"] == 1


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"name": "bad-lane", "lanes": ["gold"]}, 422, "lanes"),
    ({"name": "no-lanes", "lanes": []}, 422, "lanes"),
    ({"name": "x", "lanes": ["chat"], "webhook_url": "ftp://crm.example.com"}, 422,
     "webhook_url"),
    ({"name": "x", "lanes": ["chat"], "extra": 1}, 422, "extra"),
    ({"name": "x", "lanes": ["chat"], "fair_weight": 0}, 422, "fair_weight"),
    ({"name": "x", "lanes": ["chat"], "fair_weight": 1001}, 422, "fair_weight"),
    ({"name": "crossing", "lanes": ["chat"]}, 409, "name"),
])
def test_bad_admin_input_names_the_field(admin: Admin, body: dict[str, Any], status: int,
                                         field: str) -> None:
    if body["name"] == "crossing" and admin.call("GET", "/admin/v1/tenants/crossing"
                                                 ).status_code == 404:
        new_tenant(admin, "crossing")
    resp = admin.call("POST", "/admin/v1/tenants", json=body)
    assert resp.status_code == status and resp.json()["error"]["field"] == field
