"""Task payloads: JSON dictionaries on the wire, typed dataclasses on both ends."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GENERATE = "tidegate.generate"  # task name; the worker registers its body under it


@dataclass(frozen=True)
class Sampling:
    max_tokens: int  # tokens to generate at most
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    seed: int | None = None  # fixed seed: a redelivered job resumes the same way
    stop: tuple[str, ...] = ()  # strings that end the output (not included in it)
    # As vLLM's SamplingParams (workers/engine.py EngineRequest); None: the engine's default.
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # alternatives per token; None: no logprobs


@dataclass(frozen=True)
class GeneratePayload:
    """What a worker needs to run one job.

    The prompt travels in the message, so a worker needs no store read to start. The
    store keeps this payload too (jobs.payload, written with the row before the 202) until
    the job ends, so that a message Redis lost is sent again from it (scheduler/
    reconcile.py); it is dropped when the job ends: prompts are not kept after.
    """

    job_id: str  # also the Celery task id
    lane: str
    prompt: str  # the rendered prompt (chat template already applied)
    prompt_tokens: int  # counted by the API with the model's tokenizer
    sampling: Sampling
    session_id: str | None = None  # the tenant's own id for its conversation
    turn: int = 0  # turn number of the session (1-based), 0 for one-shot requests
    tenant_id: int | None = None  # whose session it is (None: a payload older than this)
    # Epoch seconds, fixed at accept; past it the job ends `expired`. Never moved, also not
    # for time a job lay orphaned (the deadline rule: scheduler/reconcile.py).
    deadline_at: float | None = None
    lora: str | None = None  # LoRA adapter name; the router sent the job to a worker with it
    # Tokens of the rendered system turn: the lane's shared prefix, kept longer by the KV
    # cache on engines that take retention per token range (TensorRT-LLM).
    shared_prefix_tokens: int = 0
    # The tenant's prefix-cache salt (Lane.cache_salt); None: the lane shares its cache.
    cache_salt: str | None = None
    # The submit's W3C trace context (`traceparent`, `tracestate`; tidegate/tracing.py):
    # the worker's job span continues the API's trace. Kept with the stored payload, so a
    # job sent again by the reconciler stays in its trace. Empty: the API was not tracing.
    trace_context: dict[str, str] = field(default_factory=dict)
    # Structured output the engine enforces (vLLM's StructuredOutputsParams fields:
    # {"json": schema} or {"json_object": True}); None: free text (api/openai_tools.py).
    guided: dict[str, Any] | None = None
    # `auto` tool calls, found in the text by the lane's parser: {"parser", "tools"}.
    tool_parse: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # forward-compatible knobs

    @property
    def session_key(self) -> str | None:
        """The session's name across tenants (the engine's KV session identity): two
        tenants' sessions of one id are two sessions."""
        if self.session_id is None or self.tenant_id is None:
            return self.session_id
        return f"{self.tenant_id}:{self.session_id}"

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["sampling"]["stop"] = list(self.sampling.stop)  # as JSON gives it back
        body["sampling"]["logit_bias"] = [list(pair) for pair in self.sampling.logit_bias]
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> GeneratePayload:
        body = dict(body)
        sampling = dict(body["sampling"])
        sampling["stop"] = tuple(sampling.get("stop") or ())  # a JSON list
        sampling["logit_bias"] = tuple((int(token), float(bias))
                                       for token, bias in sampling.get("logit_bias") or ())
        body["sampling"] = Sampling(**sampling)
        return cls(**body)
