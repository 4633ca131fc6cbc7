"""Errors the API returns: every one a JSON body that names the field at fault.

Three kinds, as in the style notes: what the caller got wrong (4xx, never retried),
what the system lacks right now (503 with a retry hint), and bugs (500, logged).
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


def unavailable(message: str, retry_after_s: int = 5) -> ApiError:
    return ApiError(503, None, message, kind="unavailable",
                    headers={"Retry-After": str(retry_after_s)})
