"""Errors the API returns: every one a JSON body that names the field at fault.

Three kinds, as in the style notes: what the caller got wrong (4xx, never retried),
what the system lacks right now (429 or 503 with a retry hint; `type` names the bound:
`queue_full`, `too_many_in_flight`, `too_many_streams`, `overloaded`, `rate_limited`,
`unavailable`), and bugs (500, logged).
No HTTP framework here, so the submit logic (api/submit.py) raises them without one:
api/app.py turns them into JSON responses.
"""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, field: str | None, message: str, kind: str = "invalid_request",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.field, self.message, self.kind = status, field, message, kind
        self.headers = headers or {}


def bad_request(field: str, message: str) -> ApiError:
    return ApiError(422, field, message)


def not_found(what: str) -> ApiError:
    return ApiError(404, None, f"{what} not found", kind="not_found")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "authorization", message, kind="unauthorized",
                    headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str, retry_after_s: int = 5, kind: str = "unavailable") -> ApiError:
    return ApiError(503, None, message, kind=kind, headers={"Retry-After": str(retry_after_s)})


def malformed(field: str, message: str) -> ApiError:
    """Bytes the API will not carry (a header of the wrong shape, NUL or a lone surrogate
    in text): 400, where a value of the right shape that breaks a rule is a 422."""
    return ApiError(400, field, message)


def over_limit(kind: str, message: str, retry_after_s: int) -> ApiError:
    """A load bound reached (`kind` names which): 429, retry after a while."""
    return ApiError(429, None, message, kind=kind, headers={"Retry-After": str(retry_after_s)})
