"""JSON as Python holds it after json.loads, and before json.dumps: the type of a body
that is built or read as plain data rather than as a model (an answer's body, an event's
data). One definition, for every layer."""

from __future__ import annotations

from typing import TypeAlias

# A JSON value; a list or an object holds JSON values.
JSON: TypeAlias = "str | int | float | bool | None | list[JSON] | dict[str, JSON]"
JSONObject: TypeAlias = "dict[str, JSON]"  # a JSON object, as built for an answer's body
