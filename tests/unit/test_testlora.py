"""The local test LoRA adapter: PEFT layout, deterministic, cached, and safe for the anchor.

No vLLM here: engine start is slow. tidegate/testlora.py says what was checked with vLLM.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tidegate_tools.testlora import (
    CONFIG_FILE,
    LORA_PARAMS,
    PREFIX,
    TARGETS,
    WEIGHTS_FILE,
    build_test_lora,
)
from tidegate_tools.testmodel import BUILD_FILE

WRITERS = {name for name, (_, reads) in TARGETS.items() if not reads}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def base_dir(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config and build record of the test checkpoint: all the adapter build reads."""
    base = tmp_path_factory.mktemp("base")
    for name in ["config.json", BUILD_FILE]:
        shutil.copy(model_path / name, base / name)
    return base


@pytest.fixture(scope="module")
def lora_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_lora(base_dir, tmp_path_factory.mktemp("build") / "lora")


def test_adapter_config(lora_dir: Path, base_dir: Path) -> None:
    config = json.loads((lora_dir / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (8, 16, "none")
    assert set(config["target_modules"]) == set(TARGETS)
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    assert not config["use_dora"] and not config["modules_to_save"]


def test_tensor_names_and_shapes_match_the_base(lora_dir: Path, model_path: Path) -> None:
    base = load_file(model_path / "model.safetensors")
    lora = load_file(lora_dir / WEIGHTS_FILE)
    layers = json.loads((model_path / "config.json").read_text())["num_hidden_layers"]
    rank = LORA_PARAMS.r
    expected = set()
    for layer in range(layers):
        for module, (block, _) in TARGETS.items():
            stem = f"model.layers.{layer}.{block}.{module}"
            expected |= {f"{PREFIX}{stem}.lora_A.weight", f"{PREFIX}{stem}.lora_B.weight"}
            out_dim, in_dim = base[f"{stem}.weight"].shape
            assert lora[f"{PREFIX}{stem}.lora_A.weight"].shape == (rank, in_dim), stem
            assert lora[f"{PREFIX}{stem}.lora_B.weight"].shape == (out_dim, rank), stem
    assert set(lora) == expected
    assert all(w.dtype == np.float16 for w in lora.values())


def test_adapter_never_touches_the_anchor(lora_dir: Path) -> None:
    lora = load_file(lora_dir / WEIGHTS_FILE)
    for name, w in lora.items():
        module = name.split(".")[-3]
        if module in WRITERS and ".lora_B." in name:
            assert not w[0].any(), name  # row 0: hidden dimension 0 is never written
            assert np.abs(w[1:]).max() > 0.05, name  # but the rest is not negligible
        if module not in WRITERS and ".lora_A." in name:
            assert not w[:, 0].any(), name  # column 0: the constant anchor is not read


def test_build_is_deterministic(lora_dir: Path, base_dir: Path, tmp_path: Path) -> None:
    again = build_test_lora(base_dir, tmp_path / "again")
    for name in [CONFIG_FILE, WEIGHTS_FILE, BUILD_FILE]:
        assert sha256(again / name) == sha256(lora_dir / name), name


def test_second_call_is_a_cache_hit(
    lora_dir: Path, base_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    before = (lora_dir / WEIGHTS_FILE).stat().st_mtime_ns
    assert build_test_lora(base_dir, lora_dir) == lora_dir
    assert (lora_dir / WEIGHTS_FILE).stat().st_mtime_ns == before
    assert capsys.readouterr().err == ""  # no progress lines: nothing was built


def test_stale_build_or_new_base_is_rebuilt(base_dir: Path, tmp_path: Path, capsys) -> None:
    out = build_test_lora(base_dir, tmp_path / "lora")
    good = sha256(out / WEIGHTS_FILE)
    (out / WEIGHTS_FILE).write_bytes(b"half")
    (out / BUILD_FILE).write_text('{"fingerprint": "old"}')
    build_test_lora(base_dir, out)
    assert "building" in capsys.readouterr().err
    assert sha256(out / WEIGHTS_FILE) == good
    assert [p.name for p in tmp_path.iterdir()] == ["lora"]  # no temp dirs left behind

    base = tmp_path.parent / f"{tmp_path.name}-base"
    shutil.copytree(base_dir, base)
    (base / BUILD_FILE).write_text('{"fingerprint": "a rebuilt base"}')
    build_test_lora(base, out)
    assert "building" in capsys.readouterr().err
    shutil.rmtree(base)


def test_refusals(base_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_test_lora(base_dir, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    with pytest.raises(FileNotFoundError):
        build_test_lora(tmp_path / "no-model", tmp_path / "lora")


def test_merged_adapter_changes_greedy_text_and_never_yields_blocked_ids(
    model_path: Path, lora_dir: Path
) -> None:
    """What vLLM computes with the adapter: W + (alpha / r) B @ A on every target."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    blocked = np.ones(vocab_size, dtype=bool)
    for index in range(len(tokenizer)):
        text = str(tokenizer.decode([index]))
        special = index in tokenizer.all_special_ids
        blocked[index] = special or "\ufffd" in text or not text.isprintable()

    chat = [{"role": "user", "content": "Where is my order? 我的订单到哪了？"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    inputs = torch.tensor([tokenizer(prompt)["input_ids"]])
    scaling = LORA_PARAMS.lora_alpha / LORA_PARAMS.r
    lora = load_file(lora_dir / WEIGHTS_FILE)
    outputs = []
    for merge in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        if merge:
            state = model.state_dict()
            for name, a in lora.items():
                if ".lora_A." in name:
                    b = lora[name.replace(".lora_A.", ".lora_B.")]
                    stem = name.removeprefix(PREFIX).removesuffix(".lora_A.weight")
                    delta = torch.from_numpy(b.astype(np.float32) @ a.astype(np.float32))
                    state[f"{stem}.weight"] += scaling * delta
            model.load_state_dict(state)
        torch.manual_seed(0)
        for sample in (False, True):
            extra = {"temperature": 1.0, "top_k": 0} if sample else {}
            out = model.generate(
                inputs, max_new_tokens=24, do_sample=sample, eos_token_id=None, **extra
            )
            new = out[0, inputs.shape[1] :].tolist()
            assert len(new) == 24 and not blocked[new].any()
            assert str(tokenizer.decode(new)).strip()
            if not sample:
                outputs.append(new)
    assert outputs[0] != outputs[1]
