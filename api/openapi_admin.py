"""The OpenAPI contract of the admin API, /admin/v1 (api/admin.py): tenants, their settings
and their keys, behind an admin key (`admin` security scheme; a tenant's key is a 401).

The handlers read raw JSON and validate it with their own pydantic models; the bodies here
are those models' schemas, with the lanes the lanes file names and no NUL in text. Errors
are the API's own shape, `{"error": {"type", "field", "message"}}`.

Links follow what a response names: a created tenant's name to reading, changing and
revoking it and to adding a key; a created key's id to rotating and revoking it.
"""

from __future__ import annotations

from api.admin import NewKey, NewTenant, Rotation, TenantSettings
from api.openapi_parts import (
    ADMIN,
    Json,
    error_response,
    json_response,
    link,
    ref,
    refuse_nul,
    schema_of,
    value_branch,
)
from tidegate.settings import Settings

BASE = "/admin/v1/tenants"
ERRORS = {
    400: "Not JSON, NUL or a lone surrogate in text, a webhook URL that is not one; "
         "`error.field` names it.",
    401: "No admin key (`tidegate admin-key create`); a tenant's key is refused.",
    404: "No such tenant, or no such key of the tenant.",
    409: "A tenant of that name exists.",
    422: "A field unknown or out of bounds, an unknown lane, a webhook URL refused; "
         "`error.field` names it.",
    413: "The body is larger than the API's limit.",
    503: "The database or Redis is unavailable; retry after `Retry-After` seconds.",
}
PARAMETERS: Json = {
    "name": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[^\\u0000/]*$"},
    "key_id": {"type": "string", "pattern": "^[0-9]{1,11}$"},
}
_AT = {"type": ["string", "null"], "format": "date-time"}
KEY: Json = {"type": "object", "required": ["id", "name", "active"],
             "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                            "active": {"type": "boolean"}, "created_at": _AT,
                            "last_used_at": _AT, "expires_at": _AT, "revoked_at": _AT}}
TENANT: Json = {"type": "object", "required": ["id", "name", "lanes", "active"],
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                               "lanes": {"type": "array", "items": {"type": "string"}},
                               "active": {"type": "boolean"}, "created_at": _AT,
                               "revoked_at": _AT}}
SECRET = {"secret": {"type": "string", "description": "The key, shown this once."}}


def schemas(settings: Settings) -> Json:
    defs: Json = {}
    found: Json = {
        "NewTenant": _with_lanes(schema_of(NewTenant, defs), settings),
        "TenantSettings": _with_lanes(schema_of(TenantSettings, defs), settings),
        "NewKey": schema_of(NewKey, defs),
        "Rotation": schema_of(Rotation, defs),
        "Tenant": TENANT,
        "TenantWithKeys": _extended(TENANT, keys={"type": "array", "items": KEY}),
        "TenantCreated": _extended(TENANT, key=_extended(KEY, **SECRET)),
        "TenantList": {"type": "object", "required": ["object", "data"],
                       "properties": {"object": {"const": "list"},
                                      "data": {"type": "array", "items": TENANT}}},
        "Key": KEY,
        "KeyCreated": _extended(KEY, **SECRET),
    }
    refuse_nul(found)
    refuse_nul(defs)
    return defs | found


def _with_lanes(schema: Json, settings: Settings) -> Json:
    value_branch(schema["properties"]["lanes"])["items"] = {"enum": sorted(settings.lanes)}
    return schema


def _extended(base: Json, **properties: Json) -> Json:
    return {**base, "required": [*base["required"], *properties],
            "properties": {**base["properties"], **properties}}


def operations() -> dict[tuple[str, str], Json]:
    tenant = "$response.body#/name"
    tenant_links = {"GetTenant": link("getTenant", name=tenant),
                    "UpdateTenant": link("updateTenant", name=tenant),
                    "RevokeTenant": link("revokeTenant", name=tenant),
                    "AddKey": link("addKey", name=tenant)}
    key_links = {"RotateKey": link("rotateKey", name="$request.path.name",
                                   key_id="$response.body#/id"),
                 "RevokeKey": link("revokeKey", name="$request.path.name",
                                   key_id="$response.body#/id")}
    return {
        (BASE, "get"): _operation("listTenants", "Every tenant.",
                                  {"200": json_response("The tenants.", "TenantList")},
                                  errors=(400, 401, 503)),
        (BASE, "post"): _operation(
            "createTenant", "A tenant, and its first key (shown once).",
            {"201": json_response("The tenant and its key.", "TenantCreated", tenant_links)},
            body="NewTenant", errors=(400, 401, 409, 413, 422, 503)),
        (BASE + "/{name}", "get"): _operation(
            "getTenant", "A tenant, with its keys (never the keys themselves).",
            {"200": json_response("The tenant.", "TenantWithKeys")}),
        (BASE + "/{name}", "patch"): _operation(
            "updateTenant", "Change a tenant's lanes, limits or default webhook.",
            {"200": json_response("The tenant.", "Tenant")}, body="TenantSettings"),
        (BASE + "/{name}", "delete"): _operation(
            "revokeTenant", "Revoke a tenant: every key of it, at once in every API process.",
            {"200": json_response("The tenant, not active.", "Tenant")}),
        (BASE + "/{name}/keys", "post"): _operation(
            "addKey", "A new named key (shown once).",
            {"201": json_response("The key.", "KeyCreated", key_links)}, body="NewKey"),
        (BASE + "/{name}/keys/{key_id}/rotate", "post"): _operation(
            "rotateKey", "A new key in place of this one, which lives on `overlap_s`.",
            {"201": json_response("The new key.", "KeyCreated")}, body="Rotation"),
        (BASE + "/{name}/keys/{key_id}", "delete"): _operation(
            "revokeKey", "Revoke one key.", {"200": json_response("The key.", "Key")}),
    }


def _operation(operation_id: str, summary: str, ok: Json, body: str | None = None,
               errors: tuple[int, ...] = (400, 401, 404, 413, 422, 503), **extra: object) -> Json:
    statuses = errors if body is not None else tuple(s for s in errors if s not in (413, 422))
    responses = ok | {str(status): error_response(ERRORS[status], status, "Error")
                      for status in statuses}
    found: Json = {"operationId": operation_id, "summary": summary, "security": ADMIN,
                   "responses": responses, **extra}
    if body is not None:
        found["requestBody"] = {"required": True,
                                "content": {"application/json": {"schema": ref(body)}}}
    return found
