"""What probes and Prometheus read: GET /healthz, /readyz, /fleetz, /metrics. No key, no
/v1 header checks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import cast

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import Deps, app_deps
from api.fleet import fleet_report
from api.prompts import Readiness
from tidegate.fleet import read_fleet


def install(app: FastAPI) -> None:
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/readyz", readyz, methods=["GET"])
    app.add_api_route("/fleetz", fleetz, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def readyz(deps: Deps = Depends(app_deps)) -> JSONResponse:
    checks = await _readiness(deps)
    ok = all(c["ok"] for c in checks.values())
    return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)


async def fleetz(deps: Deps = Depends(app_deps)) -> JSONResponse:
    # A report, not a probe: 200 whatever the fleet's state (`ready` says it; the
    # alert TidegateLaneWithoutActiveWorker watches it). A 5xx is kept for what the
    # API itself lacks: Redis down is handle_unreachable's 503 with Retry-After.
    fleet = await asyncio.to_thread(read_fleet, deps.sync_redis, deps.settings.namespace)
    return JSONResponse(fleet_report(fleet, deps.settings.lanes))


async def metrics(deps: Deps = Depends(app_deps)) -> Response:
    # Only this process's own counters (api/metrics.py): no I/O, cheap on the loop.
    body = generate_latest(deps.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def _readiness(deps: Deps) -> dict[str, Readiness]:
    """What this API process needs to serve, and nothing more: no worker (GET /fleetz,
    api/fleet.py), so a rolling worker restart takes no API out of its load balancer."""
    checks: dict[str, Readiness] = {}
    try:
        await _ping(deps.redis)
        checks["redis"] = {"ok": True}
    except aioredis.RedisError as exc:
        checks["redis"] = {"ok": False, "error": type(exc).__name__}
    if deps.stream_redis is not deps.redis:  # the token streams live apart (TIDEGATE_STREAMS_URL)
        try:
            await _ping(deps.stream_redis)
            checks["streams"] = {"ok": True}
        except aioredis.RedisError as exc:
            checks["streams"] = {"ok": False, "error": type(exc).__name__}
    try:
        await asyncio.to_thread(deps.store.jobs.count_jobs)
        checks["database"] = {"ok": True}
    except Exception as exc:
        checks["database"] = {"ok": False, "error": type(exc).__name__}
    checks["tokenizer"] = _no_paths(deps.prompts.readiness())
    return checks


async def _ping(client: aioredis.Redis | aioredis.RedisCluster) -> None:
    # redis-py types a command for its blocking and asyncio clients at once (a bool or an
    # awaitable of one): the asyncio client's is the awaitable.
    await cast(Awaitable[bool], client.ping())


def _no_paths(check: Readiness) -> Readiness:
    """A check as anyone may read it (/readyz takes no key): why the tokenizer failed names
    its path on this host, so that goes to the log (api/prompts.py), not here."""
    if check.get("ok") or check.get("error") == "loading":
        return check
    return {"ok": False, "error": "failed to load (the API's log says why)"}
