"""The model's tokenizer for the API, without importing transformers where it can.

Importing transformers costs seconds of CPU (2 s idle, 8 s and more on a loaded 2-core
machine), all of it holding the GIL the API's event loop needs; a restarted API then
delivers its event streams late. A checkpoint with a `tokenizer.json` (every fast
tokenizer's) is read here with the `tokenizers` library that transformers' fast
tokenizers wrap (0.1 s), and its chat template rendered with jinja2 the way transformers'
`apply_chat_template` does (its sandbox, trim/lstrip blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, the special tokens as
variables). A checkpoint without one falls back to transformers' AutoTokenizer.
tests/unit/test_tokenizer.py checks both agree on the test checkpoint.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from tidegate.jsontypes import JSONObject

if TYPE_CHECKING:
    from jinja2 import Template

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")


class Tokenizer(Protocol):
    """What the API uses of a tokenizer: FastTokenizer's, or transformers' own."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[JSONObject], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            tools: list[JSONObject] | None = None) -> str: ...


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer with `chat_template`, `apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)` and `encode(text, add_special_tokens=False)`."""
    folder = Path(path)
    if (folder / "tokenizer.json").is_file():
        return FastTokenizer(folder)
    from transformers import AutoTokenizer

    # transformers' own tokenizer: the same methods, with more arguments than these.
    return cast(Tokenizer, AutoTokenizer.from_pretrained(path))


class FastTokenizer:
    def __init__(self, folder: Path) -> None:
        import tokenizers

        self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        self.chat_template: str | None = _chat_template(folder, config)
        self._special: dict[str, object] = {name: _content(config.get(name))
                                            for name in SPECIAL_TOKENS}
        self._special["additional_special_tokens"] = [
            _content(t) for t in config.get("additional_special_tokens") or []]
        self._template: Template | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def apply_chat_template(self, messages: list[JSONObject], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            tools: list[JSONObject] | None = None) -> str:
        if tokenize:
            raise ValueError("FastTokenizer renders text only (tokenize=False)")
        if self._template is None:
            self._template = _compile(self.chat_template or "")
        return str(self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    body = json.loads(path.read_text(encoding="utf-8"))
    return body if isinstance(body, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The template transformers would use: chat_template.jinja, else the config's (a
    string, or a list of named ones where `default` is the one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _content(token: object) -> object:
    """A special token as the config holds it: a string, or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


def _compile(source: str) -> Template:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
