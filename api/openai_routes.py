"""The OpenAI-compatible front door: POST /v1/chat/completions, POST /v1/completions,
GET /v1/models (the Batch API is api/batches.py). The translation is api/openai_api.py;
here is HTTP: a request is admitted as a job like POST /v1/jobs, then its answer is read
from the job's event stream (api/openai_stream.py).

Streaming sends OpenAI's chunks as the job's token events arrive, then `data: [DONE]`. A
client that goes away before the end cancels its job, unless its lane keeps jobs running
(`keep_on_disconnect`). Without streaming, the answer waits for the job's end and is
built from its row. Either way a quiet job is checked against the store once per
keep-alive period, so a job whose events Redis lost still gets its answer.

These routes answer errors in OpenAI's shape (api/app.py `handle_api_error`) and are not
in /openapi.json: OpenAI's own specification describes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from urllib.parse import quote

from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse

from api.auth import Tenant, authenticate, bearer_key
from api.deps import Deps, EventStream, admit, check_headers, json_body, lane_rank
from api.openai_answers import Answer
from api.openai_api import (
    Resolved,
    adapter_names,
    model_card,
    model_ids,
    models_list,
    parse_chat,
    parse_completion,
    resolve,
)
from api.openai_models import ChatRequest, CompletionRequest
from api.openai_stream import Watch, chunks, whole
from api.schemas import JobAccepted

log = logging.getLogger("tidegate.api")

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files",
                "/v1/batches")
IGNORED_HEADER = "x-tidegate-ignored-fields"  # unknown request fields, ignored (names)
MAX_NAMES, MAX_NAME_CHARS = 16, 64  # of the header's list: a body may hold thousands
# The max_tokens applied because the request set none (also usage.default_max_tokens).
DEFAULT_MAX_TOKENS_HEADER = "x-tidegate-default-max-tokens"


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


def install(app: FastAPI, deps: Deps) -> None:
    checked = [Depends(check_headers)]

    @app.post("/v1/chat/completions", dependencies=checked, include_in_schema=False)
    async def chat(request: Request, idempotency_key: str | None = Header(None)) -> Response:
        tenant = await authenticate(deps.store, request)
        return await _complete(deps, request, tenant,
                               parse_chat(await json_body(request, deps)), idempotency_key)

    @app.post("/v1/completions", dependencies=checked, include_in_schema=False)
    async def completions(request: Request,
                          idempotency_key: str | None = Header(None)) -> Response:
        tenant = await authenticate(deps.store, request)
        return await _complete(deps, request, tenant,
                               parse_completion(await json_body(request, deps)),
                               idempotency_key)

    @app.get("/v1/models", dependencies=checked, include_in_schema=False)
    async def models(request: Request) -> JSONResponse:
        await authenticate(deps.store, request)
        adapters = await asyncio.to_thread(_adapters, deps)
        return JSONResponse(models_list(deps.settings, adapters))

    @app.get("/v1/models/{model:path}", dependencies=checked, include_in_schema=False)
    async def retrieve_model(model: str, request: Request) -> JSONResponse:
        # `:path`: a model id may hold a slash (vLLM serves "org/name").
        await authenticate(deps.store, request)
        adapters = await asyncio.to_thread(_adapters, deps)
        return JSONResponse(model_card(deps.settings, model, adapters))


def _adapters(deps: Deps) -> frozenset[str]:
    """The LoRA adapters a `model` may name (the fleet's heartbeats: a cached read)."""
    return adapter_names(deps.settings, deps.fleet())


async def _complete(deps: Deps, request: Request, tenant: Tenant,
                    req: ChatRequest | CompletionRequest, header_key: str | None) -> Response:
    # The fleet is read only for a `model` that is neither the base model nor a lane.
    adapters = (frozenset() if req.model in model_ids(deps.settings)
                else await asyncio.to_thread(_adapters, deps))
    resolved = resolve(deps.settings, req, tenant.lanes, adapters=adapters)
    job = resolved.job
    # A stream's slot first: a stream the caps refuse must leave no job behind.
    give_back = deps.streams.take(tenant.id) if req.stream else None
    try:
        await deps.prompts.loaded()
        accepted: JobAccepted = await deps.admission.run(
            lane_rank(deps, job.lane, job.priority, tenant), admit, deps, bearer_key(request), job,
            header_key)
    except BaseException:
        if give_back is not None:
            give_back()
        raise
    answer = Answer.of(accepted.job_id, req, resolved.tier, resolved.default_max_tokens)
    headers = {**_headers(accepted.job_id, resolved), **accepted._rate_limits}
    keep = deps.settings.lanes[accepted.lane].keep_on_disconnect
    watch = Watch(deps, accepted.job_id, tenant.id, keep)
    if give_back is not None:
        return EventStream(chunks(watch, answer, req.include_usage), give_back, headers,
                           openai=True)
    return JSONResponse(await whole(watch, request, answer), headers=headers)


def _headers(job_id: str, resolved: Resolved) -> dict[str, str]:
    """The answer's headers: its job, the unknown fields ignored (named in a log line too,
    never their values), the max_tokens applied because the request set none."""
    headers = {"x-request-id": job_id}
    if resolved.ignored:
        names = ignored_names(resolved.ignored)
        headers[IGNORED_HEADER] = names
        log.warning("job %s: ignored unknown request fields: %s", job_id, names,
                    extra={"job_id": job_id})
    if resolved.default_max_tokens is not None:
        headers[DEFAULT_MAX_TOKENS_HEADER] = str(resolved.default_max_tokens)
    return headers


def ignored_names(names: Sequence[str]) -> str:
    """The names as a header value can carry them: a field name is any JSON string (lone
    surrogates and control characters included, which no header may hold), so each is
    percent-encoded and cut at MAX_NAME_CHARS, and at most MAX_NAMES are listed."""
    shown = [quote(name[:MAX_NAME_CHARS].encode("utf-8", "backslashreplace"), safe="._-")
             for name in names[:MAX_NAMES]]
    more = len(names) - len(shown)
    return ",".join(shown) + (f",(+{more} more)" if more > 0 else "")
