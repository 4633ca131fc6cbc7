"""Verifying a tidegate webhook: the Standard Webhooks signature scheme, by hand (the SDK
depends on httpx and pydantic only).

The signed content is `{webhook-id}.{webhook-timestamp}.{body}`; each `v1,` entry of
`webhook-signature` is its HMAC-SHA256, in base64, under a secret (`whsec_` + base64):
during a rotation's overlap the webhook carries one per live secret, and any one that
matches will do.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

TOLERANCE_S = 300  # a timestamp further off than this, either way, is refused (replays)


class WebhookVerificationError(ValueError):
    """The webhook is not one tidegate signed with this secret, or it is too old."""


def verify_webhook(secret: str, body: bytes | str, headers: Mapping[str, str],
                   now: float | None = None) -> dict[str, Any]:
    """The webhook's event ({"type", "timestamp", "data"}) once its signature and
    timestamp check out; WebhookVerificationError otherwise."""
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id, stamp = lowered.get("webhook-id"), lowered.get("webhook-timestamp")
    signatures = lowered.get("webhook-signature", "")
    if not msg_id or not stamp or not signatures:
        raise WebhookVerificationError("missing webhook-id, -timestamp or -signature header")
    try:
        sent = int(stamp)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not a number") from None
    if abs((time.time() if now is None else now) - sent) > TOLERANCE_S:
        raise WebhookVerificationError("webhook-timestamp is too far from now")
    text = body.decode() if isinstance(body, bytes) else body
    expected = _sign(secret, f"{msg_id}.{sent}.{text}")
    for entry in signatures.split(" "):
        version, _, signature = entry.partition(",")
        if version == "v1" and hmac.compare_digest(signature, expected):
            return dict(json.loads(text))
    raise WebhookVerificationError("no signature matches this secret")


def _sign(secret: str, content: str) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    return base64.b64encode(hmac.new(key, content.encode(), hashlib.sha256).digest()).decode()
