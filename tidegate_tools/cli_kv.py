"""`tidegate kv`: the KV cache eviction policies offline, a trace replayed against one
(`kv replay`) and a synthetic multi-turn trace written (`kv synth`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tidegate.settings import get_settings
from tidegate_tools.argtypes import positive, turn_range


def _kv_replay(args: argparse.Namespace) -> None:
    import json

    from workers.kvcache.sim import replay
    from workers.kvcache.trace import TraceError, read_trace, session_metas

    lanes = get_settings().lanes
    if args.lane not in lanes:
        sys.exit(f"tidegate kv replay: unknown lane {args.lane!r}; lanes: {sorted(lanes)}")
    try:
        requests = read_trace(args.trace)
    except TraceError as exc:
        sys.exit(f"tidegate kv replay: {exc}")
    metas = list(session_metas(requests, set(args.one_shot_types.split(",")), args.lane))
    try:
        result = replay(requests, metas, args.policy, args.capacity_blocks,
                        lanes[args.lane].kv_policy, block_tokens=args.block_tokens)
    except ValueError as exc:
        sys.exit(f"tidegate kv replay: {exc}")
    print(json.dumps(result.summary()))


def _kv_synth(args: argparse.Namespace) -> None:
    import json
    from dataclasses import asdict, fields

    from workers.kvcache.synth import SynthParams, synthesize
    from workers.kvcache.trace import write_trace

    options = {f.name: getattr(args, f.name) for f in fields(SynthParams)}
    try:
        params = SynthParams().with_options(**options)
        count = write_trace(args.out, synthesize(params))
    except (ValueError, OSError) as exc:
        sys.exit(f"tidegate kv synth: {exc}")
    print(json.dumps({"trace": str(args.out), "requests": count, "params": asdict(params)}))


def add_kv_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kv = sub.add_parser("kv", help="KV cache: trace replay and synthetic traces").add_subparsers(
        dest="kv_cmd", required=True)
    r = kv.add_parser("replay", help="hit rate of an eviction policy on a trace (JSONL, the "
                      "Qwen-Bailian schema); the last line is JSON")
    r.add_argument("--trace", type=Path, required=True)
    r.add_argument("--capacity-blocks", type=positive, required=True)
    r.add_argument("--policy", choices=["lru", "session", "belady", "infinite"], required=True)
    r.add_argument("--block-tokens", type=positive, default=16,
                   help="the engine's block size, a multiple of 16 (default 16)")
    r.add_argument("--lane", default="chat", help="whose kv_policy parameters (lanes file)")
    r.add_argument("--one-shot-types", default="oneshot",
                   help="trace `type` values of one-shot requests (comma list)")
    r.set_defaults(func=_kv_replay)
    s = kv.add_parser("synth", help="write a synthetic multi-turn trace (workers/kvcache/synth.py "
                      "documents every parameter)")
    s.add_argument("--out", type=Path, required=True)
    _synth_options(s)
    s.set_defaults(func=_kv_synth)


def _synth_options(parser: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from workers.kvcache.synth import SynthParams

    defaults = SynthParams()
    for f in fields(SynthParams):
        default = getattr(defaults, f.name)
        kind: Callable[[str], object] = turn_range if isinstance(default, tuple) else type(default)
        shown = "-".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                            help=f"default {shown}")
