"""The webhook URL policy and retry schedule, as plain code (tasks/webhooks.py)."""

from __future__ import annotations

import pytest
from standardwebhooks.webhooks import Webhook

from tasks.webhooks import UrlRefused, backoff_s, check_url, signed_headers
from tidegate.settings import Settings

STRICT = Settings(webhook_allow_private=False, webhook_deny_hosts="evil.example",
                  webhook_allow_hosts="hooks.internal")


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8080/hook", "http://localhost/hook", "https://10.1.2.3/x",
    "http://192.168.0.9/", "http://[::1]/", "http://169.254.169.254/latest/meta-data",
    "http://0.0.0.0/", "ftp://example.com/", "example.com/hook", "https://evil.example/x",
    "http:///nohost", "https://" + "a" * 2050 + ".com/",
])
def test_refused_urls(url: str) -> None:
    with pytest.raises(UrlRefused):
        check_url(url, STRICT)


@pytest.mark.parametrize("url", ["https://crm.example.com/hooks/tidegate",
                                 "http://93.184.215.14:8080/x", "https://hooks.internal/x"])
def test_allowed_urls(url: str) -> None:
    assert check_url(url, STRICT)


def test_private_addresses_pass_only_when_allowed() -> None:
    allowed = check_url("http://127.0.0.1:9/", Settings(webhook_allow_private=True))
    assert allowed.host == "127.0.0.1"


def test_a_name_resolving_to_a_private_address_is_refused_at_delivery() -> None:
    # A loopback name is refused without DNS; other names when a delivery resolves them
    # (tests/unit/test_webhook_urls.py, `vet`).
    with pytest.raises(UrlRefused, match="loopback"):
        check_url("http://localhost.localdomain.localhost/", STRICT)


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    for attempt, middle in ((1, 5.0), (2, 10.0), (3, 20.0), (20, 3600.0)):
        for _ in range(50):
            assert 0.5 * middle <= backoff_s(attempt, 5.0) < 1.5 * middle


def test_every_live_secret_signs_and_each_verifies() -> None:
    old, new = "whsec_" + "A" * 43 + "=", "whsec_" + "B" * 43 + "="
    body = '{"type":"job.ended"}'
    headers = signed_headers("msg_1", body, [new, old])
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old, new):
        assert Webhook(secret).verify(body, headers) == {"type": "job.ended"}
