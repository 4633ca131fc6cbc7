"""The front door's first check, in plain ASGI before FastAPI runs: a /v1 request that
needs no lookup to refuse (no key, a key refused lately, a stranger past its 401s; the
rules are KeyGate's, api/auth.py) is answered here, and never reaches routing,
dependencies or the body.

Why here and not in the route: a flood of strangers costs the API process what each of
their requests costs before it is refused, on the one event loop tenants share. Through
FastAPI (routing, header checks, the exception handler) a refusal cost several times
what it costs here, where it is a dict lookup, a counter and a response of two messages.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import KeyGate
from api.errors import ApiError

GATED_PREFIX = "/v1/"  # every route under it authenticates a tenant's key first

# (the request's path, the refusal) -> its response, as the app's error handler renders it
Render = Callable[[str, ApiError], Response]


class FrontGate:
    def __init__(self, app: ASGIApp, gate: Callable[[], KeyGate], render: Render) -> None:
        self.app, self.gate, self.render = app, gate, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PREFIX):
            await self.app(scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else "-"
        refused = self.gate().refusal(client, _authorization(scope))
        if refused is None:
            await self.app(scope, receive, send)
            return
        await self.render(scope["path"], refused)(scope, receive, send)


def _authorization(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return ""
