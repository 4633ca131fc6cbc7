"""Callback URLs as plain code (tasks/webhook_urls.py): the one strict parser, the address
policy, a delivery's vetting of what a name resolves to (with resolvers of the test's
own, no DNS); the outcome classes a tenant sees; the claim lease against the attempt's
deadline; and secrets sealed at rest (tidegate/sealing.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from pydantic import ValidationError

from store.webhooks import Outcome, shown
from tasks.webhook_http import status_class
from tasks.webhook_urls import ResolveFailed, UrlMalformed, UrlRefused, check_url, vet
from tasks.webhooks import lease_s
from tidegate import sealing
from tidegate.settings import Settings

STRICT = Settings(webhook_allow_private=False, webhook_allow_hosts="hooks.internal")
ALLOWING = Settings(webhook_allow_private=True)

NOT_URLS = ["http://[::1", "http://crm.example.com:99999/", "http://crm.example.com:0/",
            "http://crm.example.com:abc/", "http://crm\x01example.com/", "http://crm\x7f.com/",
            "http://crm.example.com/a\nb", "http://a..b/", "http://-crm.example.com/",
            "http://crm_hooks.example.com/", "http://crm%2eexample.com/",
            "http://user:pw@crm.example.com/", "http://crm.example.com\\@10.0.0.1/",
            "http://[fe80::1%25eth0]/", "https://" + "a" * 2050 + ".com/"]
# Addresses written so that a check of the usual form misses them.
DISGUISED = ["http://2130706433/", "http://0x7f000001/", "http://127.1/", "http://0/",
             "http://localhost./", "http://017700000001/", "http://127.0.0.01/",
             "http://1.2.3.4.5/", "http://crm.0x10/", "http://[::127.0.0.1]/",
             "http://[::ffff:127.0.0.1]/", "http://[::ffff:a9fe:a9fe]/",
             "http://[64:ff9b::a9fe:a9fe]/", "http://[64:ff9b:1::a9fe:a9fe]/",
             "http://[2002:a9fe:a9fe::1]/", "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/"]


@pytest.mark.parametrize("settings", [STRICT, ALLOWING], ids=["strict", "allowing"])
@pytest.mark.parametrize("url", NOT_URLS + DISGUISED)
def test_malformed_and_disguised_urls_are_malformed_whatever_the_policy(
        url: str, settings: Settings) -> None:
    with pytest.raises(UrlMalformed):
        check_url(url, settings)


PRIVATE = ["http://127.0.0.1:8080/", "http://10.1.2.3/", "http://172.16.0.1/",
           "http://192.168.0.9/", "http://169.254.169.254/latest/meta-data",
           "http://100.64.0.1/", "http://198.18.0.1/", "http://192.0.2.1/", "http://[::1]/",
           "http://[fe80::1]/", "http://[fc00::1]/", "http://[2001:db8::1]/",
           "http://localhost/", "http://hooks.localhost/"]


@pytest.mark.parametrize("url", PRIVATE)
def test_private_addresses_are_refused_unless_allowed(url: str) -> None:
    with pytest.raises(UrlRefused) as refused:
        check_url(url, STRICT)
    assert not isinstance(refused.value, UrlMalformed)  # well formed: a 422, not a 400
    assert check_url(url, ALLOWING)


@pytest.mark.parametrize("url", ["http://0.0.0.0/", "http://0.1.2.3/", "http://224.0.0.1/",
                                 "http://240.0.0.1/", "http://255.255.255.255/",
                                 "http://[ff02::1]/", "http://[::]/", "ftp://crm.example.com/",
                                 "crm.example.com/hook", "http:///nohost"])
def test_what_no_allowance_lets_through(url: str) -> None:
    with pytest.raises(UrlRefused):
        check_url(url, ALLOWING)


@pytest.mark.parametrize(("url", "host", "port", "target", "host_header"), [
    ("https://CRM.example.com/hooks/tg?x=1#f", "crm.example.com", 443, b"/hooks/tg?x=1",
     "crm.example.com"),
    ("http://93.184.215.14:8080/x", "93.184.215.14", 8080, b"/x", "93.184.215.14:8080"),
    ("http://[2606:4700::1]/", "2606:4700::1", 80, b"/", "[2606:4700::1]"),
    ("https://bücher.example/ü", "xn--bcher-kva.example", 443, b"/%C3%BC",
     "xn--bcher-kva.example"),
    ("https://hooks.internal/x", "hooks.internal", 443, b"/x", "hooks.internal"),
])
def test_public_urls_parse_into_what_is_sent(url: str, host: str, port: int, target: bytes,
                                             host_header: str) -> None:
    parsed = check_url(url, STRICT)
    assert (parsed.host, parsed.port, parsed.target, parsed.host_header) == (
        host, port, target, host_header)


def test_a_denied_host_is_refused_even_when_private_addresses_are_allowed() -> None:
    with pytest.raises(UrlRefused, match="denied"):
        check_url("https://evil.example/x", Settings(webhook_allow_private=True,
                                                     webhook_deny_hosts="evil.example"))


# -- vetting what a name resolves to -----------------------------------------------------


def resolver(*addresses: str) -> Any:
    def resolve(host: str, port: int, *args: Any) -> list[tuple[Any, ...]]:
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port)) for a in addresses]
    return resolve


def soon() -> float:
    return time.monotonic() + 30


def test_a_name_vets_to_its_addresses_when_all_are_public() -> None:
    url = check_url("https://crm.example.com/x", STRICT)
    assert vet(url, STRICT, soon(), resolver("93.184.215.14", "2606:4700::1",
                                             "93.184.215.14")) == [
        "93.184.215.14", "2606:4700::1"]


@pytest.mark.parametrize("internal", ["10.0.0.7", "127.0.0.1", "169.254.169.254",
                                      "100.100.100.200", "fd00::7", "::ffff:10.0.0.7",
                                      "64:ff9b::a9fe:a9fe"])
def test_a_name_is_refused_when_any_of_its_addresses_is_and_says_not_which(
        internal: str) -> None:
    url = check_url("https://crm.example.com/x", STRICT)
    with pytest.raises(UrlRefused) as refused:
        vet(url, STRICT, soon(), resolver("93.184.215.14", internal))
    assert internal not in str(refused.value) and "93.184" not in str(refused.value)


def test_an_allowed_host_may_resolve_to_a_private_address_but_not_an_embedded_one() -> None:
    url = check_url("https://hooks.internal/x", STRICT)
    assert vet(url, STRICT, soon(), resolver("10.0.0.7")) == ["10.0.0.7"]
    with pytest.raises(UrlRefused):
        vet(url, STRICT, soon(), resolver("::ffff:10.0.0.7"))


@pytest.mark.parametrize("error", [UnicodeError("label empty or too long"),
                                   socket.gaierror(-2, "Name or service not known"),
                                   ValueError("anything")])
def test_a_resolver_that_raises_anything_is_a_failed_resolution(error: Exception) -> None:
    def resolve(*args: Any) -> list[tuple[Any, ...]]:
        raise error

    with pytest.raises(ResolveFailed) as failed:
        vet(check_url("https://crm.example.com/x", STRICT), STRICT, soon(), resolve)
    assert not failed.value.timed_out


def test_a_resolver_slower_than_the_deadline_is_a_timeout() -> None:
    release = threading.Event()

    def hangs(*args: Any) -> list[tuple[Any, ...]]:
        release.wait(30)  # a resolver that does not answer (let go when the test ends)
        return []

    try:
        with pytest.raises(ResolveFailed) as failed:
            vet(check_url("https://crm.example.com/x", STRICT), STRICT,
                time.monotonic() + 0.2, hangs)
        assert failed.value.timed_out
    finally:
        release.set()


# -- what a tenant sees; the lease -------------------------------------------------------


@pytest.mark.parametrize(("code", "outcome"), [(200, "2xx"), (204, "2xx"), (302, "3xx"),
                                               (404, "4xx"), (503, "5xx"), (99, "bad_response"),
                                               (600, "bad_response")])
def test_status_codes_become_classes(code: int, outcome: str) -> None:
    assert status_class(code) == outcome


def test_error_text_written_before_classes_is_shown_as_error() -> None:
    legacy = ("UrlRefused: host 'x' is a private, loopback or reserved address (10.0.0.7)",
              "ConnectError: [Errno 111] Connection refused", "HTTP 500")
    assert [shown(text) for text in legacy] == ["error"] * 3
    assert [shown(o.value) for o in Outcome] == [o.value for o in Outcome]
    assert shown(None) is None


@pytest.mark.parametrize("timeout_s", [0.5, 10.0, 120.0])
def test_the_claim_lease_outlasts_the_worst_attempt(timeout_s: float) -> None:
    assert lease_s(Settings(webhook_timeout_s=timeout_s)) >= 2 * timeout_s + 30


# -- secrets sealed at rest --------------------------------------------------------------


def test_a_sealed_secret_opens_under_its_key_and_after_a_key_rotation() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    token = sealing.sealer(Settings(webhook_secret_key=old)).encrypt(b"whsec_secret")
    assert b"whsec_secret" not in token
    rotated = sealing.sealer(Settings(webhook_secret_key=f"{new},{old}"))
    assert rotated.decrypt(token) == b"whsec_secret"
    with pytest.raises(sealing.InvalidToken):
        sealing.sealer(Settings(webhook_secret_key=new)).decrypt(token)


def test_the_development_key_is_made_once_readable_by_its_owner_only(tmp_path: Path) -> None:
    settings = Settings(webhook_secret_key="", data_dir=tmp_path / "data")
    token = sealing.sealer(settings).encrypt(b"whsec_secret")
    key_file = tmp_path / "data" / sealing.DEV_KEY_FILE
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert sealing.sealer(settings).decrypt(token) == b"whsec_secret"  # the same key
    assert [p.name for p in key_file.parent.iterdir()] == [sealing.DEV_KEY_FILE]


def test_no_key_and_no_place_for_the_development_key_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(sealing.KeyMissing, match="TIDEGATE_WEBHOOK_SECRET_KEY"):
        sealing.sealer(Settings(webhook_secret_key="", data_dir=tmp_path / "a-file" / "data"))


def test_a_key_that_is_not_a_fernet_key_is_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="webhook_secret_key"):
        Settings(webhook_secret_key="not-a-key")


# -- the sender's NetworkPolicy (deploy/k8s/webhooks-egress.yaml) ------------------------

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def egress_policy() -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load((K8S / "webhooks-egress.yaml").read_text()))


def ip_blocks_allow(policy: dict[str, Any], address: str) -> bool:
    """Whether an ipBlock rule of the policy lets the sender reach `address`."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    for rule in policy["spec"]["egress"]:
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None or ip.version != ipaddress.ip_network(block["cidr"]).version:
                continue
            if ip in ipaddress.ip_network(block["cidr"]) and not any(
                    ip in ipaddress.ip_network(n) for n in block.get("except", [])):
                return True
    return False


def test_the_network_policy_holds_the_webhook_pods() -> None:
    import yaml

    policy = egress_policy()
    deployment = yaml.safe_load((K8S / "webhooks.yaml").read_text())
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in policy["spec"]


@pytest.mark.parametrize("address", [
    "169.254.169.254", "100.100.100.200", "10.96.0.1", "10.244.1.7", "172.20.0.1",
    "192.168.49.2", "127.0.0.1", "0.0.0.0", "224.0.0.251", "fd00:ec2::254", "fd00:10:96::1",
    "fe80::1", "::1", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "2001:0:a9fe:a9fe::1"])
def test_the_network_policy_denies_cluster_and_metadata_addresses(address: str) -> None:
    assert not ip_blocks_allow(egress_policy(), address)


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700::1"])
def test_the_network_policy_lets_public_addresses_through(address: str) -> None:
    assert ip_blocks_allow(egress_policy(), address)
