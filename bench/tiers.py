"""Service tiers under overload, through the OpenAI-compatible API: the lanes benchmark's
load (bench/lanes.py: finance and chat together, 4x more requests in flight than engine
slots), sent to tidegate's POST /v1/completions with `service_tier="priority"` for the
finance requests and `"default"` for the chat ones, beside vLLM's own OpenAI server
taking the same mix first come, first served.

The claim (issue text): `priority` requests keep the finance lane's TTFT advantage: their
TTFT p99 is at most 0.3x the peer's for the same requests, as bench/lanes.py asks of
POST /v1/jobs.

    .venv/bin/python bench/tiers.py

Writes bench/results/tiers.{md,png,json}; the last stdout line is the JSON summary.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # a file run: python bench/tiers.py
    from _shim import run_as_module

    run_as_module(__file__)  # runs this file as the module bench.tiers, then exits

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from bench import lanes
from bench.common import fmt
from bench.stack import (
    MODEL,
    TEMPERATURE,
    Arrivals,
    Measured,
    RequestFn,
    RequestSpec,
    Sample,
    Session,
    check_done,
    completion_chunks,
    measure_peer,
    measure_tidegate,
    publish,
    run_benchmark,
    shared_notes,
    ttfts,
)

TIERS = {"finance": "priority", "chat": "default"}  # the shipped [service_tiers] map


async def openai_request(http: httpx.AsyncClient, spec: RequestSpec) -> Sample:
    """One streamed text completion on tidegate's OpenAI-compatible API. A chunk carries
    the text of one job event (one or more tokens): the token count comes from the usage
    chunk at the end, the arrival times from the chunks."""
    body = {"model": MODEL.name, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": TEMPERATURE, "stream": True, "service_tier": TIERS[spec.lane],
            "stream_options": {"include_usage": True}}
    clock, usage, tier = Arrivals(spec.max_tokens), None, None
    async for chunk in completion_chunks(http, body):
        if "error" in chunk:
            raise RuntimeError(f"error chunk: {chunk['error']}")
        usage, tier = chunk.get("usage") or usage, chunk.get("service_tier") or tier
        if any(c.get("text") for c in chunk.get("choices") or []):
            clock.add(1)
    if tier != TIERS[spec.lane]:
        raise RuntimeError(f"answered as tier {tier!r}, asked {TIERS[spec.lane]!r}")
    clock.tokens = (usage or {}).get("completion_tokens") or clock.tokens
    return check_done(clock.sample(), {"usage": usage} if usage else None)


def openai_session(base: str, key: str) -> Session:
    @asynccontextmanager
    async def session() -> AsyncIterator[RequestFn]:
        headers = {"Authorization": f"Bearer {key}"}
        timeout = httpx.Timeout(60.0, read=None)
        limits = httpx.Limits(max_connections=lanes.IN_FLIGHT * 2)
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout,
                                     limits=limits) as http:
            yield lambda spec: openai_request(http, spec)

    return session


NOTES = [
    "tidegate: POST /v1/completions, streamed, `service_tier` `priority` (finance) or "
    "`default` (chat), mapped to lanes by the shipped lanes file's [service_tiers]; every "
    "answer's `service_tier` was checked against the one asked. The peer: vLLM's "
    "POST /v1/completions, streamed, FCFS, no tiers.",
    "The same stack, load, prompts and order as bench/lanes.py (its setup and notes apply: "
    "one worker per lane with 8 slots each; the peer one engine with 16).",
    "tidegate's chunks carry one job event each (one or more tokens): TTFT is the first "
    "chunk with text, the token count the final usage chunk's.",
]


def report(m: Measured) -> dict[str, Any]:
    tide, peer = lanes.per_lane(m.tide, False), lanes.per_lane(m.peer, False)
    setup_ = lanes.setup(m) | {"tidegate API": "POST /v1/completions with service_tier"}
    out = lanes.figures(tide, peer, setup_, m.wall_s) | {"benchmark": "tiers"}
    out["priority_over_default_ttft_p99"] = (tide["finance"]["ttft_p99_ms"]
                                            / tide["chat"]["ttft_p99_ms"])
    verdict = (f"Claim (service_tier=priority TTFT p99 on tidegate <= {lanes.CLAIM_MAX_RATIO}x "
               f"the peer's for the same requests, and tokens/s over all tiers >= "
               f"{lanes.CLAIM_MIN_TOKENS_RATIO}x the peer's, in the same run): "
               f"{'HOLDS' if out['claim_holds'] else 'DOES NOT HOLD'}, ratios "
               f"{fmt(out['finance_ttft_p99_ratio'], 2)} and "
               f"{fmt(out['all_tokens_per_s_ratio'], 2)}; priority over default on tidegate "
               f"{fmt(out['priority_over_default_ttft_p99'], 2)}.")
    series = {f"{who} {lane}": ttfts(rounds, lane) for lane in lanes.LANES
              for who, rounds in (("tidegate", m.tide), ("vLLM", m.peer))}
    publish("tiers", "Service tiers under 4x overload, through the OpenAI API: tidegate vs "
            "vLLM's OpenAI server (FCFS)", lanes.table(tide, peer), setup_,
            [verdict, *NOTES, *shared_notes(m)], series,
            f"TTFT by tier (priority = finance, default = chat), {lanes.FINANCE} + "
            f"{lanes.CHAT} in flight for {lanes.PEER_SEQS} slots", out,
            histogram=False, styles=lanes.STYLES)
    return out


def main() -> int:
    return run_benchmark(
        "tiers",
        lambda tmp: measure_tidegate(tmp, lanes.WORKERS, lanes.SLOTS_PER_WORKER,
                                     lanes.load("tidegate via /v1/completions"),
                                     postgresql=True, session=openai_session),
        lambda tmp: measure_peer(tmp, lanes.PEER_SEQS, lanes.IN_FLIGHT * 2,
                                 lanes.load("vLLM server")),
        report)


if __name__ == "__main__":
    sys.exit(main())
