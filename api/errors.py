"""Errors the API returns: every one a JSON body that names the field at fault.

Three kinds, as in the style notes: what the caller got wrong (4xx, never retried),
what the system lacks right now (503 with a retry hint), and bugs (500, logged).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse


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


async def handle_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    body = {"error": {"type": exc.kind, "field": exc.field, "message": exc.message}}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)
