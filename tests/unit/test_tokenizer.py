"""The API's own tokenizer (api/tokenizer.py) agrees with transformers' on the test
checkpoint: the same chat rendering and the same token counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.tokenizer import FastTokenizer, load_tokenizer

CHATS = [
    [{"role": "user", "content": "Where is my refund for order 58213?"}],
    [{"role": "system", "content": "You answer in one short paragraph."},
     {"role": "user", "content": "Und die Rechnung? 請盡快回覆 🙂"},
     {"role": "assistant", "content": "It was sent on Monday."},
     {"role": "user", "content": "  spaces\tand\nnewlines  "}],
]


@pytest.fixture(scope="module")
def both(model_path: Path) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    return load_tokenizer(str(model_path)), AutoTokenizer.from_pretrained(str(model_path))


def test_the_test_checkpoint_loads_without_transformers(model_path: Path) -> None:
    assert isinstance(load_tokenizer(str(model_path)), FastTokenizer)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation", [True, False])
def test_chat_rendering_matches_transformers(both: tuple[Any, Any], chat: list[dict[str, str]],
                                             generation: bool) -> None:
    ours, theirs = both
    assert ours.chat_template == theirs.chat_template
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)


@pytest.mark.parametrize("text", ["", "refund", " Where is my refund?", "<|im_start|>user\nhi",
                                  "Ünïcödé ✓ 🙂 請", "a\n\n\tb  c"])
def test_token_counts_match_transformers(both: tuple[Any, Any], text: str) -> None:
    ours, theirs = both
    assert ours.encode(text, add_special_tokens=False) == \
        theirs.encode(text, add_special_tokens=False)


def test_a_template_can_raise_and_use_the_special_tokens(tmp_path: Path,
                                                         model_path: Path) -> None:
    import json
    import shutil

    import jinja2

    shutil.copy(model_path / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}{{ eos_token }}{{ messages | tojson }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": template}],
         "eos_token": {"content": "<|endoftext|>"}}))
    tok = load_tokenizer(str(tmp_path))
    chat = [{"role": "user", "content": "é"}]
    assert tok.apply_chat_template(chat) == '<|endoftext|>[{"role": "user", "content": "é"}]'
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
