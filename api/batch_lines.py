"""A batch's input lines, parsed one at a time when the driver needs them, and the output
and error files it writes at the end (api/batch_driver.py runs the batch).

A line is parsed when a step submits it (and again, without keeping it, when the batch's
files are written): the driver holds a few input files' raw lines, never every open
batch's parsed requests. Nothing a line holds can raise out of here: a line that is not a
request is a Line with its error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from api.errors import ApiError
from api.openai_answers import Answer, done_of, error_body, job_error
from api.openai_api import parse_chat, parse_completion
from store import JobRecord
from store.batches import BatchRecord
from tidegate.jsontypes import JSONObject
from tidegate.records import JobStatus

_NOT_JSON = object()


@dataclass(frozen=True)
class Line:
    """One input line: its custom_id, its request's body, or why it is no request."""

    custom_id: str | None
    body: dict[str, Any] | None
    error: str | None = None


class BatchInput:
    """A batch's input file as its raw request lines; `line(i)` parses line i.

    A custom_id used by an earlier line makes a later line an error, so parsing line i
    needs the custom_ids of the lines before it: they are read once, as far as asked, and
    kept (ids only, not the requests)."""

    def __init__(self, raw: list[str], endpoint: str) -> None:
        self.raw, self.endpoint = raw, endpoint
        self._first: dict[str, int] = {}  # custom_id -> the first line that used it
        self._scanned = 0  # the lines before this one have their custom_id in _first

    def __len__(self) -> int:
        return len(self.raw)

    def line(self, i: int) -> Line:
        self._scan_to(i)
        item = _item(self.raw[i])
        if self._scanned == i:
            self._note(_custom_id(item), i)
        return _line(item, self.endpoint, self._first, i)

    def _scan_to(self, i: int) -> None:
        while self._scanned < i:
            self._note(_custom_id(_item(self.raw[self._scanned])), self._scanned)

    def _note(self, custom_id: str | None, i: int) -> None:
        if custom_id is not None:
            self._first.setdefault(custom_id, i)
        self._scanned = i + 1


def parse_lines(raw: list[str], endpoint: str) -> list[Line]:
    """Every line parsed (what the driver does a line at a time)."""
    source = BatchInput(raw, endpoint)
    return [source.line(i) for i in range(len(source))]


def _item(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        return _NOT_JSON


def _custom_id(item: object) -> str | None:
    """The line's custom_id, when the line claims one (an object with a non-empty one)."""
    if not isinstance(item, dict):
        return None
    custom_id = item.get("custom_id")
    return custom_id if isinstance(custom_id, str) and custom_id else None


def _line(item: object, endpoint: str, first: dict[str, int], i: int) -> Line:
    if item is _NOT_JSON:
        return Line(None, None, "not valid JSON")
    if not isinstance(item, dict):
        return Line(None, None, "not a JSON object")
    custom_id = _custom_id(item)
    if custom_id is None:
        return Line(None, None, "custom_id: a non-empty string is required")
    if first.get(custom_id, i) < i:
        return Line(custom_id, None, f"custom_id: {custom_id!r} is used by an earlier line")
    if item.get("method") != "POST":
        return Line(custom_id, None, "method: must be 'POST'")
    if item.get("url") != endpoint:
        return Line(custom_id, None, f"url: must be the batch's endpoint, {endpoint}")
    body = item.get("body")
    if not isinstance(body, dict):
        return Line(custom_id, None, "body: a JSON object is required")
    return Line(custom_id, body)


def line_error(line_no: int, custom_id: str | None, exc: ApiError) -> JSONObject:
    """A refused line as the batch row keeps it (`line_errors`)."""
    status, body = error_body(exc)
    return {"line": line_no, "custom_id": custom_id, "status_code": status, "body": body}


def build_files(b: BatchRecord, source: BatchInput,
                jobs: dict[int, JobRecord]) -> tuple[str, str]:
    """The output file (a line per request answered) and the error file (a line for every
    other input line), in OpenAI's line format: every input line has exactly one line in
    one of them, matched by its `custom_id`, lines never submitted included.

    A line refused, or whose job failed, has the `response` its endpoint would have
    answered (`error: null`); a line the batch's cancel or expiry stopped, before it ran
    or while it ran, has `response: null` and `error.code` `batch_cancelled` or
    `batch_expired`, as OpenAI writes them."""
    output: list[JSONObject] = []
    errors: list[JSONObject] = []
    refused = {e["line"]: e for e in b.line_errors}
    stopped = _stopped_error(b)
    for i in range(b.total):
        job = jobs.get(i) if i < b.submitted else None
        if i in refused:
            e = refused[i]
            errors.append({"id": f"batch_req_{b.id}_{i}", "custom_id": e.get("custom_id"),
                           "response": {"status_code": e["status_code"], "request_id": None,
                                        "body": e["body"]}, "error": None})
        elif job is None or (job.status == JobStatus.CANCELLED and stopped is not None):
            errors.append({"id": f"batch_req_{job.id if job else f'{b.id}_{i}'}",
                           "custom_id": source.line(i).custom_id, "response": None,
                           "error": stopped or _LOST})
        else:
            entry = _job_line(b, source.line(i), job)
            (output if job.status == JobStatus.DONE else errors).append(entry)
    return _jsonl(output), _jsonl(errors)


# A submitted line whose job is not in the store: never seen (a job is written before its
# line counts as submitted), said rather than left out.
_LOST = {"code": "server_error", "message": "the request's job was not found"}


def _stopped_error(b: BatchRecord) -> dict[str, str] | None:
    """The error of the lines a cancel or an expiry stopped (None: the batch ran out)."""
    if b.expired_at is not None:
        return {"code": "batch_expired", "message": "the batch expired (its completion "
                f"window, {b.completion_window}, ended) before this request completed"}
    if b.cancelling_at is not None:
        return {"code": "batch_cancelled",
                "message": "the batch was cancelled before this request completed"}
    return None


def batch_usage(jobs: dict[int, JobRecord]) -> JSONObject:
    """The batch's `usage`, as OpenAI's batch object has it: the tokens of its completed
    requests (the sums of the output file's `usage`)."""
    done = [job for job in jobs.values() if job.status == JobStatus.DONE]
    prompt = sum(job.prompt_tokens for job in done)
    completion = sum(job.completion_tokens or 0 for job in done)
    return {"input_tokens": prompt, "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": sum(job.cached_tokens or 0
                                                          for job in done)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _answer(b: BatchRecord, line: Line, job: JobRecord) -> Answer:
    """The line's answer as its request shapes it (tool calls read as the route reads
    them), stamped with its job's times."""
    chat = b.endpoint == "/v1/chat/completions"
    created = int(job.enqueued_at.timestamp())
    try:  # it parsed when it was submitted
        req = (parse_chat if chat else parse_completion)(line.body)
    except ApiError:
        model = str((line.body or {}).get("model", ""))
        return Answer(id=("chatcmpl-" if chat else "cmpl-") + job.id, model=model,
                      tier="flex", chat=chat, created=created)
    return replace(Answer.of(job.id, req, "flex"), created=created)


def _job_line(b: BatchRecord, line: Line, job: JobRecord) -> JSONObject:
    head = {"id": f"batch_req_{job.id}", "custom_id": line.custom_id, "error": None}
    if job.status == JobStatus.DONE:
        answer = _answer(b, line, job)
        body = answer.whole(job.output_text or "", done_of(job))
        return {**head, "response": {"status_code": 200, "request_id": job.id, "body": body}}
    if job.status == JobStatus.CANCELLED:  # cancelled by itself (DELETE /v1/jobs/{id})
        error = ApiError(499, None, "the request was cancelled before it ended",
                         kind="request_cancelled")
    else:
        error = job_error({"code": "deadline_exceeded" if job.status == JobStatus.EXPIRED
                           else "job_failed", "message": job.error})
    status, body = error_body(error)
    return {**head, "response": {"status_code": status, "request_id": job.id, "body": body}}


def _jsonl(items: list[JSONObject]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
