"""The webhook sender as a hostile tenant would try it (issue 28, findings 2 and 3), with
real parts: a `tidegate webhooks` process, HTTP receivers on 127.0.0.1 in threads of
this process (the private-address allowance is set for the sender that calls them), an
in-process API on its own Redis database and SQLite files of its own.

- Malformed callback URLs, non-canonical IPv4 literals and IPv4-in-IPv6 forms are 400s
  naming the field, on submit and on the admin PATCH, and nothing is enqueued.
- A receiver that drips a byte a second ends at the attempt's total deadline; one that
  answers a huge body is read up to the cap; both are recorded as their outcome class.
- One tenant's dripping receivers hold its own slots, not every delivery thread, and its
  backlog does not fill the dispatcher's claims.
- The connection goes to the address that was vetted, whatever DNS answers next.
- A URL that raises in getaddrinfo (or in the parser) is recorded as a failed attempt
  and given up at claim, not claimed for ever.
- GET /v1/jobs/{id}/deliveries shows outcome classes, never an address or an error text.
- Signing secrets are capped per tenant and sealed in the database.
"""

from __future__ import annotations

import ipaddress
import os
import select
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import insert, text, update

from store import Store
from store.models import WebhookDelivery, WebhookSecret
from store.tenants import Tenants
from store.webhooks import Webhooks
from tasks.app import make_app
from tasks.webhooks import CLAIM_PER_TENANT, Sender, Slots, dispatch
from tests.helpers import ApiOfItsOwn, api_of_its_own, own_db
from tests.stack.test_api_validation import QUEUES, waiting
from tidegate import keys, sealing
from tidegate.settings import Settings
from tidegate_tools.procs import Proc, free_port, tidegate_argv, wait_until

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


def own_api(redis_server: str, tmp_root: Path, name: str, **settings: Any) -> Iterator[Hooks]:
    with api_of_its_own(redis_server, tmp_root, name, own_db(__name__, "7"), [("chat", "vllm")],
                        **settings) as own:
        admin_key = Tenants(own.store).create_admin_key("ops")
        record, key = own.store.tenants.create_tenant(f"{name}-tenant", ["chat"])
        yield Hooks(own, admin_key, record.name, key)


@pytest.fixture(scope="module")
def hooks(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Hooks]:
    """The API that the sender process serves: strict URLs at submit, two live secrets."""
    yield from own_api(redis_server, tmp_root, "hooksender", webhook_allow_private=False,
                       webhook_max_secrets=2)


@pytest.fixture(scope="module")
def sender(hooks: Hooks, tmp_root: Path) -> Iterator[Proc]:
    """`tidegate webhooks` on the API's database and namespace: 4 threads, 2 per tenant,
    a deadline of DEADLINE_S, no retry within a test (a minute's backoff)."""
    env = {**os.environ, "TIDEGATE_REDIS_URL": _redis_url(hooks.own.redis),
           "TIDEGATE_DATABASE_URL": _db_url(hooks.own.store),
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


def _redis_url(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw['db']}"


def _db_url(store: Store) -> str:
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


# -- an in-process sender ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pin(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Hooks]:
    """An API of its own with no sender process: the tests below run attempts in this
    process, on a database no other sender claims from."""
    yield from own_api(redis_server, tmp_root, "hookpin")


def sender_of(hooks: Hooks, **settings: Any) -> Sender:
    config = Settings(redis_url=_redis_url(hooks.own.redis), database_url=_db_url(hooks.own.store),
                      namespace=hooks.own.namespace, webhook_timeout_s=DEADLINE_S, **settings)
    return Sender(hooks.own.store, hooks.own.redis, config)


def attempt_all(sender: Sender, tenant_id: int) -> list[str]:
    """Claims what is due and attempts the tenant's, as the dispatcher and a task would."""
    due = Webhooks(sender.store).claim_due(timedelta(seconds=60), 1000)
    return [sender.attempt(d.id) for d in due if d.tenant_id == tenant_id]


def dispatch_now(hooks: Hooks, settings: Settings) -> int:
    """The dispatcher's pass, now: the period lock another test's pass took is let go."""
    held = hooks.own.redis.keys(keys.scheduler_lock(hooks.own.namespace, "webhooks", 0)[:-1]
                                + "*")
    if held:
        hooks.own.redis.delete(*held)
    return dispatch(make_app(settings), hooks.own.redis, hooks.own.store, settings)


@pytest.fixture()
def rebinding(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, list[str]], None]:
    """socket.getaddrinfo with names of the test's own: each lookup of a name gets the
    next of its answers (the last one for ever after), as a rebinding DNS server would."""
    real = socket.getaddrinfo
    answers: dict[str, list[str]] = {}

    def fake(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in answers:
            return real(host, port, *args, **kwargs)
        queue = answers[host]
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        if address == "raise":
            raise UnicodeError("label empty or too long")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return lambda name, addresses: answers.__setitem__(name, list(addresses))


PUBLIC, INTERNAL = "93.184.215.14", "10.20.30.40"


@pytest.fixture()
def routes(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This machine reaches no public or private network: socket.create_connection (what
    httpcore connects with) gets a routing table of the test's own, address -> a
    loopback address serving it. A connection to any other address but loopback fails
    here, so nothing leaves the machine."""
    real = socket.create_connection
    table: dict[str, str] = {}

    def routed(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        host, port = address
        ip = str(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0][4][0])
        if ipaddress.ip_address(ip).is_loopback:  # this machine (the test's own API)
            return real((ip, port), *args, **kwargs)
        if ip not in table:
            raise ConnectionRefusedError(f"no route to {ip} in this test")
        return real((table[ip], port), *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", routed)
    return table


def test_the_connection_goes_to_the_address_that_was_vetted(
        pin: Hooks, rebinding: Callable[[str, list[str]], None], routes: dict[str, str]) -> None:
    """DNS rebinding: the name answers a public address when vetted, an internal one
    after. Under the strict policy, the POST still goes to the public one."""
    public = Receiver("127.0.0.1")
    internal = Receiver("127.0.0.2", public.port)
    routes.update({PUBLIC: "127.0.0.1", INTERNAL: "127.0.0.2"})
    try:
        rebinding("rebind.test", [PUBLIC, INTERNAL])
        tenant_id, key = pin.new_tenant("pinned")
        job_id = ended_job(pin.own.store, tenant_id, f"http://rebind.test:{public.port}/ok")
        assert attempt_all(sender_of(pin, webhook_allow_private=False), tenant_id) == [
            "delivered"]
        assert len(public.got("/ok")) == 1 and internal.got("/ok") == []
        assert public.got("/ok")[0]["headers"]["host"] == f"rebind.test:{public.port}"
        assert pin.deliveries(job_id, key)[0]["status"] == "delivered"
    finally:
        public.close()
        internal.close()


def certificate(name: str, tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for `name` (and its key), made here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.parametrize(("served_as", "outcome"), [("hooks.test", "delivered"),
                                                    ("other.test", "pending")])
def test_tls_is_checked_against_the_urls_name_while_connecting_to_the_vetted_address(
        pin: Hooks, rebinding: Callable[[str, list[str]], None], routes: dict[str, str],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, served_as: str, outcome: str) -> None:
    """Connected to an address, TLS still names the URL's host (SNI) and checks the
    certificate against it: a server whose certificate is another name's is refused."""
    from tasks import webhook_http

    cert, key = certificate(served_as, tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))  # this test's CA only
    monkeypatch.setattr(webhook_http, "_ssl_context", lambda: trusting)
    rx = Receiver("127.0.0.1", tls=server_side)
    routes[PUBLIC] = "127.0.0.1"
    rebinding("hooks.test", [PUBLIC])
    try:
        tenant_id, key_ = pin.new_tenant("tls")
        job_id = ended_job(pin.own.store, tenant_id, f"https://hooks.test:{rx.port}/ok")
        assert attempt_all(sender_of(pin, webhook_allow_private=False), tenant_id) == [outcome]
        delivery = pin.deliveries(job_id, key_)[0]
        assert delivery["last_error"] == (None if outcome == "delivered" else "connect_failed")
        assert len(rx.got("/ok")) == (1 if outcome == "delivered" else 0)
    finally:
        rx.close()


def test_a_url_that_raises_while_resolved_is_recorded_and_given_up_at_claim(
        pin: Hooks, rebinding: Callable[[str, list[str]], None]) -> None:
    rebinding("raises.test", ["raise"])
    tenant_id, key = pin.new_tenant("raises")
    jobs = [ended_job(pin.own.store, tenant_id, url)
            for url in ("http://raises.test/hook", "http://a..b/hook")]
    sender = sender_of(pin, webhook_allow_private=True)
    assert sorted(attempt_all(sender, tenant_id)) == ["pending", "pending"]
    assert [attempts_of(pin, key, j)[0]["error"] for j in jobs] == [
        "connect_failed", "refused_by_policy"]
    # A day later (their rows made older), the dispatcher fails them instead of claiming.
    long_ago = datetime.now(UTC) - timedelta(days=2)
    with pin.own.store.engine.begin() as conn:
        conn.execute(update(WebhookDelivery).where(WebhookDelivery.tenant_id == tenant_id)
                     .values(created_at=long_ago, next_attempt_at=long_ago))
    dispatch_now(pin, sender.settings)
    for job_id in jobs:
        delivery = pin.deliveries(job_id, key)[0]
        assert (delivery["status"], delivery["last_error"]) == ("failed", "gave_up")


def test_a_tenants_backlog_does_not_fill_the_dispatchers_claims(pin: Hooks) -> None:
    """250 deliveries of one tenant due before another's: a period's claims (200) take
    at most the tenant's concurrency cap of the first, and the other's among them; once
    the first tenant's slots are all held (its receivers are slow), none of its
    deliveries is claimed at all (each would only be deferred: the sender's time spent
    on the slowest tenant)."""
    noisy_id, _ = pin.new_tenant("backlog")
    victim_id, victim_key = pin.new_tenant("behind")
    for _ in range(250):
        ended_job(pin.own.store, noisy_id, "https://hooks.example/drip")
    victim = ended_job(pin.own.store, victim_id, "https://hooks.example/ok")
    sender = sender_of(pin)
    dispatch_now(pin, sender.settings)
    assert pin.deliveries(victim, victim_key)[0]["status"] == "sending"
    cap = min(CLAIM_PER_TENANT, sender.settings.webhook_tenant_concurrency)
    assert claimed_of(pin, noisy_id) == cap
    with pin.own.store.engine.begin() as conn:  # back to pending, due now
        conn.execute(text("UPDATE webhook_deliveries SET status = 'pending', "
                          "next_attempt_at = :now WHERE tenant_id = :t"),
                     {"t": noisy_id, "now": datetime.now(UTC) - timedelta(seconds=1)})
    for n in range(sender.settings.webhook_tenant_concurrency):  # its slots all held
        assert sender.slots.take(noisy_id, f"drip-{n}.example", f"held-{n}")
    try:
        dispatch_now(pin, sender.settings)
        assert claimed_of(pin, noisy_id) == 0
    finally:
        for n in range(sender.settings.webhook_tenant_concurrency):
            sender.slots.release(noisy_id, f"drip-{n}.example", f"held-{n}")


def claimed_of(hooks: Hooks, tenant_id: int) -> int:
    with hooks.own.store.engine.connect() as conn:
        claimed = conn.execute(text("SELECT count(*) FROM webhook_deliveries WHERE "
                                    "tenant_id = :t AND status = 'sending'"), {"t": tenant_id})
        return int(claimed.scalar() or 0)


def test_deliveries_show_outcome_classes_never_addresses_or_error_text(pin: Hooks) -> None:
    tenant_id, key = pin.new_tenant("scanner")
    closed = free_port()
    jobs = [ended_job(pin.own.store, tenant_id, url) for url in (
        f"http://localhost.localdomain.localhost:{closed}/",  # a name of a private address
        f"http://127.0.0.1:{closed}/")]  # an allowed host, a closed port
    attempt_all(sender_of(pin, webhook_allow_private=False, webhook_allow_hosts="127.0.0.1"),
                tenant_id)
    shown = [pin.deliveries(j, key)[0] for j in jobs]
    assert [(d["last_error"], [a["error"] for a in d["log"]]) for d in shown] == [
        ("refused_by_policy", ["refused_by_policy"]), ("connect_failed", ["connect_failed"])]


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


def test_a_secret_stored_plain_before_sealing_still_signs_and_gets_sealed(pin: Hooks) -> None:
    tenant, _ = pin.own.store.tenants.create_tenant(f"legacy-{uuid.uuid4().hex[:6]}", ["chat"])
    plain = "whsec_" + "A" * 43 + "="
    with pin.own.store.engine.begin() as conn:
        conn.execute(insert(WebhookSecret).values(tenant_id=tenant.id, secret=plain,
                                                  created_at=datetime.now(UTC)))
    hooks = Webhooks(pin.own.store, sealing.sealer(Settings()))
    assert hooks.secrets_of(tenant.id) == [plain]
    assert hooks.seal_plain() >= 1  # what `tidegate webhooks` does at start
    assert hooks.secrets_of(tenant.id) == [plain]
    with pin.own.store.engine.connect() as conn:
        stored = conn.execute(text("SELECT secret FROM webhook_secrets WHERE tenant_id = :t"),
                              {"t": tenant.id}).scalar_one()
    assert plain not in stored and not stored.startswith("whsec_")
