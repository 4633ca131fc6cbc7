"""tidegate/logs.py: the JSON and text lines, the job context, the allow-list of fields,
uvicorn's access lines without query strings. No process: a handler on a StringIO."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tidegate import logs
from tidegate.settings import get_settings


@pytest.fixture
def capture() -> Iterator[tuple[io.StringIO, logging.Logger]]:
    """A logger whose lines go through the JSON formatter and context filter into a
    buffer, as setup_logging's handler does on stderr."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter(process="worker"))
    handler.addFilter(logs.ContextFilter("worker", job_tasks=["tidegate.generate"]))
    logger = logging.getLogger(f"tidegate.test.{id(out)}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield out, logger
    logger.removeHandler(handler)
    logs._process.clear()


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_line_carries_the_job_context_only_inside_it(capture: Any) -> None:
    out, log = capture
    logs.set_process_fields(worker="chat-test@host")
    with logs.job_context(job_id="j-1", lane="chat"):
        logs.bind(attempt=2)
        log.info("inside")
    log.info("after")
    inside, after = lines(out)
    assert inside["job_id"] == "j-1" and inside["lane"] == "chat" and inside["attempt"] == 2
    assert inside["worker"] == after["worker"] == "chat-test@host"
    assert (inside["level"], inside["logger"], inside["message"], inside["process"]) == (
        "INFO", log.name, "inside", "worker")
    assert list(inside)[0] == "ts"
    assert "job_id" not in after and "attempt" not in after


def test_the_context_is_per_thread(capture: Any) -> None:
    out, log = capture
    with logs.job_context(job_id="mine"):
        other = threading.Thread(target=log.info, args=("other thread",))
        other.start()
        other.join()
    assert "job_id" not in lines(out)[0]


def test_library_extras_never_leave_and_celery_task_lines_get_the_job(capture: Any) -> None:
    out, log = capture
    context = {"id": "task-1", "name": "tidegate.generate", "args": "SECRET PROMPT"}
    log.info("Task %(name)s[%(id)s] received", context, extra={"data": context})
    log.info("Task %(name)s[%(id)s] received", {**context, "name": "other.task"})
    job_line, other_line = lines(out)
    assert job_line["job_id"] == "task-1" and "SECRET" not in out.getvalue()
    assert "job_id" not in other_line
    assert set(job_line) <= logs.ALLOWED


def test_an_explicit_field_wins_over_the_context(capture: Any) -> None:
    out, log = capture
    with logs.job_context(job_id="outer"):
        log.info("webhook", extra={"job_id": "named"})
    assert lines(out)[0]["job_id"] == "named"


def test_unknown_context_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt"), logs.job_context(prompt="no"):
        pass


def test_access_lines_keep_the_path_and_name_the_job() -> None:
    job = "0b7f3c1e-2a4d-4c5e-9f60-1234567890ab"
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", f"/v1/jobs/{job}/events?q=hello", "1.1",
                                200), None)
    logs.AccessPaths(re.compile(r"^/v1/jobs/([0-9a-f-]{36})")).filter(record)
    assert record.getMessage() == f'127.0.0.1:5 - "GET /v1/jobs/{job}/events HTTP/1.1" 200'
    assert record.job_id == job  # type: ignore[attr-defined]


def _access(status: int, at: float) -> logging.LogRecord:
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("10.0.0.9:5", "POST", "/v1/jobs", "1.1", status), None)
    record.created = at
    return record


def test_a_flood_of_refused_requests_is_logged_a_few_lines_a_second_and_counted() -> None:
    quiet = logs.QuietRefusals(per_s=3)
    passed = [r for r in (_access(401 if n % 2 else 429, 1000.5) for n in range(50))
              if quiet.filter(r)]
    assert len(passed) == 3
    tenant = _access(202, 1000.6)
    assert quiet.filter(tenant), "an accepted request is always logged"
    next_second = _access(401, 1001.1)
    assert quiet.filter(next_second)
    assert next_second.getMessage().endswith(
        '"POST /v1/jobs HTTP/1.1" 401 (and 47 refused requests not logged before it)')


def test_text_for_a_person() -> None:
    settings = get_settings().model_copy(update={"log_format": "text"})
    config = logs.dict_config(settings, "api")
    assert config["formatters"]["tidegate"]["()"].endswith("TextFormatter")
    record = logging.LogRecord("tidegate.api", logging.WARNING, __file__, 1, "slow", (), None)
    logs.ContextFilter("api").filter(record)
    record.job_id = "j-2"
    line = logs.TextFormatter().format(record)
    assert line.endswith("WARNING api tidegate.api: slow [job_id=j-2]")


def test_json_when_asked_and_off_a_terminal() -> None:
    settings = get_settings()
    json_settings = settings.model_copy(update={"log_format": "json"})
    assert logs.wants_json(json_settings)
    config = logs.dict_config(json_settings, "worker", loggers={"vllm": "DEBUG"})
    assert config["loggers"]["vllm"] == {"level": "DEBUG", "handlers": [], "propagate": True}
    json.dumps(config)  # a file vLLM's engine core reads
