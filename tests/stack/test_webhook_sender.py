"""The webhook sender as a hostile tenant would try it (issue 28, findings 2 and 3), with
real parts: a `tidegate webhooks` process, HTTP receivers on 127.0.0.1 in threads of
this process (the private-address allowance is set for the sender that calls them), an
in-process API on its own Redis database and SQLite files of its own.

- Malformed callback URLs, non-canonical IPv4 literals and IPv4-in-IPv6 forms are 400s
  naming the field, on submit and on the admin PATCH, and nothing is enqueued.
- A receiver that drips a byte a second ends at the attempt's total deadline; one that
  answers a huge body is read up to the cap; both are recorded as their outcome class.
- One tenant's dripping receivers hold its own slots, not every delivery thread; the
  slots are counted in Redis, across webhook processes.
- Signing secrets are capped per tenant and sealed in the database.

Attempts run in this process (the vetted address, TLS, a URL that raises, the
dispatcher's claims, what GET /v1/jobs/{id}/deliveries shows, a secret stored plain) are
tests/stack/test_webhook_sender_in_process.py, on these receivers and helpers.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import text

from store import Store
from store.tenants import Tenants
from store.webhooks import Webhooks
from tasks.webhooks import Slots
from tests.helpers import ApiOfItsOwn, api_of_its_own, own_db
from tests.stack.test_api_validation import QUEUES, waiting
from tidegate import sealing
from tidegate.settings import Settings
from tidegate_tools.procs import Proc, tidegate_argv, wait_until

DEADLINE_S = 5.0  # the sender process's TIDEGATE_WEBHOOK_TIMEOUT_S
DRIP_BYTES = 1000  # a dripping receiver's body: 1000 s at a byte a second
HUGE_BYTES = 256 * 1024 * 1024
CHUNK = b"\0" * 65536


class Receiver:
    """HTTP on one address, in threads: /ok answers 200; /drip answers 200 and a body of
    DRIP_BYTES, one byte a second, until the client goes; /huge answers 200 and a body of
    HUGE_BYTES as fast as it is read. Records each request and what each body cost."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.dripped: list[int] = []  # bytes each finished drip sent
        self.huge_written: list[int] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), self._handler())
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                with rx.lock:
                    rx.requests.append({"path": self.path,
                                        "headers": {k.lower(): v for k, v in self.headers.items()}})
                body = {"/drip": DRIP_BYTES, "/huge": HUGE_BYTES}.get(self.path, 0)
                self.send_response(200)
                self.send_header("Content-Length", str(body))
                self.end_headers()
                self.wfile.flush()
                if self.path == "/drip":
                    rx._record(rx.dripped, rx.drip(self.connection))
                elif self.path == "/huge":
                    rx._record(rx.huge_written, rx.flood(self.connection))

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def drip(self, conn: socket.socket) -> int:
        sent = 0
        while sent < DRIP_BYTES and not self.stop.is_set():
            # A second between bytes, unless the client hangs up first (readable: EOF).
            if select.select([conn], [], [], 1.0)[0] and not conn.recv(1, socket.MSG_PEEK):
                break
            try:
                conn.sendall(b"x")
            except OSError:
                break
            sent += 1
        return sent

    def flood(self, conn: socket.socket) -> int:
        written = 0
        while written < HUGE_BYTES and not self.stop.is_set():
            try:
                conn.sendall(CHUNK)
            except OSError:
                break
            written += len(CHUNK)
        return written

    def _record(self, into: list[int], value: int) -> None:
        with self.lock:
            into.append(value)

    def got(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["path"] == path]

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Hooks:
    """The in-process API (its store, Redis and URL), its admin key and its tenant."""

    own: ApiOfItsOwn
    admin_key: str
    tenant: str
    key: str

    def call(self, method: str, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.own.base_url + path, timeout=30, **kw,
                             headers={"Authorization": f"Bearer {key or self.key}"})

    def deliveries(self, job_id: str, key: str | None = None) -> list[dict[str, Any]]:
        resp = self.call("GET", f"/v1/jobs/{job_id}/deliveries", key)
        assert resp.status_code == 200, resp.text
        return list(resp.json()["data"])

    def new_tenant(self, name: str) -> tuple[int, str]:
        record, key = self.own.store.tenants.create_tenant(f"{name}-{uuid.uuid4().hex[:6]}",
                                                           ["chat"])
        resp = self.call("POST", "/v1/webhook-secret", key)
        assert resp.status_code == 200, resp.text
        return record.id, key


def own_api(redis_server: str, tmp_root: Path, name: str, db: int,
            **settings: Any) -> Iterator[Hooks]:
    """Hooks on an API of its own whose Redis database is `db` (the calling module's own_db:
    tests/stack/test_webhook_sender_in_process.py makes its API here too)."""
    with api_of_its_own(redis_server, tmp_root, name, db, [("chat", "vllm")],
                        **settings) as own:
        admin_key = Tenants(own.store).create_admin_key("ops")
        record, key = own.store.tenants.create_tenant(f"{name}-tenant", ["chat"])
        yield Hooks(own, admin_key, record.name, key)


@pytest.fixture(scope="module")
def hooks(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Hooks]:
    """The API that the sender process serves: strict URLs at submit, two live secrets."""
    yield from own_api(redis_server, tmp_root, "hooksender", own_db(__name__, "7"),
                       webhook_allow_private=False, webhook_max_secrets=2)


@pytest.fixture(scope="module")
def sender(hooks: Hooks, tmp_root: Path) -> Iterator[Proc]:
    """`tidegate webhooks` on the API's database and namespace: 4 threads, 2 per tenant,
    a deadline of DEADLINE_S, no retry within a test (a minute's backoff)."""
    env = {**os.environ, "TIDEGATE_REDIS_URL": redis_url_of(hooks.own.redis),
           "TIDEGATE_DATABASE_URL": database_url_of(hooks.own.store),
           "TIDEGATE_NAMESPACE": hooks.own.namespace, "TIDEGATE_WEBHOOK_ALLOW_PRIVATE": "true",
           "TIDEGATE_WEBHOOK_TIMEOUT_S": str(DEADLINE_S), "TIDEGATE_WEBHOOK_DISPATCH_S": "0.2",
           "TIDEGATE_WEBHOOK_BACKOFF_S": "60", "TIDEGATE_WEBHOOK_CONCURRENCY": "4",
           "TIDEGATE_WEBHOOK_TENANT_CONCURRENCY": "2"}
    proc = Proc("webhook-sender", tidegate_argv("webhooks"), tmp_root / "logs" /
                "webhook-sender.log", env)
    try:
        yield proc
    finally:
        proc.stop()


def redis_url_of(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw['db']}"


def database_url_of(store: Store) -> str:
    return store.url.render_as_string(hide_password=False)


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    try:
        yield rx
    finally:
        rx.close()


def ended_job(store: Store, tenant_id: int, url: str) -> str:
    """A job that ended (cancelled while queued) with `url` as its callback: its delivery
    is in the outbox. Written to the store directly, as a job accepted before the strict
    check (or through a tenant's default URL) would be."""
    job_id = str(uuid.uuid4())
    store.jobs.create_job(job_id, tenant_id, "chat", "chat.vllm", 5, None, {"max_tokens": 8}, 10,
                          callback_url=url)
    assert store.runs.cancel_job(job_id) is not None
    return job_id


def attempts_of(hooks: Hooks, key: str, job_id: str) -> list[dict[str, Any]]:
    found = hooks.deliveries(job_id, key)
    return list(found[0]["log"]) if found else []


# -- refused at submit -------------------------------------------------------------------

MALFORMED = ["http://[::1", "http://crm.example.com:99999/x", "http://crm.example.com:abc/x",
             "http://crm\x01example.com/x", "http://crm.example.com/x\ny", "http://a..b/x"]
LITERALS = ["http://2130706433/", "http://0x7f000001/", "http://127.1/", "http://0/",
            "http://localhost./", "http://017700000001/", "http://[::127.0.0.1]/",
            "http://[64:ff9b::a9fe:a9fe]/", "http://[::ffff:169.254.169.254]/",
            "http://[2002:a9fe:a9fe::1]/", "http://[2001:0:a9fe:a9fe::1]/"]


@pytest.mark.parametrize("url", MALFORMED + LITERALS)
def test_each_malformed_or_disguised_url_is_a_400_on_submit_naming_callback_url(
        hooks: Hooks, url: str) -> None:
    before = hooks.own.store.jobs.count_jobs()
    resp = hooks.call("POST", "/v1/jobs", json={"lane": "chat", "prompt": "Where is my parcel?",
                                                "max_tokens": 4, "callback_url": url})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["field"] == "callback_url"
    assert hooks.own.store.jobs.count_jobs() == before
    assert all(waiting(hooks.own.redis, q) == 0 for q in QUEUES)


@pytest.mark.parametrize("url", MALFORMED + LITERALS[:3])
def test_each_malformed_url_is_a_400_on_the_admin_patch_naming_webhook_url(
        hooks: Hooks, url: str) -> None:
    resp = hooks.call("PATCH", f"/admin/v1/tenants/{hooks.tenant}", hooks.admin_key,
                      json={"webhook_url": url})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["field"] == "webhook_url"
    shown = hooks.call("GET", f"/admin/v1/tenants/{hooks.tenant}", hooks.admin_key).json()
    assert shown["webhook_url"] is None


# -- the sender process ------------------------------------------------------------------


def test_a_dripping_receiver_ends_at_the_total_deadline_and_is_recorded(
        hooks: Hooks, sender: Proc, receiver: Receiver) -> None:
    tenant_id, key = hooks.new_tenant("drip")
    job_id = ended_job(hooks.own.store, tenant_id, f"{receiver.url}/drip")
    wait_until(lambda: bool(attempts_of(hooks, key, job_id)), 60,
               "the dripping attempt to be recorded", [sender])
    attempt = attempts_of(hooks, key, job_id)[0]
    assert attempt["error"] == "timeout" and attempt["status_code"] is None
    # The whole attempt, not each read: it ended at the deadline, a few bytes in.
    assert attempt["duration_ms"] < 2 * DEADLINE_S * 1000
    wait_until(lambda: bool(receiver.dripped), 30, "the receiver to see the sender go")
    assert receiver.dripped[0] < 3 * DEADLINE_S
    assert hooks.deliveries(job_id, key)[0]["status"] == "pending"  # retried later


def test_a_huge_answer_is_read_only_up_to_the_cap(hooks: Hooks, sender: Proc,
                                                  receiver: Receiver) -> None:
    tenant_id, key = hooks.new_tenant("huge")
    job_id = ended_job(hooks.own.store, tenant_id, f"{receiver.url}/huge")
    wait_until(lambda: bool(attempts_of(hooks, key, job_id)), 60,
               "the huge answer's attempt to be recorded", [sender])
    attempt = attempts_of(hooks, key, job_id)[0]
    assert (attempt["error"], attempt["status_code"]) == ("response_too_large", 200)
    wait_until(lambda: bool(receiver.huge_written), 30, "the receiver to see the sender go")
    # The sender hung up after its cap: what the receiver wrote is what socket buffers held.
    assert receiver.huge_written[0] < 32 * 1024 * 1024


def test_one_tenants_dripping_receivers_do_not_hold_up_another_tenants_delivery(
        hooks: Hooks, sender: Proc, receiver: Receiver) -> None:
    noisy_id, noisy_key = hooks.new_tenant("noisy")
    victim_id, victim_key = hooks.new_tenant("victim")
    noisy = [ended_job(hooks.own.store, noisy_id, f"{receiver.url}/drip") for _ in range(16)]
    wait_until(lambda: len(receiver.got("/drip")) >= 2, 60, "the noisy tenant's drips",
               [sender])
    victim = ended_job(hooks.own.store, victim_id, f"{receiver.url}/ok")
    wait_until(lambda: hooks.deliveries(victim, victim_key)[0]["status"] == "delivered", 120,
               "the victim's delivery", [sender])
    delivery = hooks.deliveries(victim, victim_key)[0]
    assert delivery["attempts"] == 1
    # 16 drips on 4 threads would hold the victim for four deadlines; capped, the noisy
    # tenant holds 2 threads, and the victim waits for no attempt of theirs.
    waited = _seconds(delivery["delivered_at"]) - _seconds(delivery["created_at"])
    assert waited < DEADLINE_S + 3, f"the victim's webhook waited {waited:.1f} s"
    assert any(hooks.deliveries(j, noisy_key)[0]["status"] != "delivered" for j in noisy)


def test_slots_cap_deliveries_per_tenant_and_per_host_across_processes(hooks: Hooks) -> None:
    """The caps live in Redis: two Slots (two webhook processes) share them."""
    settings = Settings(namespace=f"{hooks.own.namespace}-slots", webhook_tenant_concurrency=2,
                        webhook_host_concurrency=3)
    one, two = Slots(hooks.own.redis, settings), Slots(hooks.own.redis, settings)
    assert one.take(1, "hooks.example", "a1") and two.take(1, "hooks.example", "a2")
    assert not one.take(1, "other.example", "a3")  # the tenant's two are in flight
    assert two.take(2, "hooks.example", "b1")
    assert not one.take(3, "hooks.example", "c1")  # the host's three are in flight
    assert one.take(3, "other.example", "c2")
    two.release(1, "hooks.example", "a2")
    assert one.take(3, "hooks.example", "c3") and not one.take(1, "hooks.example", "a4")


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


# -- signing secrets ---------------------------------------------------------------------


def test_secrets_are_capped_and_sealed(hooks: Hooks) -> None:
    tenant, key = hooks.own.store.tenants.create_tenant(f"rotor-{uuid.uuid4().hex[:6]}", ["chat"])
    made = []
    for _ in range(4):
        resp = hooks.call("POST", "/v1/webhook-secret", key)
        assert resp.status_code == 200, resp.text
        made.append(resp.json()["secret"])
    live = Webhooks(hooks.own.store, sealing.sealer(Settings())).secrets_of(tenant.id)
    assert live == made[::-1][:2]  # the newest two (TIDEGATE_WEBHOOK_MAX_SECRETS), newest first
    with hooks.own.store.engine.connect() as conn:
        stored = [row[0] for row in conn.execute(text(
            "SELECT secret FROM webhook_secrets WHERE tenant_id = :t"), {"t": tenant.id})]
    assert len(stored) == 4
    assert not any(secret in value or secret[6:] in value for secret in made for value in stored)
