"""The front door's first check, in plain ASGI before FastAPI runs: a /v1 request that
needs no lookup to refuse (no key, a key refused lately, a stranger past its 401s; the
rules are KeyGate's, api/auth.py) is answered here, and never reaches routing,
dependencies or the body.

Why here and not in the route: a flood of strangers costs the API process what each of
their requests costs before it is refused, on the one event loop tenants share. Through
FastAPI (routing, header checks, the exception handler) a refusal cost several times
what it costs here, where it is a dict lookup, a counter and a response of two messages.

An address past its 401s gets its 429 after a hold (TIDEGATE_AUTH_FAILURE_HOLD_S): an HTTP/1.1
client sends a connection's next request only once the last is answered, so a flood on N
keep-alive connections is cut to N requests a hold, where unheld it was as many as the loop
could answer, and each was one more turn the tenants' requests waited behind. A hold is a
sleeping coroutine; past TIDEGATE_AUTH_FAILURE_HOLDS at once the 429 goes at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import KeyGate
from api.errors import ApiError

GATED_PREFIX = "/v1/"  # every route under it authenticates a tenant's key first

# (the request's path, the refusal) -> its response, as the app's error handler renders it
Render = Callable[[str, ApiError], Response]


class FrontGate:
    def __init__(self, app: ASGIApp, gate: Callable[[], KeyGate], render: Render,
                 hold_s: float = 0.0, max_held: int = 0) -> None:
        self.app, self.gate, self.render = app, gate, render
        self.hold_s, self.max_held = hold_s, max_held
        self.held = 0  # 429s waiting out their hold now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PREFIX):
            await self.app(scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else "-"
        refused = self.gate().refusal(client, _authorization(scope))
        if refused is None:
            await self.app(scope, receive, send)
            return
        if refused.kind == "auth_failures":
            await self._hold(refused)
        await self.render(scope["path"], refused)(scope, receive, send)

    async def _hold(self, refused: ApiError) -> None:
        # Spread over half to one and a half holds: a burst held alike comes back as one
        # burst, and the tenants' requests would wait behind each.
        hold = min(self.hold_s * random.uniform(0.5, 1.5),  # noqa: S311 - not a secret
                   float(refused.headers.get("Retry-After", self.hold_s)))
        if hold <= 0 or self.held >= self.max_held:
            return
        self.held += 1
        try:
            await asyncio.sleep(hold)
        finally:
            self.held -= 1


def _authorization(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return ""
