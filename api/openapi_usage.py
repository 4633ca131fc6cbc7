"""The OpenAPI contract of the usage ledger's routes (api/usage.py): GET /v1/usage (a
tenant's key, its own usage) and GET /admin/v1/usage (an admin key, every tenant's).

Both answer JSON, or CSV with `format=csv`; a query value the route refuses is a 400
naming it (`error.field`).
"""

from __future__ import annotations

from api.openapi_parts import ADMIN, BEARER, Json, error_response, ref
from store.usage import COUNTED

_COUNTS = {name: {"type": "integer", "minimum": 0} for name in (*COUNTED, "total_tokens")}
ROW: Json = {"type": "object",
             "required": ["date", "tenant", "lane", *_COUNTS],
             "properties": {"date": {"type": "string", "format": "date"},
                            "tenant": {"type": "string"}, "lane": {"type": "string"},
                            **_COUNTS}}
LIST: Json = {"type": "object", "required": ["object", "start_date", "end_date", "data", "total"],
              "properties": {"object": {"const": "list"},
                             "start_date": {"type": "string", "format": "date"},
                             "end_date": {"type": "string", "format": "date"},
                             "data": {"type": "array", "items": ref("UsageDay")},
                             "total": {"type": "object", "required": list(_COUNTS),
                                       "properties": _COUNTS}}}
_DATE = {"type": "string", "format": "date",
         "description": "An ISO date (YYYY-MM-DD), UTC; inclusive."}
PARAMETERS: Json = {
    "start_date": {**_DATE, "description": _DATE["description"] + " Default: the month's "
                   "first day."},
    "end_date": {**_DATE, "description": _DATE["description"] + " Default: today; at most "
                 "366 days after start_date."},
    "format": {"enum": ["json", "csv"], "default": "json"},
    "allUsage.tenant": {"type": "string", "minLength": 1, "maxLength": 128,
                        "pattern": "^[^\\u0000]*$"},
}
ERRORS = {
    400: "A query value refused (a date that is not YYYY-MM-DD, end_date before "
         "start_date or over 366 days after it, an unknown lane or parameter); "
         "`error.field` names it.",
    401: "No key, or not one this route takes (a tenant's key for /v1/usage, an admin key "
         "for /admin/v1/usage).",
    404: "No tenant of that name.",
    429: "The caller's address earned too many 401s lately; retry after `Retry-After` "
         "seconds.",
    503: "The database is unavailable; retry after `Retry-After` seconds.",
}


def schemas() -> Json:
    return {"UsageDay": ROW, "UsageList": LIST}


def _operation(operation_id: str, summary: str, security: list[Json], params: tuple[str, ...],
               errors: tuple[int, ...]) -> Json:
    ok = {"description": "The ledger's rows by day, tenant and lane.",
          "content": {"application/json": {"schema": ref("UsageList")},
                      "text/csv": {"schema": {"type": "string"}}}}
    return {"operationId": operation_id, "summary": summary, "security": security,
            "parameters": [{"name": name, "in": "query", "required": False} for name in params],
            "responses": {"200": ok} | {str(s): error_response(ERRORS[s], s, "Error")
                                         for s in errors}}


def operations() -> dict[tuple[str, str], Json]:
    params = ("start_date", "end_date", "lane", "format")
    return {
        ("/v1/usage", "get"): _operation(
            "ownUsage", "The key's tenant's tokens and ended jobs per lane and day (UTC).",
            BEARER, params, (400, 401, 429, 503)),
        ("/admin/v1/usage", "get"): _operation(
            "allUsage", "Every tenant's tokens and ended jobs per lane and day (UTC), or one "
            "tenant's (`tenant`).", ADMIN, (*params, "tenant"), (400, 401, 404, 429, 503)),
    }
