"""JSON as Python holds it after json.loads, and before json.dumps: the type of a body
that is built or passed on as plain data rather than as a model (an answer's body, the
parts of an event's data that go out as they came). One definition, for every layer.

A JSON value's arrays and objects are read-only here (Sequence, Mapping), so a list of
ints or a dict of strings is a JSON value as it is; a JSON object being built is a dict
(JSONObject)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

JSON: TypeAlias = "str | int | float | bool | None | Sequence[JSON] | Mapping[str, JSON]"
JSONObject: TypeAlias = "dict[str, JSON]"
