"""GET /v1/jobs: a tenant's jobs in acceptance order, filtered, page after page; another
tenant's never; a bad parameter a 422 naming it. The API runs in-process on its own Redis
database and SQLite database; jobs are rows in the store, one of them submitted through the
API."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tidegate_client import Client

from store import Store
from tests.helpers import in_process_api, own_db
from tests.stack.test_api_validation import advertise_worker

Listing = tuple[TestClient, Store, int, str]


@pytest.fixture(scope="module")
def listing(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Listing]:
    with in_process_api(redis_server, tmp_root / "listing.db", own_db(__name__, "4"), "listing",
                        ["chat", "finance"]) as api:
        advertise_worker(api.redis, api.settings)
        yield api.http, api.store, api.tenant_id, api.key


def add_job(store: Store, tenant_id: int, lane: str = "chat",
            session_id: str | None = None) -> str:
    job_id = str(uuid.uuid4())
    store.jobs.create_job(job_id, tenant_id, lane, f"{lane}.vllm", 4, session_id,
                          {"max_tokens": 4}, 3)
    return job_id


def get(http: TestClient, key: str, **params: Any) -> Any:
    return http.get("/v1/jobs", params=params, headers={"Authorization": f"Bearer {key}"})


def walk(http: TestClient, key: str, **params: Any) -> tuple[list[str], int]:
    """Every job id the pages give, in order, and how many pages it took."""
    ids, pages, cursor = [], 0, None
    while True:
        resp = get(http, key, **params, **({"after": cursor} if cursor else {}))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        ids += [job["id"] for job in body["data"]]
        pages += 1
        assert body["has_more"] == (body["next_cursor"] is not None)
        if not body["has_more"]:
            return ids, pages
        cursor = body["next_cursor"]


def test_pages_give_every_job_once_in_acceptance_order(listing: Listing) -> None:
    http, store, tenant_id, key = listing
    _, other_key = store.tenants.create_tenant("listing-other", ["chat"])
    other = store.tenants.tenant_by_key(other_key)
    assert other is not None
    made = [add_job(store, tenant_id) for _ in range(7)]
    others = add_job(store, other.id)  # never in this tenant's pages
    submitted = http.post("/v1/jobs", json={"lane": "chat", "prompt": "Where is my parcel?",
                                            "max_tokens": 4},
                          headers={"Authorization": f"Bearer {key}"})
    assert submitted.status_code == 202, submitted.text
    made.append(submitted.json()["job_id"])

    ids, pages = walk(http, key, limit=3)
    assert ids == made and pages == 3
    first = get(http, key, limit=3).json()
    assert first["object"] == "list" and len(first["data"]) == 3
    job = first["data"][0]
    assert job["status"] == "queued" and job["lane"] == "chat"
    assert "tenant_id" not in job and "idempotency_key" not in job

    # A producer back from an outage goes on from its last cursor: what was accepted
    # meanwhile comes next, nothing twice.
    last = get(http, key, limit=len(made) - 1).json()
    later = add_job(store, tenant_id)
    rest = get(http, key, after=last["next_cursor"]).json()
    assert [j["id"] for j in rest["data"]] == [made[-1], later]
    assert walk(http, other_key)[0] == [others]  # each tenant sees its own jobs only


def test_filters_by_status_lane_session_and_time(listing: Listing) -> None:
    http, store, tenant_id, key = listing
    session = f"crm-{uuid.uuid4().hex[:8]}"
    finance = add_job(store, tenant_id, lane="finance")
    in_session = [add_job(store, tenant_id, session_id=session) for _ in range(2)]
    cut = datetime.now(UTC)
    newest = add_job(store, tenant_id)
    cancelled = store.runs.cancel_job(in_session[0], tenant_id)
    assert cancelled is not None and cancelled.status == "cancelled"

    assert finance in walk(http, key, lane="finance")[0]
    assert all(j["lane"] == "finance" for j in get(http, key, lane="finance").json()["data"])
    assert walk(http, key, session_id=session)[0] == in_session
    assert walk(http, key, session_id=session, status="cancelled")[0] == [in_session[0]]
    assert walk(http, key, session_id=session, status="queued,running")[0] == [in_session[1]]
    assert walk(http, key, created_after=cut.isoformat())[0] == [newest]
    assert walk(http, key, created_after=f"{cut.timestamp():.6f}")[0] == [newest]


@pytest.mark.parametrize(("params", "status", "field"), [
    ({"status": "finished"}, 422, "status"),
    ({"status": "done,"}, 422, "status"),
    ({"lane": "nope"}, 422, "lane"),
    ({"limit": "0"}, 422, "limit"),
    ({"limit": "1001"}, 422, "limit"),
    ({"limit": "ten"}, 422, "limit"),
    ({"after": "not-a-cursor"}, 422, "after"),
    ({"created_after": "yesterday"}, 422, "created_after"),
    ({"created_after": "2026-12-04T10:00:00"}, 422, "created_after"),  # no timezone
    ({"session_id": "two words"}, 422, "session_id"),
    ({"sort": "desc"}, 422, "sort"),
    ({"lane": "chat\x00"}, 400, "lane"),
])
def test_a_bad_parameter_is_refused_naming_it(listing: Listing, params: dict[str, str],
                                              status: int, field: str) -> None:
    http, _, _, key = listing
    resp = get(http, key, **params)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["field"] == field


def test_no_key_is_401_before_any_parameter_is_read(listing: Listing) -> None:
    http, _, _, _ = listing
    resp = http.get("/v1/jobs", params={"limit": "0"})
    assert resp.status_code == 401 and resp.json()["error"]["field"] == "authorization"


@pytest.mark.parametrize("raw", [
    "0001-01-01T00:00:00+01:00|x",  # a time that overflows once moved to UTC
    "2026-12-04T10:00:00+00:00|\x00",  # an id no job can have (NUL: an error on PostgreSQL)
    "2026-12-04T10:00:00|abc",  # no timezone
])
def test_a_forged_cursor_is_422_not_500(listing: Listing, raw: str) -> None:
    http, _, _, key = listing
    forged = base64.urlsafe_b64encode(raw.encode()).decode()
    resp = get(http, key, after=forged)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "after"


def test_a_time_that_overflows_is_422_not_500(listing: Listing) -> None:
    http, _, _, key = listing
    resp = get(http, key, created_after="0001-01-01T00:00:00+01:00")
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "created_after"


def test_the_sdk_walks_every_page(listing: Listing) -> None:
    http, store, tenant_id, key = listing
    session = f"sdk-{uuid.uuid4().hex[:8]}"
    made = [add_job(store, tenant_id, session_id=session) for _ in range(5)]
    with Client(str(http.base_url), key) as client:
        # The in-process app, through the SDK's own calls (TestClient is an httpx.Client).
        client.http = TestClient(http.app, headers={"Authorization": f"Bearer {key}"})
        assert [j["id"] for j in client.jobs(session_id=session, limit=2)] == made
        assert [j["id"] for j in client.jobs(session_id=session, status=["queued"],
                                             limit=2)] == made
