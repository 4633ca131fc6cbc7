"""The OpenAPI contract of the OpenAI-compatible routes (api/openai_routes.py, api/files.py,
api/batches.py): chat and text completions, models, files and batches.

Their handlers read raw JSON (or a multipart upload) and parse it themselves, so FastAPI
sees no body. The bodies are written here from the models the handlers parse with
(api/openai_api.py `ChatRequest`, `CompletionRequest`), with what the code checks beyond
the model written as schema: `model` one of GET /v1/models' ids, `lane` and
`service_tier` the lanes file's, `max_tokens` and `deadline_s` at most what a lane allows,
OpenAI's fields tidegate does not implement accepted only at their neutral values (any
other is a 400 naming it), and no NUL in text. Every error is OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`.

Links let a client follow what a response names: an uploaded file's id to reading,
deleting and batching it; a batch's id to reading and cancelling it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.files import MAX_LIST_FILES, PURPOSES
from api.openai_api import model_ids
from api.openai_models import CHAT_REFUSED, COMPLETION_REFUSED, ChatRequest, CompletionRequest
from api.openapi_parts import (
    BEARER,
    Json,
    error_response,
    json_response,
    link,
    ref,
    refuse_nul,
    schema_of,
    value_branch,
)
from tidegate.lanes import Lane
from tidegate.settings import Settings

ERRORS = {
    400: "A request OpenAI calls bad: not JSON, a field unknown or out of bounds, a field "
         "tidegate does not implement at a value other than its neutral one; `param` "
         "names it.",
    401: "No `Authorization: Bearer <API key>` header, or an unknown or revoked key.",
    403: "The API key may not use the lane its request names (`param`: lane, "
         "service_tier or model).",
    404: "No such model, file or batch for this API key.",
    409: "The file is the input of a batch that has not ended.",
    413: "The body (or the uploaded file) is larger than the API's limit.",
    429: "A bound or a quota is reached, or the caller's address earned too many 401s "
         "lately: retry after `Retry-After` seconds, or (with `x-should-retry: false`) "
         "free some quota first.",
    503: "Redis, the database or every worker of the lane is unavailable, or the API is "
         "overloaded; retry after `Retry-After` seconds.",
}
ERROR_SCHEMA: Json = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "description": "invalid_request_error, "
                     "authentication_error, permission_error, rate_limit_error, ..."},
            "param": {"type": ["string", "null"],
                      "description": "The request field at fault; null when none is."},
            "code": {"type": ["string", "null"]},
        },
    }},
}
# Path and query values as the handlers check them: anything else names no file or batch.
PARAMETERS: Json = {
    "file_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "batch_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "listBatches.after": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$",
                          "description": "The last batch id of the page before."},
    "listBatches.limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
    "listFiles.after": {"type": "string", "description": "The last file id of the page before."},
    "listFiles.limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_FILES,
                        "default": MAX_LIST_FILES},
    "listFiles.order": {"enum": ["asc", "desc"], "default": "desc",
                        "description": "By creation time."},
    "listFiles.purpose": {"enum": list(PURPOSES)},
    "model": {"type": "string", "description": "A model id of GET /v1/models."},
}
EXPIRES_AFTER: Json = {
    "type": "object", "required": ["anchor", "seconds"], "additionalProperties": False,
    "description": "OpenAI's expiration policy: `seconds` after the object's creation.",
    "properties": {"anchor": {"const": "created_at"},
                   "seconds": {"type": "integer", "minimum": 3600, "maximum": 30 * 86400}}}
# A batch input file's line, and a file of one (the upload's example).
EXAMPLE_LINE = ('{"custom_id": "order-1", "method": "POST", "url": "/v1/chat/completions", '
                '"body": {"model": "chat", "max_tokens": 4, '
                '"messages": [{"role": "user", "content": "Where is my parcel?"}]}}\n')
# The request bodies' examples: a client's first request, answered (and the fuzzing run's
# sure 2xx among the schema's many optional fields, tests/stack/test_fuzz.py).
EXAMPLE_CHAT = {"model": "chat", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Where is my parcel?"}]}
EXAMPLE_COMPLETION = {"model": "chat", "max_tokens": 4, "prompt": "Where is my parcel?"}
ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]
_AT = {"type": ["integer", "null"]}
OPENAI_SSE: Json = {
    "description": "`stream: true`: OpenAI's chunks as server-sent events (`data:` lines, "
                   "a chunk's JSON or an `error`), then `data: [DONE]`.",
    "type": "object", "required": ["data"],
    "properties": {"event": {"const": "message"}, "data": {"type": "string"}},
}


# -- components ----------------------------------------------------------------------


def schemas(settings: Settings, lanes: Mapping[str, Lane]) -> Json:
    defs: Json = {}  # ChatMessage, TextPart, StreamOptions
    found: Json = {
        "OpenAIError": ERROR_SCHEMA,
        "ChatCompletionRequest": _request(ChatRequest, CHAT_REFUSED, settings, lanes, defs),
        "CompletionRequest": _request(CompletionRequest, COMPLETION_REFUSED, settings, lanes,
                                      defs),
        "ChatCompletion": _completion("chat.completion", "message"),
        "TextCompletion": _completion("text_completion", "text"),
        "Model": _model(),
        "ModelList": _list(ref("Model")),
        "FileUpload": _file_upload(),
        "File": _file(),
        "FileDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                        "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                                       "deleted": {"const": True}}},
        "BatchRequest": _batch_request(),
        "Batch": _batch(),
        "BatchList": _list(ref("Batch")) | {"required": ["object", "data", "has_more"]},
        "FileList": _list(ref("File")) | {"required": ["object", "data", "has_more"]},
    }
    _text_required(defs, found["CompletionRequest"])
    refuse_nul(defs)
    return defs | found


def _text_required(defs: Json, completion: Json) -> None:
    """What api/openai_api.py checks beyond the model's types: a message holds some text
    (not "", [] or empty parts), and a completion one prompt that is not empty."""
    content = defs["ChatMessage"]["properties"]["content"]["anyOf"]
    for branch in content:
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
    defs["TextPart"]["properties"]["text"]["minLength"] = 1
    for branch in completion["properties"]["prompt"]["anyOf"]:
        if branch.get("type") == "string":
            branch["minLength"] = 1
        else:
            branch.update(minItems=1, maxItems=1)
            branch["items"]["minLength"] = 1


def _request(model: type, refused: Mapping[str, tuple[Any, ...]], settings: Settings,
             lanes: Mapping[str, Lane], defs: Json) -> Json:
    schema = schema_of(model, defs)
    fields = schema["properties"]
    value_branch(fields["model"])["enum"] = model_ids(settings)
    value_branch(fields["lane"])["enum"] = sorted(lanes)
    value_branch(fields["service_tier"])["enum"] = sorted(settings.service_tiers)
    for name in ("max_tokens", "max_completion_tokens"):
        if name in fields:
            value_branch(fields[name])["maximum"] = max(
                lane.max_output_tokens for lane in lanes.values())
    value_branch(fields["deadline_s"])["maximum"] = max(lane.deadline_s for lane in lanes.values())
    for name, neutral in refused.items():
        fields[name] = {"enum": _as_compared(neutral), "description": "Not implemented by "
                        "tidegate: accepted at this neutral value only (any other is a 400)."}
    refuse_nul(schema)
    return schema


def _as_compared(values: tuple[Any, ...]) -> list[Any]:
    """The neutral values as api/openai_api.py compares them (Python's ==, where false is
    0 and true is 1), each form once."""
    found: list[Any] = []
    for value in values:
        forms = [value]
        if isinstance(value, int | float) and value in (0, 1):
            forms = [bool(value), int(value)]
        found += [f for f in forms if not any(type(f) is type(g) and f == g for g in found)]
    return found


def _completion(obj: str, choice_field: str) -> Json:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", choice_field],
                               "properties": {"index": {"type": "integer"}}}},
                           "usage": {"type": "object"}}}


def _model() -> Json:
    return {"type": "object", "required": ["id", "object", "owned_by", "root", "parent"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "root": {"type": "string", "description": "The base model."},
                           "parent": {"type": ["string", "null"], "description":
                                      "A LoRA adapter's base model; null for the base "
                                      "model and its lane aliases."},
                           "max_model_len": {"type": "integer"}}}


def _list(item: Json) -> Json:
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": item},
                           "has_more": {"type": "boolean"}}}


def _file_upload() -> Json:
    return {"type": "object", "required": ["purpose", "file"], "properties": {
        "purpose": {"enum": ["batch"]},
        "file": {"type": "string", "format": "binary",
                 "description": "JSONL: one request a line, as OpenAI's Batch API takes "
                                "them (custom_id, method POST, url, body)."},
        "expires_after[anchor]": {"const": "created_at"},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600,
                                   "maximum": 30 * 86400}}}


def _file() -> Json:
    return {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename",
                                           "purpose"],
            "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                           "bytes": {"type": "integer"}, "created_at": {"type": "integer"},
                           "filename": {"type": "string"}, "purpose": {"type": "string"},
                           "expires_at": _AT}}


def _batch_request() -> Json:
    return {"type": "object", "additionalProperties": False,
            "required": ["input_file_id", "endpoint", "completion_window"],
            "properties": {
                "input_file_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "endpoint": {"enum": ENDPOINTS},
                "completion_window": {"enum": ["24h"]},
                "metadata": {"type": ["object", "null"], "maxProperties": 16,
                             "propertyNames": {"maxLength": 64, "pattern": "^[^\\u0000]*$"},
                             "additionalProperties": {"type": "string", "maxLength": 512,
                                                      "pattern": "^[^\\u0000]*$"}},
                "output_expires_after": EXPIRES_AFTER}}


def _batch() -> Json:
    status = ["validating", "failed", "in_progress", "finalizing", "completed", "expired",
              "cancelling", "cancelled"]
    return {"type": "object", "required": ["id", "object", "endpoint", "status",
                                           "input_file_id", "request_counts"],
            "properties": {"id": {"type": "string"}, "object": {"const": "batch"},
                           "endpoint": {"enum": ENDPOINTS}, "status": {"enum": status},
                           "input_file_id": {"type": "string"},
                           "output_file_id": {"type": ["string", "null"]},
                           "error_file_id": {"type": ["string", "null"]},
                           "created_at": _AT, "expires_at": _AT,
                           "request_counts": {"type": "object",
                                              "required": ["total", "completed", "failed"]}}}


# -- operations ----------------------------------------------------------------------


def operations() -> dict[tuple[str, str], Json]:
    return _completions() | _files() | _batches()


def _completions() -> dict[tuple[str, str], Json]:
    return {
        ("/v1/chat/completions", "post"): _operation(
            "createChatCompletion", "A chat completion, run as a job (streamed with "
            "`stream: true`).", _answer("ChatCompletion"),
            (400, 401, 403, 404, 413, 429, 503),
            body=_json_body("ChatCompletionRequest", EXAMPLE_CHAT)),
        ("/v1/completions", "post"): _operation(
            "createCompletion", "A text completion of one prompt, run as a job.",
            _answer("TextCompletion"), (400, 401, 403, 404, 413, 429, 503),
            body=_json_body("CompletionRequest", EXAMPLE_COMPLETION)),
        ("/v1/models", "get"): _operation(
            "listModels", "What `model` may name: the served model, each lane, and each "
            "LoRA adapter the workers serve (`parent`: the base model).",
            {"200": json_response("The models.", "ModelList")}, (400, 401, 429, 503)),
        ("/v1/models/{model}", "get"): _operation(
            "retrieveModel", "One model of GET /v1/models.",
            {"200": json_response("The model.", "Model")}, (400, 401, 404, 429, 503)),
    }


def _files() -> dict[tuple[str, str], Json]:
    file_links = {"GetFile": link("retrieveFile", file_id="$response.body#/id"),
                  "FileContent": link("fileContent", file_id="$response.body#/id"),
                  "DeleteFile": link("deleteFile", file_id="$response.body#/id"),
                  "CreateBatch": link("createBatch", body={
                      "input_file_id": "$response.body#/id",
                      "endpoint": "/v1/chat/completions", "completion_window": "24h"})}
    upload = {"required": True, "content": {"multipart/form-data": {
        "schema": ref("FileUpload"),
        "encoding": {"file": {"contentType": "application/jsonl"}},
        "example": {"purpose": "batch", "file": EXAMPLE_LINE}}}}
    return {
        ("/v1/files", "get"): _operation(
            "listFiles", "The tenant's files, newest first (`order`), a page at a time.",
            {"200": json_response("A page of files.", "FileList")}, (400, 401, 429, 503),
            parameters=[{"name": name, "in": "query", "required": False}
                        for name in ("after", "limit", "order", "purpose")]),
        ("/v1/files", "post"): _operation(
            "createFile", "Upload a batch input file (JSONL), within the tenant's quotas.",
            {"200": json_response("The file.", "File", file_links)},
            (400, 401, 413, 429, 503), body=upload),
        ("/v1/files/{file_id}", "get"): _operation(
            "retrieveFile", "A file's record.", {"200": json_response("The file.", "File")},
            (400, 401, 404, 429, 503)),
        ("/v1/files/{file_id}", "delete"): _operation(
            "deleteFile", "Delete a file; the input of a batch not ended is kept (409).",
            {"200": json_response("Deleted.", "FileDeleted")}, (400, 401, 404, 409, 429, 503)),
        ("/v1/files/{file_id}/content", "get"): _operation(
            "fileContent", "A file's text, streamed.",
            {"200": {"description": "The file's JSONL.", "content": {
                "application/jsonl": {"schema": {"type": "string"}}}}},
            (400, 401, 404, 429, 503)),
    }


def _batches() -> dict[tuple[str, str], Json]:
    batch_links = {"GetBatch": link("retrieveBatch", batch_id="$response.body#/id"),
                   "CancelBatch": link("cancelBatch", batch_id="$response.body#/id")}
    return {
        ("/v1/batches", "post"): _operation(
            "createBatch", "A batch of one uploaded file's requests, run on the `flex` "
            "tier's lane, within the tenant's open-batch quota.",
            {"200": json_response("The batch, `validating`.", "Batch", batch_links)},
            (400, 401, 404, 413, 429, 503), body=_json_body("BatchRequest")),
        ("/v1/batches", "get"): _operation(
            "listBatches", "The tenant's batches, newest first, a page at a time.",
            {"200": json_response("A page of batches.", "BatchList")}, (400, 401, 429, 503),
            parameters=[{"name": name, "in": "query", "required": False}
                        for name in ("after", "limit")]),
        ("/v1/batches/{batch_id}", "get"): _operation(
            "retrieveBatch", "A batch.", {"200": json_response("The batch.", "Batch")},
            (400, 401, 404, 429, 503)),
        ("/v1/batches/{batch_id}/cancel", "post"): _operation(
            "cancelBatch", "Cancel a batch; one that has ended is returned as it is.",
            {"200": json_response("The batch, `cancelling` unless it had ended.", "Batch")},
            (400, 401, 404, 429, 503)),
    }


def _answer(schema: str) -> Json:
    whole = json_response("The completion (with `stream: true`, its chunks).", schema)
    whole["content"]["text/event-stream"] = {"schema": OPENAI_SSE}
    return {"200": whole}


def _json_body(schema: str, example: Json | None = None) -> Json:
    body: Json = {"schema": ref(schema)}
    if example is not None:
        body["example"] = example
    return {"required": True, "content": {"application/json": body}}


def _operation(operation_id: str, summary: str, ok: Json, errors: tuple[int, ...],
               body: Json | None = None, **extra: object) -> Json:
    responses = ok | {str(status): error_response(ERRORS[status], status, "OpenAIError")
                      for status in errors}
    found: Json = {"operationId": operation_id, "summary": summary, "security": BEARER,
                   "responses": responses, **extra}
    if body is not None:
        found["requestBody"] = body
    return found
