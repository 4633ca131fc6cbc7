"""The API's caches of keys: a key found valid skips the store for KEY_CACHE_S; a key
found unknown skips it for UNKNOWN_CACHE_S (a caller repeating a wrong key costs one
lookup), then is looked up again."""

from __future__ import annotations

import secrets
from types import SimpleNamespace
from typing import Any

import pytest

from api import auth
from api.errors import ApiError


class CountingStore:
    def __init__(self, known: dict[str, Any]) -> None:
        self.known, self.lookups = known, 0
        self.tenants = self  # Store.tenants: the one method the API's auth calls is here

    def tenant_by_key(self, key: str) -> Any:
        self.lookups += 1
        return self.known.get(key)


def record(tenant_id: int) -> Any:
    return SimpleNamespace(id=tenant_id, name=f"t{tenant_id}", lanes=["chat"],
                           requests_per_minute=None, tokens_per_minute=None, webhook_url=None,
                           max_priority=None, monthly_token_budget=None, fair_weight=None)


def test_a_valid_key_is_looked_up_once_within_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    key = secrets.token_urlsafe(32)
    store = CountingStore({key: record(7)})
    clock = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    assert auth.tenant_for_key(store, key).id == 7  # type: ignore[arg-type]
    clock[0] += auth.KEY_CACHE_S - 0.1
    assert auth.tenant_for_key(store, key).id == 7  # type: ignore[arg-type]
    assert store.lookups == 1
    clock[0] += 0.2  # past the window: revocation is seen again
    store.known.clear()
    with pytest.raises(ApiError) as err:
        auth.tenant_for_key(store, key)  # type: ignore[arg-type]
    assert err.value.status == 401 and store.lookups == 2


def test_an_unknown_key_is_looked_up_once_within_its_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = CountingStore({})
    key = secrets.token_urlsafe(32)
    clock = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(auth, "_unknown", auth._UnknownKeys())  # on the patched clock
    for _ in range(3):
        with pytest.raises(ApiError):
            auth.tenant_for_key(store, key)  # type: ignore[arg-type]
    assert store.lookups == 1
    clock[0] += auth.UNKNOWN_CACHE_S + 0.1  # past the window: looked up again
    with pytest.raises(ApiError):
        auth.tenant_for_key(store, key)  # type: ignore[arg-type]
    assert store.lookups == 2
