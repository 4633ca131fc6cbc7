"""Token events: what a consumer receives for one job, in order, each exactly once.

Kinds: ``started`` (seq 0), ``token`` (new text of one engine step), then one terminal
``done`` or ``error``. Sequence numbers are contiguous from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

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
        # Built by hand: asdict() deep-copies, and this runs once per token. orjson, not
        # json: 0.2 us against 4.4 us a call (bench/README.md, "fourth round"); the same
        # text as json.dumps(ensure_ascii=False, separators=(",", ":")).
        body = {"job_id": self.job_id, "seq": self.seq, "kind": self.kind, "text": self.text,
                "token_ids": self.token_ids, "data": self.data}
        return orjson.dumps(body).decode()

    def stream_fields(self) -> dict[str, str]:
        """The job stream entry: the event's JSON and, apart, its kind, so a reader can
        frame SSE without parsing the body (api/app.py)."""
        return {"e": self.to_json(), "k": self.kind}

    @classmethod
    def from_json(cls, raw: str | bytes) -> Event:
        body = orjson.loads(raw)
        return cls(**body)

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL
