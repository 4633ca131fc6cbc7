"""The webhooks a producer can see and set: a job's deliveries with every attempt, and
the tenant's signing secret (rotated, shown once). Delivery itself is tasks/webhooks.py."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from api.auth import authenticate
from api.deps import Deps, check_headers, check_job_id
from api.errors import not_found, unavailable
from store.webhooks import DeliveryRecord, Webhooks, shown
from tidegate import sealing
from tidegate.jsontypes import JSONObject
from tidegate.records import DeliveryStatus

log = logging.getLogger("tidegate.api")


def install(app: FastAPI, deps: Deps) -> None:
    hooks = Webhooks(deps.store)
    checked: dict[str, Any] = {"dependencies": [Depends(check_headers)]}  # api/openapi.py

    @app.get("/v1/jobs/{job_id}/deliveries", **checked)
    async def deliveries(job_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        job_id = check_job_id(job_id)
        job = await asyncio.to_thread(deps.store.jobs.get_job, job_id, tenant.id)
        if job is None:
            raise not_found("job")
        rows = await asyncio.to_thread(hooks.of_job, job_id, tenant.id)
        return JSONResponse({"object": "list", "data": [delivery_json(d) for d in rows]})

    @app.post("/v1/webhook-secret", **checked)
    async def rotate(request: Request) -> JSONResponse:
        """A new signing secret, shown this once; the old ones sign beside it for
        `TIDEGATE_WEBHOOK_SECRET_OVERLAP_S`, so receivers can switch without a gap. At
        most `TIDEGATE_WEBHOOK_MAX_SECRETS` stay live: the oldest beyond end now."""
        tenant = await authenticate(deps.store, request)
        if hooks.sealer is None:  # made on first use: an API that never rotates needs no key
            try:
                hooks.sealer = await asyncio.to_thread(sealing.sealer, deps.settings)
            except sealing.KeyMissing as exc:
                log.error("POST /v1/webhook-secret: %s", exc)
                raise unavailable("webhook secrets cannot be stored: this server has no key "
                                  "to seal them (TIDEGATE_WEBHOOK_SECRET_KEY)") from None
        overlap = timedelta(seconds=deps.settings.webhook_secret_overlap_s)
        secret = await asyncio.to_thread(hooks.rotate_secret, tenant.id, overlap,
                                         deps.settings.webhook_max_secrets)
        return JSONResponse({"secret": secret, "previous_valid_for_s": overlap.total_seconds()})


def delivery_json(d: DeliveryRecord) -> JSONObject:
    """A delivery as its tenant sees it: each attempt's status code (from a vetted public
    receiver) and outcome class, never an address or an exception's text."""
    def at(value: datetime | None) -> str | None:
        return value.isoformat() if value is not None else None

    return {"id": d.id, "url": d.url, "status": d.status, "attempts": d.attempts,
            "created_at": at(d.created_at), "delivered_at": at(d.delivered_at),
            "next_attempt_at": (at(d.next_attempt_at) if d.status == DeliveryStatus.PENDING
                                else None),
            "last_error": shown(d.last_error),
            "log": [{"attempt": a.attempt, "at": at(a.at), "status_code": a.status_code,
                     "error": shown(a.error), "duration_ms": round(a.duration_ms, 1)}
                    for a in d.log]}
