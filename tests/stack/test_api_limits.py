"""Load bounds (issue 10, finding 10, and the SSE caps of finding 9): over each, a 429 JSON
error whose `type` names the bound, with Retry-After, and nothing enqueued or opened.

The API runs in this process (tests/helpers.py `served`: real HTTP) with caps small enough
to reach, on a Redis DB and a database of its own. No worker consumes there: a worker of
each lane is only advertised (its heartbeat), so jobs stay queued, and the queue lengths
and rows show exactly what the API accepted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio

from api.deps import REDIS_SPARE_CONNECTIONS
from store import Store
from tasks.app import queue_lengths
from tests.helpers import api_of_its_own, metric, own_db
from tidegate import keys
from tidegate_tools.procs import wait_until

CAPS = {"max_in_flight_per_tenant": 4, "max_queue_depth": 6, "sse_max_streams": 3,
        "sse_max_streams_per_tenant": 2, "sse_keepalive_s": 0.25}
QUEUES = ("chat.vllm", "support.primary")
ASK = [{"role": "user", "content": "Where is my parcel?"}]


@dataclass
class Api:
    base_url: str
    app: Any
    store: Store
    redis: redis.Redis

    def http(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30,
                            headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Api]:
    advertised = [("chat", "vllm"), ("support", "primary")]
    with api_of_its_own(redis_server, tmp_root, "limits", own_db(__name__, "12"), advertised,
                        **CAPS) as own:
        yield Api(own.base_url, own.app, own.store, own.redis)


@pytest.fixture(autouse=True)
def empty_queues(api: Api) -> Iterator[None]:
    """Each case starts with empty lane queues (a cancelled job's message stays queued),
    and the API reads them again: the depths it knows may be a second old (api/limits.py
    Refresher), and the next case may start sooner."""
    yield
    for queue in QUEUES:
        api.redis.delete(*keys.queue_sublists(queue))
    api.app.state.deps.backlogs.forget()


def tenant(api: Api, name: str, lane: str) -> str:
    # Granted every priority: the depth cases ask 9 in a lane whose default is 4.
    return api.store.tenants.create_tenant(name, [lane], max_priority=9)[1]


def submit(http: httpx.Client, lane: str, priority: int | None = None,
           idempotency_key: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"lane": lane, "messages": ASK, "max_tokens": 8}
    if priority is not None:
        body["priority"] = priority
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    return http.post("/v1/jobs", json=body)


def refused(resp: httpx.Response, kind: str) -> str:
    """The message of a 429 of `kind` with a Retry-After, asserted as such."""
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["Retry-After"]) >= 1
    error = resp.json()["error"]
    assert error["type"] == kind and error["field"] is None
    return str(error["message"])


def shed(http: httpx.Client, reason: str) -> float:
    return metric(http.get("/metrics").text, "tidegate_requests_rejected_total", reason=reason,
                  status="429")


def test_jobs_in_flight_per_tenant_are_capped(api: Api) -> None:
    with api.http(tenant(api, "limits-in-flight", "chat")) as http:
        counted = shed(http, "too_many_in_flight")
        accepted = [submit(http, "chat", idempotency_key=f"in-flight-{i}") for i in range(4)]
        assert [r.status_code for r in accepted] == [202] * 4
        message = refused(submit(http, "chat", idempotency_key="in-flight-4"),
                          "too_many_in_flight")
        assert "4 jobs queued or running" in message
        assert queue_lengths(api.redis, ["chat.vllm"])["chat.vllm"] == 4
        assert shed(http, "too_many_in_flight") == counted + 1
        # A replay is no new job: it still answers with its job.
        again = submit(http, "chat", idempotency_key="in-flight-0")
        assert again.status_code == 200 and again.json()["job_id"] == accepted[0].json()["job_id"]
        # A job that ends (here cancelled) gives its place back.
        cancelled = http.delete(f"/v1/jobs/{accepted[0].json()['job_id']}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert submit(http, "chat", idempotency_key="in-flight-5").status_code == 202


def test_a_full_lane_sheds_its_lowest_priorities_first(api: Api) -> None:
    """support: default priority 4, depth cap 6. Below the default the bound is lower (half
    the cap at priority 0, 5 at priority 3); at it and above, the cap."""
    first, second = (api.http(tenant(api, f"limits-depth-{i}", "support")) for i in range(2))
    with first, second:
        assert [submit(first, "support").status_code for _ in range(3)] == [202] * 3
        message = refused(submit(first, "support", priority=0), "queue_full")
        assert "lane 'support' has 3 jobs waiting" in message and "priority 0" in message
        assert [submit(second, "support").status_code for _ in range(2)] == [202] * 2
        refused(submit(second, "support", priority=3), "queue_full")  # 5 wait: its bound
        assert submit(second, "support", priority=9).status_code == 202  # 5 < 6
        message = refused(submit(second, "support", priority=9), "queue_full")
        assert "it takes at most 6" in message
        assert queue_lengths(api.redis, ["support.primary"])["support.primary"] == 6


@contextlib.contextmanager
def opened(http: httpx.Client, job_id: str) -> Iterator[httpx.Response]:
    """The job's event stream, held open until the block ends."""
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        if resp.status_code != 200:
            resp.read()
        yield resp


def test_sse_streams_are_capped_per_tenant_and_per_process(api: Api) -> None:
    """At most 2 streams per tenant and 3 in this API process; a closed one gives its slot
    back. The Redis pool the streams read from is bounded to match."""
    one, two = (api.http(tenant(api, f"limits-sse-{i}", "chat")) for i in range(2))
    with one, two, contextlib.ExitStack() as streams:
        jobs_one = [submit(one, "chat").json()["job_id"] for _ in range(3)]
        jobs_two = [submit(two, "chat").json()["job_id"] for _ in range(2)]
        first = streams.enter_context(opened(one, jobs_one[0]))
        assert streams.enter_context(opened(one, jobs_one[1])).status_code == 200
        with opened(one, jobs_one[2]) as third:
            assert "this API key has 2 streams open" in refused(third, "too_many_streams")
        assert streams.enter_context(opened(two, jobs_two[0])).status_code == 200
        with opened(two, jobs_two[1]) as fourth:
            assert "this API process has 3 streams open" in refused(fourth, "too_many_streams")
        scrape = one.get("/metrics").text
        assert metric(scrape, "tidegate_sse_streams") == 3
        assert metric(scrape, "tidegate_requests_rejected_total", reason="too_many_streams",
                      status="429") == 2
        first.close()

        def reopens() -> bool:
            with opened(two, jobs_two[1]) as again:
                return again.status_code == 200

        wait_until(reopens, 10, "a stream slot given back by a closed stream")
    pool = api.app.state.deps.redis.connection_pool
    assert pool.max_connections == CAPS["sse_max_streams"] + REDIS_SPARE_CONNECTIONS
    assert isinstance(pool, redis.asyncio.BlockingConnectionPool)
