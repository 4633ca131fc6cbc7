"""GET /v1/jobs: a tenant's jobs, filtered, page after page, so that a producer back from
its own outage can find every job it submitted and how each ended.

The query is read here, not by FastAPI, so that a bad value is a 422 (400 for bytes the
API does not carry) in the API's own error shape naming the parameter, like every other
error (api/errors.py). Pages are in acceptance order; `next_cursor` is the position after
the page's last job, opaque to the client (base64 of its acceptance time and id): a page
costs the same however deep it is, and jobs accepted meanwhile are neither skipped nor
repeated.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from api.errors import bad_request, malformed
from tidegate.records import JobStatus

DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
PARAMS = ("status", "lane", "session_id", "created_after", "after", "limit")
SESSION_ID = re.compile(r"[\x21-\x7e]{1,255}")  # what the store's column and a header hold
MAX_CURSOR = 200
JOB_ID = re.compile(r"[0-9A-Za-z_.:-]{1,64}")  # api/deps.py's: what a job id can be


@dataclass(frozen=True)
class JobQuery:
    statuses: tuple[str, ...] = ()
    lane: str | None = None
    session_id: str | None = None
    created_after: datetime | None = None
    after: tuple[datetime, str] | None = None
    limit: int = DEFAULT_LIMIT


def parse(params: Mapping[str, str], lanes: Mapping[str, object]) -> JobQuery:
    """The query of GET /v1/jobs; an ApiError naming the parameter at fault."""
    for name, value in params.items():
        if name not in PARAMS:
            raise bad_request(name, f"{name}: unknown parameter; known: {', '.join(PARAMS)}")
        if "\x00" in value:
            raise malformed(name, f"{name}: NUL is not allowed")
    return JobQuery(statuses=_statuses(params.get("status")),
                    lane=_lane(params.get("lane"), lanes),
                    session_id=_session(params.get("session_id")),
                    created_after=_time("created_after", params.get("created_after")),
                    after=decode_cursor(params["after"]) if "after" in params else None,
                    limit=_limit(params.get("limit")))


def _statuses(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return ()
    names = tuple(part.strip() for part in raw.split(","))
    known = {s.value for s in JobStatus}
    if unknown := [n for n in names if n not in known]:
        raise bad_request("status", f"status: unknown {', '.join(map(repr, unknown))}; "
                          f"one or more of {', '.join(sorted(known))}, comma-separated")
    return names


def _lane(raw: str | None, lanes: Mapping[str, object]) -> str | None:
    if raw is not None and raw not in lanes:
        raise bad_request("lane", f"lane: unknown lane {raw!r}; lanes are "
                          f"{', '.join(sorted(lanes))}")
    return raw


def _session(raw: str | None) -> str | None:
    if raw is not None and not SESSION_ID.fullmatch(raw):
        raise bad_request("session_id", "session_id: 1 to 255 visible ASCII characters")
    return raw


def _time(name: str, raw: str | None) -> datetime | None:
    """ISO 8601 with a timezone (`2026-12-04T10:00:00Z`), or Unix seconds."""
    if raw is None:
        return None
    problem = bad_request(name, f"{name}: an ISO 8601 time with a timezone "
                          "(2026-12-04T10:00:00Z) or Unix seconds")
    try:
        if re.fullmatch(r"[0-9]{1,12}(\.[0-9]{1,9})?", raw):
            return datetime.fromtimestamp(float(raw), UTC)
        at = datetime.fromisoformat(raw)
        if at.tzinfo is None:
            raise problem
        return at.astimezone(UTC)  # year 1 at +01:00 overflows here
    except (ValueError, OverflowError, OSError):
        raise problem from None


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= MAX_LIMIT):
        raise bad_request("limit", f"limit: a whole number from 1 to {MAX_LIMIT}")
    return int(raw)


def encode_cursor(enqueued_at: datetime, job_id: str) -> str:
    raw = f"{enqueued_at.astimezone(UTC).isoformat()}|{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The position a `next_cursor` names; a 422 for anything this API did not write."""
    problem = bad_request("after", "after: not a cursor this API wrote (use a page's "
                          "`next_cursor` as it is)")
    if not (0 < len(cursor) <= MAX_CURSOR and cursor.isascii()):
        raise problem
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, job_id = raw.partition("|")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not JOB_ID.fullmatch(job_id):
            raise problem
        return when.astimezone(UTC), job_id
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError):
        raise problem from None
