"""The webhook sender's attempts and the dispatcher's pass run in this process, as a
hostile tenant would try them (issue 28, findings 2 and 3), on an API of its own (its own
Redis database and SQLite file, no sender process claiming from it), with HTTP receivers
on loopback addresses in threads and the test's own DNS answers and routes, so nothing
leaves the machine. tests/stack/test_webhook_sender.py has the `tidegate webhooks`
process, and the receivers and helpers these tests share.

- The connection goes to the address that was vetted, whatever DNS answers next, and TLS
  still checks the certificate against the URL's name.
- A URL that raises in getaddrinfo (or in the parser) is recorded as a failed attempt
  and given up at claim, not claimed for ever.
- One tenant's backlog does not fill the dispatcher's claims.
- GET /v1/jobs/{id}/deliveries shows outcome classes, never an address or an error text.
- A signing secret stored plain before sealing still signs, and gets sealed.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, text, update

from store.models import WebhookDelivery, WebhookSecret
from store.webhooks import Webhooks
from tasks.app import make_app
from tasks.webhooks import CLAIM_PER_TENANT, Sender, dispatch
from tests.helpers import own_db
from tests.stack.test_webhook_sender import (
    DEADLINE_S,
    Hooks,
    Receiver,
    attempts_of,
    database_url_of,
    ended_job,
    own_api,
    redis_url_of,
)
from tidegate import keys, sealing
from tidegate.settings import Settings
from tidegate_tools.procs import free_port


@pytest.fixture(scope="module")
def pin(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Hooks]:
    """An API of its own with no sender process: the tests below run attempts in this
    process, on a database no other sender claims from."""
    yield from own_api(redis_server, tmp_root, "hookpin", own_db(__name__))


def sender_of(hooks: Hooks, **settings: Any) -> Sender:
    config = Settings(redis_url=redis_url_of(hooks.own.redis),
                      database_url=database_url_of(hooks.own.store),
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


# -- signing secrets ---------------------------------------------------------------------


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
