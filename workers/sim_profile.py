"""The simulated engine's timing model (workers/sim_engine.py): what one step costs, as
named profiles in workers/sim_profiles.toml."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from workers.engine import EngineError

PROFILES_FILE = Path(__file__).with_name("sim_profiles.toml")


@dataclass(frozen=True)
class SimProfile:
    """What one step costs; workers/sim_profiles.toml explains each figure."""

    name: str
    prefill_ms_per_token: float = 0.0  # each uncached prompt token
    decode_base_ms: float = 0.0  # one forward pass: the weights read once a step
    decode_ms_per_seq: float = 0.0  # each sequence decoding in the step
    decode_ms_per_1k_kv_tokens: float = 0.0  # attention reading the decoders' KV cache
    max_batched_tokens: int = 0  # tokens one step computes (decodes, prefill); 0: no limit
    kv_capacity_tokens: int = 1_000_000  # with 16-bit entries; an FP8 KV cache holds twice
    # A fresh worker's engine load and warm-up, and a standby worker's activation (warm the
    # lane's prefixes, add_consumer): played only on a replay clock, compressed by its
    # speed-up (`SimEngine(startup_scale=...)`); elsewhere a sim engine starts at once.
    cold_start_s: float = 0.0
    activation_s: float = 0.0

    def step_s(self, decoding: int, kv_tokens: int, prefill_tokens: int) -> float:
        """Seconds of one step that decodes `decoding` sequences holding `kv_tokens`
        tokens of KV cache between them and computes `prefill_tokens` prompt tokens."""
        if not decoding and not prefill_tokens:
            return 0.0
        ms = (self.decode_base_ms + self.decode_ms_per_seq * decoding
              + self.decode_ms_per_1k_kv_tokens * kv_tokens / 1000
              + self.prefill_ms_per_token * prefill_tokens)
        return ms / 1000


def load_profile(name: str, path: Path = PROFILES_FILE) -> SimProfile:
    """A named profile; an unknown name or a bad field is an EngineError naming it."""
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise EngineError(f"sim profiles {path}: {exc}") from None
    body = profiles.get(name)
    if not isinstance(body, dict):
        raise EngineError(f"unknown sim profile {name!r}; known: {', '.join(sorted(profiles))}")
    known = {f.name: f for f in fields(SimProfile) if f.name != "name"}
    values: dict[str, Any] = {}
    for key, value in body.items():
        if key == "description":
            continue
        if key not in known:
            raise EngineError(f"sim profile {name!r}: unknown field {key!r}; "
                              f"fields: {', '.join(known)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise EngineError(f"sim profile {name!r}: {key} must be a number >= 0, "
                              f"not {value!r}")
        values[key] = int(value) if known[key].type == "int" else float(value)
    return SimProfile(name=name, **values)
