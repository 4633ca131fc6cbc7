"""A batch's lines submitted as jobs, as far as the batch's room allows
(`TIDEGATE_BATCH_IN_FLIGHT`, the lane's `batch_min_share`): the part of a batch's step
(api/batch_driver.py) that turns request lines into jobs through api/submit.py."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis
from sqlalchemy import exc as sa_exc

from api.auth import Tenant
from api.batch_lines import BatchInput, Line, line_error
from api.deps import Deps
from api.errors import ApiError
from api.openai_api import adapter_names, parse_chat, parse_completion, resolve
from api.openai_models import bad
from api.submit import lane_backlog, submit
from store import JobRecord
from store.batches import Batches, BatchRecord
from tidegate.lanes import Lane

log = logging.getLogger("tidegate.batches")

# What the system lacks right now, not what a batch did: retried, never a batch's failure.
OUTAGES: tuple[type[BaseException], ...] = (
    redis.RedisError, sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
    TimeoutError, ConnectionError)


class LineSubmitter:
    """Submits a batch's next lines (one driver's, as its batches' steps ask)."""

    def __init__(self, deps: Deps, batches: Batches) -> None:
        self.deps, self.batches, self.settings = deps, batches, deps.settings

    def submit_more(self, b: BatchRecord, tenant: Tenant, jobs: dict[int, JobRecord],
                    source_of: Callable[[BatchRecord], BatchInput]) -> BatchRecord:
        """Submit the next lines while the batch has room; stop at the lane's bounds."""
        errors = list(b.line_errors)
        refused = {e["line"] for e in errors}
        rooms = self._rooms([job for i, job in jobs.items()
                             if not job.terminal and i not in refused])
        if all(room <= 0 for room in rooms.values()) or b.submitted >= b.total:
            return b
        source, line_no, model = source_of(b), b.submitted, b.model
        while line_no < b.total:
            priority = next((p for p, room in rooms.items() if room > 0), -1)
            if priority == -1:
                break
            refusal = self._try_line(b, tenant, line_no, source, priority)
            if isinstance(refusal, str):  # submitted: its model
                rooms[priority] -= 1
                model = model or refusal
            elif refusal.status in (429, 503):  # the lane is full or down: later
                break
            else:
                errors.append(line_error(line_no, refusal.custom_id, refusal.error))
            line_no += 1
        if line_no == b.submitted:
            return b
        return self.batches.update_batch(b.id, submitted=line_no, line_errors=errors,
                                         model=model) or b

    def _rooms(self, running: list[JobRecord]) -> dict[int | None, int]:
        """The lines the batch may submit now, by the priority they get (None: the lane's
        own, behind the host's jobs), in the order they are used. With the lane's
        `batch_min_share`, a share of TIDEGATE_BATCH_IN_FLIGHT is kept for lines at the
        host lane's default priority, served in turn with the host's jobs; the others take
        spare capacity only: they are submitted while the host's queues are empty (a
        worker takes them at once), never into a backlog where they would starve."""
        cap = self.settings.batch_in_flight
        promotion = self._promotion()
        if promotion is None:
            return {None: cap - len(running)}
        lane, reserved, priority = promotion
        promoted = sum(1 for job in running if job.priority >= priority)
        promoted_room = reserved - promoted
        if sum(lane_backlog(self.deps, lane).values()) > 0:  # no spare capacity now
            return {priority: promoted_room}
        return {None: cap - reserved - (len(running) - promoted), priority: promoted_room}

    def _promotion(self) -> tuple[Lane, int, int] | None:
        """(the lane, slots kept for promoted lines, their priority), from the `flex`
        lane's `batch_min_share`; None when it has none (or runs on no host lane)."""
        lane = self.settings.lanes.get(self.settings.service_tiers.get("flex", ""))
        if lane is None or lane.runs_on is None or lane.batch_min_share <= 0:
            return None
        host = self.settings.lanes.get(lane.runs_on)
        if host is None or host.default_priority <= lane.default_priority:
            return None
        return (lane, math.ceil(lane.batch_min_share * self.settings.batch_in_flight),
                host.default_priority)

    def _try_line(self, b: BatchRecord, tenant: Tenant, line_no: int,
                  source: BatchInput, priority: int | None) -> _Refusal | str:
        """Submits one line; its refusal, or the model it named (submitted). An outage is
        raised: the line is tried again (its idempotency key finds a job a first try
        made)."""
        line = Line(None, None)
        try:
            line = source.line(line_no)
            return self._submit_line(b, tenant, line_no, line, priority)
        except ApiError as exc:
            return _Refusal(line.custom_id, exc)
        except OUTAGES:
            raise
        except Exception as exc:  # noqa: BLE001 - the line's fault or a bug: its error
            log.warning("batch %s: line %d raised %s; it is the line's error", b.id, line_no,
                        type(exc).__name__)
            return _Refusal(line.custom_id, ApiError(
                500, None, "the request could not be submitted (an internal error)",
                kind="server_error"))

    def _submit_line(self, b: BatchRecord, tenant: Tenant, line_no: int, line: Line,
                     priority: int | None) -> str:
        if line.error is not None or line.body is None:
            raise bad("line", line.error or "not a request")
        parse = parse_chat if b.endpoint == "/v1/chat/completions" else parse_completion
        req = parse(line.body)
        if req.stream:
            raise bad("stream", "a batch's requests do not stream")
        # A line's output is written from its job's row, which keeps choice 0's text alone.
        if (req.n or 1) > 1:
            raise bad("n", "a batch's request gives one choice (n: 1)")
        if req.logprobs_asked() is not None:
            raise bad("logprobs", "not in a batch: its output lines are written from the "
                      "jobs' rows, which keep no logprobs")
        if req.service_tier not in (None, "flex", "auto"):
            raise bad("service_tier", "a batch's requests run on the 'flex' tier")
        tiers = self.settings.service_tiers
        update: dict[str, Any] = {"service_tier": "flex" if "flex" in tiers else None,
                                  "idempotency_key": f"{b.id}:{line_no}"}
        if priority is not None:  # the lane's min share: the operator's grant, not the key's
            update["priority"] = priority
            tenant = replace(tenant, max_priority=max(priority, tenant.max_priority or 0))
        req = req.model_copy(update=update)
        submit(self.deps, tenant, resolve(self.settings, req, tenant.lanes,
                                          adapters=adapter_names(self.settings,
                                                                 self.deps.fleet())).job, None)
        return req.model


@dataclass(frozen=True)
class _Refusal:
    """Why a line was not submitted: its custom_id and the error its endpoint answers."""

    custom_id: str | None
    error: ApiError

    @property
    def status(self) -> int:
        return self.error.status
