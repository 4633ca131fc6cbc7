"""The usage ledger over HTTP: tokens and ended jobs per tenant, lane and day (UTC).

    GET /v1/usage          the caller's own tenant
    GET /admin/v1/usage    every tenant (or `tenant=NAME`), behind an admin key

Query: `start_date` and `end_date` (ISO dates, inclusive; default the month so far),
`lane`, `format=csv` (text/csv; JSON otherwise). The rows are the ledger's, written in
each job's end transaction (store/usage.py), so they add up to the job rows exactly.
"""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from api.admin import require_admin
from api.auth import authenticate
from api.deps import Deps, check_headers
from api.errors import malformed, not_found
from store.tenants import Tenants
from store.usage import COUNTED, Usage, UsageRecord
from tidegate.jsontypes import JSONObject

PARAMS = ("start_date", "end_date", "lane", "format")
ADMIN_PARAMS = (*PARAMS, "tenant")
MAX_DAYS = 366  # one request reads at most a year of days
COLUMNS = ("date", "tenant", "lane", "prompt_tokens", "cached_tokens", "completion_tokens",
           "total_tokens", *COUNTED[3:])


@dataclass(frozen=True)
class UsageQuery:
    start: date
    end: date
    lane: str | None
    csv: bool
    tenant: str | None = None  # admin only: one tenant's, by name


def install(app: FastAPI, deps: Deps) -> None:
    usage, tenants = Usage(deps.store), Tenants(deps.store)
    hidden: dict[str, Any] = {"dependencies": [Depends(check_headers)],
                              "include_in_schema": False}

    @app.get("/v1/usage", **hidden)
    async def own_usage(request: Request) -> Response:
        tenant = await authenticate(deps.store, request)
        query = parse(request.query_params, deps.settings.lanes, PARAMS)
        rows = await asyncio.to_thread(usage.days, query.start, query.end, tenant.id,
                                       query.lane)
        return answer(query, rows)

    @app.get("/admin/v1/usage", **hidden)
    async def all_usage(request: Request) -> Response:
        await require_admin(tenants, request)
        query = parse(request.query_params, deps.settings.lanes, ADMIN_PARAMS)
        tenant_id = None
        if query.tenant is not None:
            record = await asyncio.to_thread(tenants.get, query.tenant)
            if record is None:
                raise not_found("tenant")
            tenant_id = record.id
        rows = await asyncio.to_thread(usage.days, query.start, query.end, tenant_id,
                                       query.lane)
        return answer(query, rows)


def parse(params: Mapping[str, str], lanes: Mapping[str, object],
          known: tuple[str, ...]) -> UsageQuery:
    """The query; a 400 naming the parameter at fault."""
    for name, value in params.items():
        if name not in known:
            raise malformed(name, f"{name}: unknown parameter; known: {', '.join(known)}")
        if "\x00" in value:
            raise malformed(name, f"{name}: NUL is not allowed")
    today = datetime.now(UTC).date()
    start = _date("start_date", params.get("start_date"), today.replace(day=1))
    end = _date("end_date", params.get("end_date"), today)
    if end < start:
        raise malformed("end_date", f"end_date: {end} is before start_date {start}")
    if end - start >= timedelta(days=MAX_DAYS):
        raise malformed("end_date", f"end_date: at most {MAX_DAYS} days from start_date")
    lane = params.get("lane")
    if lane is not None and lane not in lanes:
        raise malformed("lane", f"lane: unknown lane; lanes are {', '.join(sorted(lanes))}")
    fmt = params.get("format", "json")
    if fmt not in ("json", "csv"):
        raise malformed("format", "format: json or csv")
    return UsageQuery(start=start, end=end, lane=lane, csv=fmt == "csv",
                      tenant=params.get("tenant"))


def _date(field: str, raw: str | None, default: date) -> date:
    if raw is None:
        return default
    try:
        if len(raw) != 10:  # YYYY-MM-DD only: fromisoformat takes week dates too
            raise ValueError(raw)
        return date.fromisoformat(raw)
    except ValueError:
        raise malformed(field, f"{field}: not an ISO date (YYYY-MM-DD)") from None


def row(record: UsageRecord) -> JSONObject:
    values = {name: getattr(record, name) for name in COUNTED}
    return {"date": record.day.isoformat(), "tenant": record.tenant, "lane": record.lane,
            **values, "total_tokens": record.total_tokens}


def answer(query: UsageQuery, records: list[UsageRecord]) -> Response:
    rows = [row(r) for r in records]
    if query.csv:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        name = f"usage-{query.start}-{query.end}.csv"
        return Response(out.getvalue(), media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})
    totals = {name: sum(getattr(r, name) for r in records) for name in (*COUNTED, "total_tokens")}
    return JSONResponse({"object": "list", "start_date": query.start.isoformat(),
                         "end_date": query.end.isoformat(), "data": rows, "total": totals})
