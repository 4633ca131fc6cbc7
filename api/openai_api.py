"""OpenAI's wire format in front of tidegate's jobs, as plain code (no HTTP here; the
routes are api/openai_routes.py): a request body parsed (into api/openai_models.py's
models), its lane resolved, its job made; GET /v1/models' entries.

A chat or text completion request becomes a JobRequest: the same admission, lane queue,
worker and store as POST /v1/jobs. Its lane comes from, in order: tidegate's own `lane`
(through the SDK's `extra_body`), `service_tier` (mapped by the lanes file's
[service_tiers]), `model` naming a lane, and else the `auto` tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from api.errors import ApiError
from api.openai_models import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    EXTENSIONS,
    MEDIA_PARTS,
    ChatRequest,
    CommonRequest,
    CompletionRequest,
    bad,
)
from api.schemas import JobRequest, check_text
from tidegate.jsontypes import JSONObject
from tidegate.lanes import Lane
from tidegate.router import WorkerView
from tidegate.settings import Settings

DEFAULT_TIER = "auto"
T = TypeVar("T", bound=BaseModel)
OBJECT_CREATED = 1_767_225_600  # 2026-01-01: the `created` of GET /v1/models' entries


@dataclass(frozen=True)
class Resolved:
    """A request's job, and what its answer echoes."""

    job: JobRequest
    tier: str  # the service_tier the answer reports
    param: str  # the field that chose the lane (a 403 names it)
    # The max_tokens applied because the request set none (the lane's, or OpenAI's 16 for
    # text completions): stated in the answer's usage and a header. None: the request's.
    default_max_tokens: int | None = None
    ignored: tuple[str, ...] = ()  # unknown fields, ignored (ChatRequest.ignored)


# -- parsing -----------------------------------------------------------------------


def parse_chat(body: object) -> ChatRequest:
    _refuse_media(body)
    req = _parse(ChatRequest, CHAT_REFUSED, body)
    for i, message in enumerate(req.messages):
        message.check(f"messages.{i}")
    return req


def _refuse_media(body: object) -> None:
    """Image, audio and file parts: a 400 naming the part and the capability it needs
    (no engine of tidegate's has one yet), before the model would call them malformed."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in MEDIA_PARTS:  # `type` may be any JSON
                raise bad(f"messages.{i}.content.{j}", f"a {kind!r} part needs an engine "
                          f"with the {MEDIA_PARTS[kind]!r} capability, which no lane of "
                          "this server has; send text parts")


def parse_completion(body: object) -> CompletionRequest:
    return _parse(CompletionRequest, COMPLETION_REFUSED, body)


def _parse(model: type[T], refused: Mapping[str, tuple[object, ...]], body: object) -> T:
    check_text(body)
    if not isinstance(body, dict):
        raise bad("body", "expected a JSON object")
    body = _drop_neutral(body, refused)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc) from None


def _drop_neutral(body: Mapping[str, object],
                  refused: Mapping[str, tuple[object, ...]]) -> dict[str, object]:
    """The body without refused fields at their neutral values; 400 naming one that would
    change the answer, or a field OpenAI does not define."""
    kept = {}
    for name, value in body.items():
        if name in refused:
            if value not in refused[name]:
                raise bad(name, "not supported by tidegate (docs/openai.md lists what "
                          "is)")
            continue
        kept[name] = value
    return kept


def _field_error(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    param = ".".join(loc) or "body"
    if err["type"] == "extra_forbidden":
        return bad(param, "unknown field (neither OpenAI's nor one of tidegate's extensions: "
                   f"{', '.join(EXTENSIONS)})")
    return bad(param, err["msg"].removeprefix("Value error, "))


# -- lanes ---------------------------------------------------------------------------


def served_model(settings: Settings) -> str:
    """The model's id in the API: its folder's name."""
    return settings.model_path.name


def model_ids(settings: Settings, adapters: Iterable[str] = ()) -> list[str]:
    """What `model` may name: the served model, each lane by name (a lane alias), and
    each LoRA adapter served (`adapter_names`)."""
    base = [served_model(settings), *sorted(settings.lanes)]
    return [*base, *sorted(set(adapters) - set(base))]


def adapter_names(settings: Settings, fleet: Iterable[WorkerView]) -> frozenset[str]:
    """The LoRA adapters `model` may name: those of this process's TIDEGATE_LORA_ADAPTERS
    and those the live workers' heartbeats advertise (a worker-side setting)."""
    names = {name for name, _ in settings.lora}
    for worker in fleet:
        names |= worker.lora
    return frozenset(names)


def model_not_found(settings: Settings, model: str, adapters: Iterable[str]) -> ApiError:
    known = ", ".join(model_ids(settings, adapters))
    return ApiError(404, "model", f"model: {model!r} does not exist; models are {known} "
                    "(GET /v1/models)", kind="model_not_found")


def lane_of(settings: Settings, req: CommonRequest,
            adapters: frozenset[str] = frozenset()) -> tuple[str, str, str]:
    """(lane, service_tier to report, the field that chose it)."""
    tiers = settings.service_tiers
    if req.model not in model_ids(settings, adapters):
        raise model_not_found(settings, req.model, adapters)
    if req.service_tier is not None and req.service_tier not in tiers:
        raise bad("service_tier", f"unknown tier {req.service_tier!r}; tiers are "
                  f"{', '.join(sorted(tiers))}")
    if req.lane is not None:
        return req.lane, tier_of(settings, req.lane), "lane"
    if req.service_tier is not None:
        return tiers[req.service_tier], req.service_tier, "service_tier"
    if req.model in settings.lanes:
        return req.model, tier_of(settings, req.model), "model"
    if DEFAULT_TIER not in tiers:
        raise bad("service_tier", f"required: the lanes file maps no {DEFAULT_TIER!r} tier")
    return tiers[DEFAULT_TIER], "default", "service_tier"


def tier_of(settings: Settings, lane: str) -> str:
    """The tier a lane is sold as (its first in the lanes file); else the lane's name."""
    for tier, name in settings.service_tiers.items():
        if name == lane and tier != DEFAULT_TIER:
            return tier
    return lane


def resolve(settings: Settings, req: ChatRequest | CompletionRequest,
            tenant_lanes: frozenset[str], adapters: frozenset[str] = frozenset()) -> Resolved:
    """The job a completion request makes (its lane checked against the tenant's). A
    `model` naming a LoRA adapter (one of `adapters`) is the job's `lora`, on the lane the
    other fields choose, as for the base model; the router sends it to a worker serving
    the adapter."""
    lane_name, tier, param = lane_of(settings, req, adapters)
    lane = settings.lanes.get(lane_name)
    if lane is None:
        known = ", ".join(sorted(settings.lanes))
        raise bad("lane", f"unknown lane {lane_name!r}; lanes are {known}")
    if lane_name not in tenant_lanes:
        raise ApiError(403, param, f"{param}: this API key may not use lane {lane_name!r}"
                       + (f" (service tier {tier!r})" if param == "service_tier" else ""),
                       kind="permission_denied")
    ignored = req.ignored()
    if ignored and lane.strict_fields:
        raise bad(ignored[0], f"unknown field (neither OpenAI's, vLLM's nor one of tidegate's "
                  f"extensions: {', '.join(EXTENSIONS)}); lane {lane_name!r} refuses unknown "
                  "fields (strict_fields)")
    common: dict[str, Any] = dict(
        lane=lane_name, priority=req.priority, session_id=req.session_id,
        max_tokens=_max_tokens(lane, req.token_limit()),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        deadline_s=req.deadline_s, idempotency_key=req.idempotency_key, stop=list(req.stops()),
        lora=_lora_of(settings, req.model, adapters), **req.sampling())
    if isinstance(req, ChatRequest):
        job = _job(messages=[m.as_message() for m in req.messages],
                   response_format=req.response_format, tools=req.tools,
                   tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                   **common)
    else:
        job = _job(prompt=req.text(), **common)
    return Resolved(job=job, tier=tier, param=param,
                    default_max_tokens=_defaulted(req, job.max_tokens), ignored=tuple(ignored))


def _defaulted(req: ChatRequest | CompletionRequest, applied: int) -> int | None:
    """The limit applied when the request set none (else None)."""
    named = {"max_tokens", "max_completion_tokens"} & req.model_fields_set
    return None if named and req.token_limit() is not None else applied


def _lora_of(settings: Settings, model: str, adapters: frozenset[str]) -> str | None:
    """The adapter `model` names; None for the base model or a lane alias (they win a
    clash: an adapter named like a lane is reached through the jobs API's `lora`)."""
    base = {served_model(settings), *settings.lanes}
    return model if model in adapters and model not in base else None


def _max_tokens(lane: Lane, asked: int | None) -> int:
    """The request's limit; without one, the lane's (a chat completion's default is as long
    as the model allows: here, as the lane allows)."""
    return lane.max_output_tokens if asked is None else asked


def _job(**fields: object) -> JobRequest:
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise _field_error(exc) from None


def models_list(settings: Settings, adapters: Iterable[str] = ()) -> JSONObject:
    """GET /v1/models: the served model, the lanes as its aliases, the LoRA adapters (as
    vLLM's server lists them: `parent` the base model)."""
    return {"object": "list", "data": [model_card(settings, name, adapters)
                                       for name in model_ids(settings, adapters)]}


def model_card(settings: Settings, model_id: str, adapters: Iterable[str] = ()) -> JSONObject:
    """One model's entry (GET /v1/models/{id}); 404 `model_not_found` for an unknown id.
    `root` is the base model for every entry (vLLM's is a path: not shown here); `parent`
    is the base model for an adapter, null for the base model and its lane aliases."""
    if model_id not in model_ids(settings, adapters):
        raise model_not_found(settings, model_id, adapters)
    base = served_model(settings)
    adapter = model_id != base and model_id not in settings.lanes
    return {"id": model_id, "object": "model", "created": OBJECT_CREATED,
            "owned_by": "tidegate", "root": base, "parent": base if adapter else None,
            "max_model_len": settings.max_model_len}
