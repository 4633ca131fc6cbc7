"""The OpenAI chat body's parts: a media part is refused naming its capability, and a part
whose `type` is no string (the fuzz run's `{"type": {}}`) is a 400, not a 500."""

from __future__ import annotations

import pytest

from api.errors import ApiError
from api.openai_api import parse_chat
from api.openai_routes import ignored_names


def _body(part: object) -> dict[str, object]:
    return {"model": "tidegate-test", "messages": [{"role": "user", "content": [part]}]}


@pytest.mark.parametrize("kind", [{}, [], 7, None])
def test_a_part_whose_type_is_no_string_is_a_400_naming_it(kind: object) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat(_body({"type": kind, "text": "hi"}))
    assert caught.value.status == 400
    assert caught.value.field.startswith("messages.0.content")


def test_an_image_part_names_the_capability_it_needs() -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat(_body({"type": "image_url", "image_url": {"url": "https://a.example/x.png"}}))
    assert caught.value.status == 400 and caught.value.field == "messages.0.content.0"
    assert "'vision' capability" in caught.value.message


def test_ignored_field_names_fit_in_a_header_whatever_they_hold() -> None:
    # The fuzz run's 500: a field name with a lone surrogate could not be sent as a header.
    names = ["mood", "\ud90a\udf84x", "a b\n", "x" * 100] + [f"f{i}" for i in range(20)]
    value = ignored_names(names)
    value.encode("ascii")  # a header's characters, none a control character
    assert all(32 <= ord(c) < 127 for c in value)
    listed = value.split(",")
    assert listed[0] == "mood" and listed[2] == "a%20b%0A" and len(listed[3]) == 64
    assert listed[-1] == "(+8 more)" and len(listed) == 17
