"""Per-tenant rate limits: requests and tokens per minute, fixed one-minute windows in
Redis, so every API replica counts against the same budget."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from api.errors import ApiError
from tidegate import keys

if TYPE_CHECKING:  # api.auth reads the HTTP request: api/submit.py charges without FastAPI
    from api.auth import Tenant


def charge(client: Any, namespace: str, tenant: Tenant, tokens: int) -> None:
    """Counts one request of `tokens` (prompt plus max_tokens) or raises 429."""
    now = time.time()
    minute, retry_after = int(now // 60), 60 - int(now % 60)
    if tenant.requests_per_minute is not None:
        key = keys.rate_window(namespace, tenant.id, minute, "requests")
        if _add(client, key, 1) > tenant.requests_per_minute:
            raise _limited(f"at most {tenant.requests_per_minute} requests per minute",
                           retry_after)
    if tenant.tokens_per_minute is not None:
        key = keys.rate_window(namespace, tenant.id, minute, "tokens")
        if _add(client, key, tokens) > tenant.tokens_per_minute:
            client.decrby(key, tokens)  # a refused request spends no token budget
            raise _limited(f"at most {tenant.tokens_per_minute} tokens per minute "
                           f"(prompt plus max_tokens)", retry_after)


def _add(client: Any, key: str, amount: int) -> int:
    pipe = client.pipeline(transaction=True)
    pipe.incrby(key, amount)
    pipe.expire(key, keys.RATE_WINDOW_TTL_S)
    return int(pipe.execute()[0])


def _limited(what: str, retry_after: int) -> ApiError:
    return ApiError(429, None, f"rate limit: this API key may send {what}; retry in "
                    f"{retry_after} s", kind="rate_limited",
                    headers={"Retry-After": str(retry_after)})
