"""Logs (issue 14): every line that tidegate's processes write is one JSON object; every
line about a job carries its `job_id`; a worker's lines about a job carry its lane, the
worker and the attempt too; no prompt or output text anywhere.

Read from the log files of the session's stack (the API, and each worker with its vLLM
engine core), which hold what earlier tests of the session made them write as well, and
of a scheduler (Celery worker with its embedded beat) started and stopped here.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tidegate_client import Client

from tests.helpers import Stack, reconciling_scheduler
from tidegate_tools.procs import Proc, wait_until

LANE = "finance"  # its max_tokens allows jobs long enough to expire or cancel


# The only lines that are no JSON: what vLLM's engine core, a process the worker spawns,
# writes at its `import vllm` on the CPU build, before vLLM applies the worker's logging
# config (a spawned process runs no tidegate code before that import). A warning's
# second line is its source line, indented.
BEFORE_ENGINE_LOGGING = re.compile(
    r"^(Triton is installed, but doesn't include CPU backend\. Disabling Triton\.$"
    r"|\S+/vllm/triton_utils/dispatcher\.py:\d+: FutureWarning: `torch\.distributed\.reduce_op`"
    r" is deprecated)")


def records(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The file's lines as JSON objects, and the lines that are none (with their place)."""
    found: list[dict[str, Any]] = []
    bad: list[str] = []
    after_warning = False
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip() or (after_warning and line.startswith("  ")):
            after_warning = False
            continue
        after_warning = BEFORE_ENGINE_LOGGING.match(line) is not None
        if after_warning:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "level" in record and "message" in record:
            found.append(record)
        else:
            bad.append(f"{path.name}:{n}: {line[:160]}")
    return found, bad


def about(record: dict[str, Any], job_ids: list[str]) -> str | None:
    """The job a line mentions, in its message or any field."""
    text = json.dumps(record)
    return next((j for j in job_ids if j in text), None)


@pytest.fixture
def scheduler(stack: Stack, tmp_root: Path) -> Iterator[Proc]:
    """A scheduler whose tick never comes (it would steer the session's workers); its
    reconciler runs every half second."""
    with reconciling_scheduler(stack, tmp_root / "logs" / "scheduler-logs.log") as proc:
        yield proc


def run_jobs(stack: Stack, mark: str) -> dict[str, str]:
    """A job that ends done, one that expires, one cancelled: id -> how it ended."""
    ends: dict[str, str] = {}
    with Client(stack.base_url, stack.api_key) as client:
        done = client.submit(LANE, prompt=f"Write about parcel {mark}.", max_tokens=200,
                             seed=5)["job_id"]
        expired = client.submit(LANE, prompt=f"Parcel {mark} again.", max_tokens=1800,
                                deadline_s=0.5)["job_id"]
        cancelled = client.submit(LANE, prompt=f"Parcel {mark} once more.",
                                  max_tokens=1800)["job_id"]
        client.cancel(cancelled)
        for job_id in (done, expired, cancelled):
            ends[job_id] = list(client.stream(job_id))[-1].kind
    assert ends[done] == "done"
    return ends


def test_every_line_is_json_and_names_its_job(stack: Stack, scheduler: Proc) -> None:
    mark = f"logmark{uuid.uuid4().hex}"
    ends = run_jobs(stack, mark)
    job_ids = list(ends)
    done = job_ids[0]
    row = stack.store.jobs.get_job(done)
    assert row is not None and row.output_text
    api = next(p for p in stack.procs if p.name.startswith("api"))
    worker = next(p for p in stack.procs if p.name == f"worker:{stack.workers[LANE]}")

    def worker_line_of_done_job() -> dict[str, Any] | None:
        return next((r for r in records(worker.log_path)[0]
                     if r.get("job_id") == done and r.get("attempt")), None)

    # Celery's "succeeded" line comes a moment after the job's last event.
    wait_until(lambda: worker_line_of_done_job() is not None, 30,
               "a worker line of the done job with its attempt", stack.procs)
    scheduler.stop()  # its shutdown lines too

    files = [p.log_path for p in stack.procs if not p.name.startswith("redis")]
    files.append(scheduler.log_path)
    by_file = {path: records(path) for path in files}
    bad = [line for _, (_, lines) in by_file.items() for line in lines]
    assert not bad, "lines that are no JSON log record:\n" + "\n".join(bad[:20])

    unnamed = [(path.name, r) for path, (found, _) in by_file.items() for r in found
               if (j := about(r, job_ids)) is not None and r.get("job_id") != j]
    assert not unnamed, f"lines about a job without its job_id: {unnamed[:5]}"

    api_lines = [r for r in by_file[api.log_path][0] if r.get("job_id") in job_ids]
    assert {r["job_id"] for r in api_lines} == set(job_ids), "an API line per job"
    assert all(r["process"] == "api" and r["lane"] == LANE for r in api_lines
               if r["logger"].startswith("tidegate"))
    line = worker_line_of_done_job()
    assert line is not None and line["process"] == "worker"
    assert (line["lane"], line["worker"], line["attempt"]) == (LANE, stack.workers[LANE], 1)
    # Celery's line for each task received is off at INFO (workers/service.py); its
    # "succeeded" line stays.
    about_done = [r["message"] for r in by_file[worker.log_path][0] if r.get("job_id") == done]
    assert any(" succeeded in " in m for m in about_done), about_done
    assert not any(m.endswith(" received") for m in about_done), about_done
    assert {r["process"] for r in by_file[scheduler.log_path][0]} == {"scheduler"}

    texts = [mark] + ([row.output_text] if len(row.output_text) >= 32 else [])
    leaks = [(path.name, text[:20]) for path in files for text in texts
             if text in path.read_text(errors="replace")]
    assert not leaks, f"prompt or output text in the logs: {leaks}"
