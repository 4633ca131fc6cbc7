"""One log format for every tidegate process (API, workers, scheduler, webhooks, Flower).

`setup_logging(settings, process)` puts one handler on the root logger: JSON, one object
a line, or text for a person ("auto": text on a terminal, JSON
otherwise; `TIDEGATE_LOG_FORMAT`, `TIDEGATE_LOG_LEVEL`). Every line carries `ts`, `level`,
`logger`, `message`, `process` (its kind: api, worker, ...) and, when known, the context
fields of FIELDS:

    job_id    the job a line is about (`job_context` around a job's work; Celery's own
              task lines about a job task get it from their task id)
    lane      the job's lane
    worker    the worker's name, set once per worker process (`set_process_fields`)
    attempt   the job's attempt (its claim count in the store)
    trace_id  the current OpenTelemetry trace, 32 hex digits, when a span is current

Only these fields leave the process: a library's `extra=` (Celery's task lines carry
the task's arguments in theirs) is dropped, so no prompt or output text rides along.
Messages themselves carry ids and counts, never text (the rule of every logger here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import re
import sys
import threading
from collections.abc import Collection, Iterator, Mapping
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, TypedDict, Unpack, cast

from tidegate.settings import Settings

FIELDS = ("job_id", "lane", "worker", "attempt", "trace_id")
LogValue = str | int  # a context field's value: an id, a name or a count


class LogFields(TypedDict, total=False):
    """The context fields a caller may set (FIELDS; None: not known, left out)."""

    job_id: str | None
    lane: str | None
    worker: str | None
    attempt: int | None
    trace_id: str | None


# What a JSON line may hold: the record's own fields (renamed) and the context fields.
ALLOWED = frozenset({"ts", "level", "logger", "message", "process", "exc_info", "stack_info",
                     *FIELDS})  # JsonFormatter writes these and no others
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(process_kind)s %(name)s: %(message)s%(context)s"

# Never mutated: each change sets a new mapping, so a reset restores the one before.
_job: ContextVar[Mapping[str, LogValue]] = ContextVar("tidegate_log_context",
                                                      default=MappingProxyType({}))
_process: dict[str, LogValue] = {}  # fields of the whole process (the worker's name)


@contextlib.contextmanager
def job_context(**fields: Unpack[LogFields]) -> Iterator[None]:
    """Every line logged inside (in this thread or task) carries these fields."""
    token = open_context(**fields)
    try:
        yield
    finally:
        close_context(token)


def open_context(**fields: Unpack[LogFields]) -> Token[Mapping[str, LogValue]]:
    """`job_context` in two calls, for hooks with a start and an end (Celery's task_prerun
    and task_postrun, in the task's thread); `close_context` with the token ends it."""
    return _job.set({**_job.get(), **_known(fields)})


def close_context(token: Token[Mapping[str, LogValue]]) -> None:
    _job.reset(token)


def bind(**fields: Unpack[LogFields]) -> None:
    """Adds fields to the current job context (the attempt, once the job is claimed); they
    last until the enclosing `job_context` ends."""
    _job.set({**_job.get(), **_known(fields)})


def set_process_fields(**fields: Unpack[LogFields]) -> None:
    """Fields every line of this process carries (a worker's name)."""
    _process.update(_known(fields))


def _known(fields: Mapping[str, object]) -> dict[str, LogValue]:
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown log context fields {sorted(unknown)}; known: {FIELDS}")
    return {k: cast(LogValue, v) for k, v in fields.items() if v is not None}


def current_trace_id() -> str | None:
    """The current OpenTelemetry span's trace id (None without a valid span, or without
    opentelemetry). Tracing itself is configured elsewhere; this only reads it."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class ContextFilter(logging.Filter):
    """Puts the process kind and the context fields on every record a handler writes.
    A field the caller passed in `extra=` wins. `job_tasks`: Celery task names whose task
    id is a job id; Celery's lines about those tasks (received, succeeded, failed) pass
    the task's id and name as their format arguments."""

    def __init__(self, process: str = "", job_tasks: Collection[str] = (),
                 worker: str | None = None) -> None:
        super().__init__()
        self.process, self.job_tasks = process, frozenset(job_tasks)
        if worker:  # a child process configured from a file (vLLM's engine core)
            set_process_fields(worker=worker)

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_kind = self.process
        fields: dict[str, object] = {**_process, **_job.get()}
        trace_id = current_trace_id()
        if trace_id:
            fields["trace_id"] = trace_id
        args = record.args
        if isinstance(args, Mapping) and args.get("name") in self.job_tasks and "id" in args:
            fields.setdefault("job_id", args["id"])
        for name, value in fields.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class AccessPaths(logging.Filter):
    """For uvicorn's access log: the request's path without its query string (a query can
    carry text), and the job a path names as `job_id`. uvicorn passes (client, method,
    path with query, HTTP version, status) as the record's arguments."""

    def __init__(self, job_path: re.Pattern[str] | None = None) -> None:
        super().__init__()
        self.job_path = job_path

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            path = args[2].partition("?")[0]
            record.args = (*args[:2], path, *args[3:])
            found = self.job_path.search(path) if self.job_path else None
            if found and not hasattr(record, "job_id"):
                record.job_id = found.group(1)
        return True


class QuietRefusals(logging.Filter):
    """For the API's access lines: at most `per_s` lines a second of requests refused 401
    or 429, the next one passed saying how many were left out. A flood of strangers (each
    refused at the front door, api/frontgate.py) would otherwise cost the API a log line
    per request, its largest part of their cost, and fill the disk every tenant's lines
    share; tidegate_requests_rejected_total still counts every one. api/server.py asks
    `admit` before it builds a line (a record left out costs its making); as a filter it
    does the same for a record already made."""

    QUIET = frozenset({401, 429})
    LEFT_OUT = " (and %d refused requests not logged before it)"

    def __init__(self, per_s: int = 10) -> None:
        super().__init__()
        self.per_s = per_s
        self._second, self._passed, self._left_out = 0, 0, 0
        self._lock = threading.Lock()

    def admit(self, status: int, now: float) -> int | None:
        """None: leave this line out; else how many were left out before it."""
        if status not in self.QUIET:
            return 0
        second = int(now)
        with self._lock:
            if second != self._second:
                self._second, self._passed = second, 0
            if self._passed >= self.per_s:
                self._left_out += 1
                return None
            self._passed += 1
            left_out, self._left_out = self._left_out, 0
        return left_out

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5 and isinstance(args[4], int)):
            return True
        left_out = self.admit(args[4], record.created)
        if left_out is None:
            return False
        if left_out:
            record.msg = f"{record.msg}{self.LEFT_OUT}"
            record.args = (*args, left_out)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: the record's time, level, logger and message, the process
    kind, and the context fields; nothing else of the record.

    Written by hand on a measured hot path: the API logs three lines a job (its own and
    uvicorn's two access lines) and a worker two (Celery's), and python-json-logger's
    formatter, which gathers every attribute of the record, then drops all but these, took
    a twentieth of the API's CPU per submit (bench/README.md). Its output was the same."""

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.process:
            line["process"] = self.process
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


# What a request can carry into a line (a path decoded from %0a or %0d, a header): the C0
# and C1 controls, DEL and Unicode's line and paragraph separators.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """`text` with each control character written as its Python escape (\\n, \\x1b)."""
    return CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


class TextFormatter(logging.Formatter):
    """For a person at a terminal: the context fields follow the message as key=value.
    One record is one line: control characters in the message or the fields are escaped,
    so no request can forge a line. A traceback, which follows, keeps its own lines."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "process_kind"):
            record.process_kind = "-"
        pairs = [f"{f}={getattr(record, f)}" for f in FIELDS if getattr(record, f, None)]
        record.context = f" [{' '.join(pairs)}]" if pairs else ""
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return escape_controls(super().formatMessage(record))


def wants_json(settings: Settings) -> bool:
    if settings.log_format == "auto":
        return not sys.stderr.isatty()
    return settings.log_format == "json"


def dict_config(settings: Settings, process: str, job_tasks: Collection[str] = (),
                loggers: Mapping[str, Any] | None = None) -> dict[str, object]:
    """A `logging.config.dictConfig` of the one format: its handler on the root logger,
    and `loggers` (name -> level, or a logger config) sent through the root with no
    handler of their own (uvicorn's, Celery's). Written to a file, it configures child
    processes too (vLLM's engine core: workers/service.py)."""
    formatter: dict[str, Any] = {"()": f"{__name__}.TextFormatter"}
    if wants_json(settings):
        formatter = {"()": f"{__name__}.JsonFormatter", "process": process}
    context: dict[str, Any] = {"()": f"{__name__}.ContextFilter", "process": process,
                               "job_tasks": sorted(job_tasks)}
    if _process.get("worker"):
        context["worker"] = _process["worker"]
    named: dict[str, dict[str, Any]] = {
        name: {"handlers": [], "propagate": True,
               **({"level": v} if isinstance(v, str) else v)}
        for name, v in (loggers or {}).items()}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tidegate": formatter},
        "filters": {"context": context},
        "handlers": {"tidegate": {"class": "logging.StreamHandler", "formatter": "tidegate",
                                  "filters": ["context"], "stream": "ext://sys.stderr"}},
        "root": {"level": settings.log_level.upper(), "handlers": ["tidegate"]},
        "loggers": named,
    }


def setup_logging(settings: Settings, process: str, job_tasks: Collection[str] = (),
                  loggers: Mapping[str, Any] | None = None) -> None:
    """This process's logging: the one handler on the root logger, Python warnings
    logged through it. Call it once, early, before libraries log."""
    logging.config.dictConfig(dict_config(settings, process, job_tasks, loggers))
    logging.captureWarnings(True)
