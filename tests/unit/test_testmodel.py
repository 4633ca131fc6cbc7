"""The local test checkpoint: deterministic, cached, loadable, and never emits a blocked token.

No vLLM here: engine start is slow. The module docstring says what was checked with vLLM.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tidegate_tools.testmodel import BUILD_FILE, build_test_model, corpus_lines

EN_LINE = "Your refund of $24.99 for order 58213 has been approved."
ZH_LINE = "您的订单已发货，预计明天送达。"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_model(tmp_path_factory.mktemp("build") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def blocked(model_dir: Path, tokenizer) -> np.ndarray:
    """Ids generation must never yield: specials, padding, partial UTF-8, control chars."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    mask = np.ones(vocab_size, dtype=bool)
    for index in range(len(tokenizer)):
        text = tokenizer.decode([index])
        special = index in tokenizer.all_special_ids
        mask[index] = special or "\ufffd" in text or not text.isprintable()
    return mask


def test_config_shape(model_dir: Path, tokenizer) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU needs 64
    assert config["vocab_size"] % 64 == 0
    assert len(tokenizer) <= config["vocab_size"] < len(tokenizer) + 64
    assert 1000 <= len(tokenizer) <= 3000
    assert config["tie_word_embeddings"] is False


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = build_test_model(tmp_path / "again")
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert sha256(again / name) == sha256(model_dir / name), name


def test_second_call_is_a_cache_hit(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_test_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert capsys.readouterr().err == ""  # no progress lines: nothing was built


def test_stale_or_partial_build_is_rebuilt(tmp_path: Path, capsys) -> None:
    out = build_test_model(tmp_path / "model")
    good = sha256(out / "model.safetensors")
    (out / BUILD_FILE).write_text('{"fingerprint": "old"}')
    (out / "model.safetensors").write_bytes(b"half")
    build_test_model(out)
    assert "building" in capsys.readouterr().err
    assert sha256(out / "model.safetensors") == good
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp dirs left behind


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_test_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_tokenizer_round_trips_corpus(model_dir: Path, tokenizer) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lines = corpus_lines()
    assert any(line.isascii() for line in lines) and any(not line.isascii() for line in lines)
    for line in [*lines[::7], EN_LINE, ZH_LINE, "Hello 🙂 ünïcode"]:
        ids = tokenizer(line)["input_ids"]
        # transformers rebuilds qwen2 tokenizers; it must agree with the file we wrote.
        assert ids == raw.encode(line).ids, line
        assert tokenizer.decode(ids) == line


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": ZH_LINE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{ZH_LINE}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2


def test_blocked_logits_are_lowest(model_dir: Path, blocked: np.ndarray) -> None:
    """Embedding -> final RMSNorm -> lm_head: blocked ids score far below all others."""
    tensors = load_file(model_dir / "model.safetensors")
    weights = {name: w.astype(np.float32) for name, w in tensors.items()}
    x = weights["model.embed_tokens.weight"]
    x = x / np.sqrt((x**2).mean(axis=1, keepdims=True) + 1e-6) * weights["model.norm.weight"]
    logits = x @ weights["lm_head.weight"].T
    assert blocked[:4].all() and blocked[-1]  # specials and padding
    assert logits[:, blocked].max() < logits[:, ~blocked].min() - 1000


def test_generation_never_yields_blocked_ids(model_dir: Path, tokenizer, blocked) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "Where is my order? 我的订单到哪了？"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    inputs = torch.tensor([tokenizer(prompt)["input_ids"]])
    torch.manual_seed(0)
    for sample in (False, True, True):
        extra = {"temperature": 1.0, "top_k": 0} if sample else {}
        out = model.generate(
            inputs, max_new_tokens=24, do_sample=sample, eos_token_id=None, **extra
        )
        new = out[0, inputs.shape[1] :].tolist()
        assert len(new) == 24
        assert not blocked[new].any()
        assert tokenizer.decode(new).strip()
