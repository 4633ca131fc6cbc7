"""The API's answers as typed models. Each keeps any field a newer server adds (extra
allowed), and reads like the dict it came from too (`job["status"]`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EventKind = Literal["started", "token", "done", "error"]
TERMINAL_KINDS = ("done", "error")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


class Accepted(_Answer):
    """POST /v1/jobs: the job made (or, `created` false, the one its idempotency key made)."""

    job_id: str
    status: str
    lane: str
    queue: str
    priority: int
    events_url: str
    created: bool


class Job(_Answer):
    """A job as the store holds it (GET /v1/jobs/{id})."""

    id: str
    lane: str
    status: str  # queued, running, done, error, cancelled, expired
    queue: str | None = None
    priority: int | None = None
    session_id: str | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    output_text: str | None = None
    enqueued_at: datetime | None = None
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    queue_wait_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    worker: str | None = None
    engine: str | None = None
    attempts: int = 0
    callback_url: str | None = None
    trace_id: str | None = None  # its OpenTelemetry trace, where the API traces

    @property
    def terminal(self) -> bool:
        return self.status in ("done", "error", "cancelled", "expired")


class Event(_Answer):
    """One event of a job's stream: `started` (seq 0), `token`..., then `done` or `error`;
    seqs are contiguous from 0, each delivered once."""

    job_id: str
    seq: int
    kind: EventKind
    text: str = ""  # token: the new text of this engine step
    token_ids: list[int] = Field(default_factory=list)
    data: dict[str, Any] = Field(default_factory=dict)  # started/done/error details

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS
