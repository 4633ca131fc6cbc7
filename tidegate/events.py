"""Token events: what a consumer receives for one job, in order, each exactly once.

Kinds: ``started`` (seq 0), ``token`` (new text of one engine step), then one terminal
``done`` or ``error``. Sequence numbers are contiguous from 0.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Kind = Literal["started", "token", "done", "error"]
TERMINAL: frozenset[str] = frozenset({"done", "error"})


@dataclass(frozen=True)
class Event:
    job_id: str
    seq: int  # contiguous from 0; equals the SSE id
    kind: Kind
    text: str = ""  # token: the new text of this step
    token_ids: list[int] = field(default_factory=list)  # token: ids of this step (resume)
    data: dict[str, Any] = field(default_factory=dict)  # started/done/error details

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Event:
        body = json.loads(raw)
        return cls(**body)

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL
