"""The store's clock: every time it writes is aware and in UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)


def aware(at: datetime) -> datetime:
    """`at` in UTC; a naive datetime is refused (its zone would be a guess)."""
    if at.tzinfo is None:
        raise ValueError("naive datetime: pass a timezone-aware datetime")
    return at.astimezone(UTC)


def ms_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds() * 1000.0
