"""What an engine can do beyond plain text generation, by name.

Each engine class says which of these it has (`capabilities`, workers/engine.py); a worker
puts its engine's in its heartbeat (tidegate/records.py), and admission refuses a request
that needs one no active worker of its lane has: a 400 naming the request's field, before
any row is written or message sent (api/submit.py `needs`, tidegate/router.py). Without
the check, the job would be queued and then fail on the worker (a 502 after the wait).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

N = "n"  # several choices from one request (`n` > 1), sampled inside the engine
LOGPROBS = "logprobs"  # the log-probability of each output token, and the top alternatives
PENALTIES = "penalties"  # presence_penalty, frequency_penalty, repetition_penalty
LOGIT_BIAS = "logit_bias"  # a bias added to chosen tokens' logits
SAMPLING_EXTRAS = "sampling_extras"  # vLLM's top_k and min_p
STOP = "stop"  # stop strings, left out of the output (every engine has it)
LORA = "lora"  # LoRA adapters by name
STRUCTURED_OUTPUT = "structured_output"  # response_format json_object / json_schema
TOOLS = "tools"  # tool calling (tool definitions rendered, calls parsed)
VISION = "vision"  # image content parts (no engine of tidegate's has it yet)
AUDIO = "audio"  # audio content parts (no engine of tidegate's has it yet)

ALL: frozenset[str] = frozenset({N, LOGPROBS, PENALTIES, LOGIT_BIAS, SAMPLING_EXTRAS, STOP,
                                 LORA, STRUCTURED_OUTPUT, TOOLS, VISION, AUDIO})


class SamplingFields(Protocol):
    """The request fields `needs` reads, which a JobRequest (the API) and a payload's
    Sampling (the reconciler) name alike; only their presence or value is read, so each
    is as loose as either's type."""

    @property
    def n(self) -> int: ...
    @property
    def logprobs(self) -> object: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def logit_bias(self) -> object: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def stop(self) -> object: ...


def needs(sampling: SamplingFields) -> dict[str, str]:
    """The capabilities a job's sampling needs, each to the request field that needs it:
    `sampling` is a JobRequest (the API) or a payload's Sampling (the reconciler), which
    name these fields alike. Fields at their neutral values need nothing."""
    out: dict[str, str] = {}
    if sampling.n > 1:
        out[N] = "n"
    if sampling.logprobs is not None:
        out[LOGPROBS] = "logprobs"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(sampling, name) not in (None, 0.0):
            out.setdefault(PENALTIES, name)
    if sampling.repetition_penalty not in (None, 1.0):
        out.setdefault(PENALTIES, "repetition_penalty")
    if sampling.logit_bias:
        out[LOGIT_BIAS] = "logit_bias"
    if sampling.top_k not in (None, 0, -1):
        out[SAMPLING_EXTRAS] = "top_k"
    elif sampling.min_p not in (None, 0.0):
        out[SAMPLING_EXTRAS] = "min_p"
    if sampling.stop:
        out[STOP] = "stop"
    return out


def output_needs(guided: Mapping[str, object] | None,
                 tool_parse: Mapping[str, object] | None) -> dict[str, str]:
    """What a job's structured output and `auto` tool parsing need, from its payload
    (`guided`, `tool_parse`: api/openai_tools.py): the reconciler routes a job sent again
    by it. (Admission names the request's own field: api/openai_tools.py `needs`.)"""
    out: dict[str, str] = {}
    if tool_parse:
        out[TOOLS] = "tools"
    if guided:
        out[STRUCTURED_OUTPUT] = "response_format"
    return out
