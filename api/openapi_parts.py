"""What the parts of the OpenAPI document share (api/openapi.py assembles it; the jobs API
there, api/openapi_openai.py for the OpenAI-compatible routes, api/openapi_admin.py for the
admin API): JSON Schema from the handlers' own models, references, responses and links.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

Json = dict[str, Any]

REF = "#/components/schemas/{model}"
NO_NUL = "^[^\\u0000]*$"  # api/schemas.py `check_text`: NUL in text is a 400
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                               "required": True,
                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
# The security schemes of components.securitySchemes: a tenant's API key, an admin key.
BEARER: list[Json] = [{"bearer": []}]
ADMIN: list[Json] = [{"admin": []}]
SECURITY_SCHEMES: Json = {
    "bearer": {"type": "http", "scheme": "bearer",
               "description": "A tenant's API key (`tidegate tenant add`)."},
    "admin": {"type": "http", "scheme": "bearer",
              "description": "An admin key (`tidegate admin-key create`); a tenant's key "
                             "is refused."},
}


def ref(name: str) -> Json:
    return {"$ref": REF.format(model=name)}


def schema_of(kind: type, defs: Json) -> Json:
    """The JSON schema of a pydantic model or dataclass, its nested types moved into
    `defs` (the document's components)."""
    schema = TypeAdapter(kind).json_schema(ref_template=REF)
    defs.update(schema.pop("$defs", {}))
    return schema


def refuse_nul(node: object) -> None:
    """Every free-text string schema under `node` gets the NO_NUL pattern."""
    if isinstance(node, list):
        for item in node:
            refuse_nul(item)
    elif isinstance(node, dict):
        if node.get("type") == "string" and not {"enum", "const", "format"} & node.keys():
            node.setdefault("pattern", NO_NUL)
        for value in node.values():
            refuse_nul(value)


def value_branch(field: Json) -> Json:
    """The schema of a field's value: the non-null branch of an optional field's anyOf."""
    for branch in field.get("anyOf", ()):
        if branch.get("type") != "null":
            return branch  # type: ignore[no-any-return]
    return field


def json_response(description: str, schema: str, links: Json | None = None) -> Json:
    response: Json = {"description": description,
                      "content": {"application/json": {"schema": ref(schema)}}}
    if links:
        response["links"] = links
    return response


def error_response(description: str, status: int, schema: str) -> Json:
    """An error status in the body `schema` names; 429 and 503 with Retry-After."""
    response = json_response(description, schema)
    if status in (429, 503):
        response["headers"] = RETRY_AFTER
    return response


def link(operation_id: str, body: Json | None = None, **parameters: str) -> Json:
    """A link to `operation_id`, its parameters (and body fields) filled from the response
    by runtime expressions (`$response.body#/id`)."""
    found: Json = {"operationId": operation_id, "parameters": parameters}
    if body is not None:
        found["requestBody"] = body
    return found
