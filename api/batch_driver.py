"""The Batch API's driver, `tidegate batches`: a process of its own that advances each open
batch (api/batches.py holds the routes, api/batch_lines.py the lines and files,
api/batch_submit.py their submission as jobs).

A batch's state is its row in the store (store/batches.py), so any driver can pick it up.
One driver process at a time drives: it holds `keys.batch_driver_lock` (tidegate/locks.py,
a token and a TTL, extended before every batch it steps); a second one waits, and takes
over within `TIDEGATE_BATCH_DRIVER_LOCK_S` of the holder's death. The driver keeps at most
`TIDEGATE_BATCH_IN_FLIGHT` of a batch's jobs queued or running, and backs off when the
lane's bounds answer 429 or 503: a batch waits in the store, never in Redis.

Each line and each batch is its own unit of failure: whatever a line holds, it becomes
that line's error; whatever one batch's step raises is that batch's (it ends `failed`
after `TIDEGATE_BATCH_STEP_FAILURES` in a row); the loop goes on to the next batch. An
outage (Redis or the database not answering) is no batch's fault: it is retried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections import OrderedDict

from api.auth import Tenant
from api.batch_lines import BatchInput, batch_usage, build_files
from api.batch_submit import OUTAGES, LineSubmitter
from api.deps import Deps, cancel
from api.files import request_lines
from store import JobRecord, utcnow
from store.batches import Batches, BatchRecord
from tidegate import keys
from tidegate.locks import RedisLock, new_token
from tidegate.records import BatchStatus, JobStatus
from tidegate.settings import Settings

log = logging.getLogger("tidegate.batches")

OUTAGES_PER_PASS = 3  # outages in a row end a pass early: the backend is down, not a batch


class BatchBroken(Exception):
    """The batch cannot go on (its input file is gone or changed): it ends `failed` now."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Driver:
    """Advances every open batch, one pass every `batch_poll_s`, while it holds the lock."""

    def __init__(self, deps: Deps, batches: Batches) -> None:
        self.deps, self.batches = deps, batches
        self.settings: Settings = deps.settings
        self.redis = deps.sync_redis
        # Input files read, by batch: the least recently used goes first.
        self._inputs: OrderedDict[str, BatchInput] = OrderedDict()
        self._failures: dict[str, int] = {}  # batch -> its steps that raised, in a row
        self.lines = LineSubmitter(deps, batches)
        self.lock = RedisLock(self.redis, keys.batch_driver_lock(self.settings.namespace),
                              self.settings.batch_driver_lock_s,
                              token=new_token(f"batches@{socket.gethostname()}:{os.getpid()}"))

    @property
    def cached_files(self) -> list[str]:
        """The batches whose input file this driver keeps read, least recent first."""
        return list(self._inputs)

    # -- the loop ------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Drives the open batches while this driver holds the lock, waits for the lock
        while another does; returns once `stop` is set, the lock released."""
        try:
            while not stop.is_set():
                if self.lock.held or self._take():
                    self._pass_safely(stop)
                stop.wait(self.settings.batch_poll_s)
        finally:
            if self.lock.held:
                with contextlib.suppress(*OUTAGES):  # it lapses by itself
                    self.lock.release()

    def _take(self) -> bool:
        try:
            taken = self.lock.acquire()
        except OUTAGES as exc:
            log.warning("batch driver: cannot reach Redis for the lock (%s)", type(exc).__name__)
            return False
        if taken:
            log.info("batch driver: holding the lock (%s)", self.lock.token)
        return taken

    def _pass_safely(self, stop: threading.Event) -> None:
        try:
            self.pass_once(stop)
        except Exception as exc:  # an outage: the next pass tries again
            log.warning("batch driver: pass failed (%s)", type(exc).__name__)

    def pass_once(self, stop: threading.Event | None = None) -> None:
        outages = 0
        for batch in self.batches.open_batches():
            if (stop is not None and stop.is_set()) or not self._still_held():
                return
            if self._step_safely(batch):
                outages = 0
            else:
                outages += 1
                if outages >= OUTAGES_PER_PASS:
                    return

    def _still_held(self) -> bool:
        """Extends the lock; False (and this driver stops driving) when another took it."""
        if self.lock.extend():
            return True
        log.warning("batch driver: the lock was lost (%s); waiting to take it again",
                    self.lock.token)
        return False

    def _step_safely(self, b: BatchRecord) -> bool:
        """One batch's step, whatever it raises; False on an outage."""
        try:
            with RedisLock(self.redis, keys.batch_lock(self.settings.namespace, b.id),
                           keys.BATCH_LOCK_S) as held:
                if held:
                    self.step(b)
        except OUTAGES as exc:
            log.warning("batch %s: outage during its step (%s)", b.id, type(exc).__name__)
            return False
        except BatchBroken as exc:
            self._fail(b, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - one batch's fault, never the loop's
            self._step_failed(b, exc)
        else:
            self._failures.pop(b.id, None)
        return True

    def _step_failed(self, b: BatchRecord, exc: Exception) -> None:
        # The type only: an exception's text may quote a prompt.
        count = self._failures.get(b.id, 0) + 1
        self._failures[b.id] = count
        limit = self.settings.batch_step_failures
        log.warning("batch %s: its step failed (%s), %d of %d in a row", b.id,
                    type(exc).__name__, count, limit)
        if count >= limit:
            self._fail(b, "batch_failed", f"the batch could not be advanced: its step failed "
                       f"{count} times in a row ({type(exc).__name__})")

    def _fail(self, b: BatchRecord, code: str, message: str) -> None:
        """Ends the batch `failed` with `message`, its unended jobs cancelled."""
        self._failures.pop(b.id, None)
        self._inputs.pop(b.id, None)
        try:
            for job in self.batches.line_jobs(b.tenant_id, b.id, b.submitted).values():
                if not job.terminal:
                    cancel(self.deps, job.id, b.tenant_id)
            self.batches.end_batch(b.id, BatchStatus.FAILED, failed_at=utcnow(), errors=[
                {"code": code, "message": message, "param": None, "line": None}])
            log.warning("batch %s: failed (%s)", b.id, code)
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            log.warning("batch %s: could not be ended failed (%s)", b.id, type(exc).__name__)

    # -- one batch's step ----------------------------------------------------------

    def step(self, b: BatchRecord) -> None:
        tenant = self._tenant(b)
        if tenant is None:
            self._end(b, BatchStatus.FAILED, failed_at=utcnow(), errors=[
                {"code": "tenant_revoked", "message": "the batch's API key was revoked",
                 "param": None, "line": None}])
            return
        if b.status == BatchStatus.VALIDATING:
            b = self.batches.update_batch(b.id, expect=(BatchStatus.VALIDATING,),
                                          status=BatchStatus.IN_PROGRESS,
                                          in_progress_at=utcnow()) or b
        jobs = self.batches.line_jobs(b.tenant_id, b.id, b.submitted)
        if (b.status == BatchStatus.IN_PROGRESS and utcnow() >= b.expires_at
                and not all_ended(b, jobs)):
            b = self.batches.update_batch(b.id, expect=(BatchStatus.IN_PROGRESS,),
                                          status=BatchStatus.CANCELLING,
                                          cancelling_at=utcnow(), expired_at=utcnow()) or b
        if b.status == BatchStatus.IN_PROGRESS:
            b = self.lines.submit_more(b, tenant, jobs, self.source)
            jobs = self.batches.line_jobs(b.tenant_id, b.id, b.submitted)
        elif b.status == BatchStatus.CANCELLING:
            self._cancel_jobs(b, jobs)
        self._progress(b, jobs)

    def _tenant(self, b: BatchRecord) -> Tenant | None:
        record = self.batches.tenant(b.tenant_id)
        if record is None:
            return None
        # No webhook_url: the lines' jobs send no `job.ended` to the tenant's default URL
        # (a webhook a line); the batch's end sends one `batch.*` event (end_batch).
        return Tenant(id=record.id, name=record.name, lanes=frozenset(record.lanes),
                      requests_per_minute=record.requests_per_minute,
                      tokens_per_minute=record.tokens_per_minute,
                      webhook_url=None, max_priority=record.max_priority)

    def source(self, b: BatchRecord) -> BatchInput:
        """The batch's input lines, read once while it stays among the recent few."""
        found = self._inputs.get(b.id)
        if found is not None:
            self._inputs.move_to_end(b.id)
            return found
        text = self.batches.file_content(b.input_file_id, b.tenant_id)
        if text is None:
            raise BatchBroken("input_file_missing", f"the input file {b.input_file_id} is gone")
        found = BatchInput(request_lines(text), b.endpoint)
        if len(found) != b.total:
            raise BatchBroken("input_file_changed", f"the input file holds {len(found)} "
                              f"request lines, the batch was created with {b.total}")
        self._inputs[b.id] = found
        while len(self._inputs) > self.settings.batch_cache_files:
            self._inputs.popitem(last=False)
        return found

    def _cancel_jobs(self, b: BatchRecord, jobs: dict[int, JobRecord]) -> None:
        for job in jobs.values():
            if not job.terminal:
                cancel(self.deps, job.id, b.tenant_id)

    def _progress(self, b: BatchRecord, jobs: dict[int, JobRecord]) -> None:
        refused = {e["line"] for e in b.line_errors}
        done = sum(1 for job in jobs.values() if job.status == JobStatus.DONE)
        failed = len(refused) + sum(1 for i, job in jobs.items()
                                    if job.terminal and job.status != JobStatus.DONE
                                    and i not in refused)
        ended = done + failed == b.submitted and (
            b.status == BatchStatus.CANCELLING or b.submitted == b.total)
        if not ended:
            if (done, failed) != (b.completed, b.failed):
                self.batches.update_batch(b.id, completed=done, failed=failed,
                                          usage=batch_usage(jobs))
            return
        self._finish(b, jobs, done, failed)

    def _finish(self, b: BatchRecord, jobs: dict[int, JobRecord], done: int,
                failed: int) -> None:
        if b.status == BatchStatus.CANCELLING:  # the lines never submitted: in the error file
            failed = b.total - done
        b = self.batches.update_batch(b.id, finalizing_at=utcnow(), completed=done,
                                      failed=failed, usage=batch_usage(jobs)) or b
        output, errors = build_files(b, self.source(b), jobs)
        expiry = b.output_expires_after_s  # the files' lifetime (output_expires_after)
        out_file = self.batches.create_file(b.tenant_id, "batch_output", f"{b.id}_output.jsonl",
                                            output, expiry) if output else None
        err_file = self.batches.create_file(b.tenant_id, "batch_output", f"{b.id}_errors.jsonl",
                                            errors, expiry) if errors else None
        if b.status == BatchStatus.CANCELLING:
            final = ((BatchStatus.EXPIRED, "expired_at") if b.expired_at
                     else (BatchStatus.CANCELLED, "cancelled_at"))
        else:
            final = (BatchStatus.COMPLETED, "completed_at")
        self._end(b, final[0], **{final[1]: utcnow()},
                  output_file_id=out_file.id if out_file else None,
                  error_file_id=err_file.id if err_file else None)

    def _end(self, b: BatchRecord, status: BatchStatus, **values: object) -> None:
        self.batches.end_batch(b.id, status, **values)
        self._inputs.pop(b.id, None)
        log.info("batch %s: %s (%d lines)", b.id, status, b.total)


def run_driver(settings: Settings, stop: threading.Event) -> None:
    """`tidegate batches` (and the tests' in-process driver): drives batches until `stop`."""
    deps = Deps(settings)
    try:
        Driver(deps, Batches(deps.store)).run(stop)
    finally:
        deps.admission.close()
        deps.sync_redis.close()


def all_ended(b: BatchRecord, jobs: dict[int, JobRecord]) -> bool:
    """Every line was sent and has ended: a batch that finished inside its window but is
    seen past it ends `completed`, not `expired` with nothing expired."""
    refused = {e["line"] for e in b.line_errors}
    return b.submitted >= b.total and all(
        job.terminal for i, job in jobs.items() if i not in refused)
