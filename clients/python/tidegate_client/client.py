"""The Python SDK: a producer's `submit` and a consumer's `stream`, sync and async.
Answers are typed (tidegate_client.models); it depends on httpx and pydantic only.

`stream` resumes after a dropped connection from the last event it handed out
(`Last-Event-ID`), so the caller never loses or repeats a token. The API ends a stream
with an `error` event of its own (no id; api/job_sse.py `job_sse`) when it will not go on:
`reconnect` and `unavailable` reopen it, any other code raises StreamError.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx

from tidegate_client.models import Accepted, Event, Job

_RETRYABLE = (httpx.TransportError,)
RETRY_STATUSES = (429, 503)  # a bound reached or something down: the API says when to retry
MAX_RETRY_WAIT_S = 30.0  # a Retry-After longer than this is waited this long, then retried
# A stream's read gives up after this much silence. The API sends a keep-alive comment
# every TIDEGATE_SSE_KEEPALIVE_S (15 s): a half-open connection is noticed, and resumed.
READ_TIMEOUT_S = 45.0
# Connections to the API at once, each kept for reuse. An event stream holds one for as
# long as it is read: with httpx's defaults (100, of which 20 kept) a producer streaming
# 64 jobs while submitting 64 more waited for a free connection, and made a new one for
# most requests (bench/e2e.py: submits took a second at the client, 50 ms at the API).
MAX_CONNECTIONS = 512


def _limits(max_connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=max_connections)


class TidegateError(Exception):
    """The API refused a request: its HTTP `status`, the error's `type` (e.g.
    `queue_full`, `rate_limited`, `unauthorized`), and `field` naming what was wrong when
    it is the caller's."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status, self.field, self.type = status, err.get("field"), err.get("type")
        self.message = str(err.get("message", body))
        super().__init__(f"{status}: {self.message}")


class StreamError(TidegateError):
    """The API ended a job's event stream without the job's end: `code` says why
    (`past_end`, `stream_gone`); GET /v1/jobs/{id} has the job as the store holds it."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(200, {"error": {"type": code, "field": None, "message": message}})


def _failed(exc: Exception, failures: int, most: int) -> int:
    """Failures in a row once `exc` ended a stream: 0 after the API closed it at its
    longest life (reopen at once), one more after a transport error or a Redis outage;
    raises `exc` when it ends the stream for good, or after `most` in a row."""
    if isinstance(exc, StreamError):
        if exc.code == "reconnect":
            return 0
        if exc.code != "unavailable":
            raise exc
    if failures >= most:
        raise exc
    return failures + 1


def _backoff_s(failures: int) -> float:
    return min(0.1 * 2**failures, 2.0) if failures else 0.0


def _retry_wait_s(resp: httpx.Response | None, attempt: int,
                  most_s: float = MAX_RETRY_WAIT_S) -> float:
    """Retry-After when the API sent one, else exponential backoff; with jitter, so many
    clients refused together do not come back together."""
    wait = _backoff_s(attempt + 1)
    if resp is not None:
        with contextlib.suppress(ValueError):  # an HTTP date: keep the backoff
            wait = float(resp.headers.get("retry-after", wait))
    return min(max(wait, 0.0), most_s) * random.uniform(1.0, 1.25)


def _submit_headers(options: dict[str, Any]) -> dict[str, str]:
    """An idempotency key for every submit the caller gave none: a submit retried after a
    lost answer finds the job it made instead of making a second."""
    return {} if options.get("idempotency_key") else {"Idempotency-Key": uuid.uuid4().hex}


_LINE_END = re.compile(r"\r\n|\r|\n")


def _sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """SSE lines end at CR, LF or CRLF only (httpx's iter_lines also splits at U+2028 and
    the like, which a token may hold). An unterminated last line is no event: dropped."""
    buffer = _LineBuffer()
    for chunk in chunks:
        yield from buffer.feed(chunk)


def _split(text: str) -> list[str]:
    """Complete lines, then what is left (a trailing CR may be half of a CRLF)."""
    held = text.endswith("\r")
    parts = _LINE_END.split(text[:-1] if held else text)
    if held:
        parts[-1] += "\r"
    return parts


class _LineBuffer:
    """Bytes in, complete SSE lines out (for a sync or an async byte stream)."""

    def __init__(self) -> None:
        self.decoder, self.pending = codecs.getincrementaldecoder("utf-8")(errors="replace"), ""

    def feed(self, chunk: bytes) -> list[str]:
        self.pending += self.decoder.decode(chunk)
        *lines, self.pending = _split(self.pending)
        return lines


def _job_body(lane: str, messages: list[dict[str, str]] | None, prompt: str | None,
              **options: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"lane": lane, **{k: v for k, v in options.items() if v is not None}}
    if messages is not None:
        body["messages"] = messages
    if prompt is not None:
        body["prompt"] = prompt
    return body


def _list_params(after: str | None, filters: dict[str, Any]) -> dict[str, str]:
    params = {name: str(value) for name, value in filters.items() if value is not None}
    if isinstance(filters.get("status"), (list, tuple)):
        params["status"] = ",".join(filters["status"])
    if after is not None:
        params["after"] = after
    return params


def _check(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        try:
            body = resp.json()
        except ValueError:
            body = {"error": {"message": resp.text}}
        raise TidegateError(resp.status_code, body)
    return resp.json()  # type: ignore[no-any-return]


class _SseParser:
    """Turns SSE lines into events; comments and keep-alives are dropped, and the API's
    own `error` event (no id) raises StreamError."""

    def __init__(self) -> None:
        self.data: list[str] = []
        self.kind, self.has_id = "", False

    def feed(self, line: str) -> Event | None:
        if line == "":
            data, own_error = "\n".join(self.data), self.kind == "error" and not self.has_id
            self.data, self.kind, self.has_id = [], "", False
            if not data:
                return None
            if own_error:
                body = json.loads(data)
                raise StreamError(str(body.get("code")), str(body.get("message")))
            return Event.model_validate_json(data)
        if line.startswith("data:"):
            self.data.append(line[5:].lstrip())
        elif line.startswith("event:"):
            self.kind = line[6:].strip()
        elif line.startswith("id:"):
            self.has_id = True
        return None


class Client:
    """`retries`: how many times a request refused with 429 or 503 (after its
    Retry-After, at most `max_retry_wait_s`) or lost on the way is tried again; 0 to see
    every refusal. A submit carries an idempotency key, so a retry never makes two jobs."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 30.0,
                 max_reconnects: int = 20, retries: int = 5,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 max_retry_wait_s: float = MAX_RETRY_WAIT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s, limits=_limits(
            max_connections), headers={"Authorization": f"Bearer {api_key}"})
        self.max_reconnects, self.retries, self.read_timeout_s = (
            max_reconnects, retries, read_timeout_s)
        self.max_retry_wait_s = max_retry_wait_s

    def submit(self, lane: str, messages: list[dict[str, str]] | None = None,
               prompt: str | None = None, **options: Any) -> Accepted:
        """Enqueue a job (options: max_tokens, temperature, top_p, seed, stop, priority,
        session_id, deadline_s, idempotency_key, callback_url, lora)."""
        return Accepted.model_validate(self._call(
            "POST", "/v1/jobs", json=_job_body(lane, messages, prompt, **options),
            headers=_submit_headers(options)))

    def job(self, job_id: str) -> Job:
        return Job.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self._call("DELETE", f"/v1/jobs/{job_id}"))

    def _call(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            try:
                resp = self.http.request(method, url, **kwargs)
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
                time.sleep(_retry_wait_s(None, attempt, self.max_retry_wait_s))
                continue
            if resp.status_code not in RETRY_STATUSES or attempt == self.retries:
                return _check(resp)
            time.sleep(_retry_wait_s(resp, attempt, self.max_retry_wait_s))
        raise AssertionError("unreachable")

    def jobs(self, after: str | None = None, **filters: Any) -> Iterator[Job]:
        """The tenant's jobs in acceptance order, page after page (GET /v1/jobs; filters:
        `status`, `lane`, `session_id`, `created_after`, `limit` per page); `after` is a
        page's `next_cursor`, to go on from where an earlier walk stopped."""
        while True:
            page = self._call("GET", "/v1/jobs", params=_list_params(after, filters))
            yield from (Job.model_validate(job) for job in page["data"])
            if not page["has_more"]:
                return
            after = page["next_cursor"]

    def stream(self, job_id: str, last_event_id: int = -1) -> Iterator[Event]:
        """Every event after `last_event_id`, in order, until `done` or `error`."""
        last, failures = last_event_id, 0
        while True:
            try:
                for event in self._events_once(job_id, last):
                    last, failures = event.seq, 0
                    yield event
                    if event.terminal:
                        return
            except (*_RETRYABLE, StreamError) as exc:
                failures = _failed(exc, failures, self.max_reconnects)
                time.sleep(_backoff_s(failures))

    def _events_once(self, job_id: str, last: int) -> Iterator[Event]:
        headers = {"Last-Event-ID": str(last)} if last >= 0 else {}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                              timeout=httpx.Timeout(30.0, read=self.read_timeout_s)) as resp:
            if resp.status_code >= 400:
                resp.read()
                _check(resp)
            parser = _SseParser()
            for line in _sse_lines(resp.iter_bytes()):
                if (event := parser.feed(line)) is not None:
                    yield event

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncClient:
    """As Client, on asyncio; `async with AsyncClient(...) as client:` closes it."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 30.0,
                 max_reconnects: int = 20, retries: int = 5,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 max_retry_wait_s: float = MAX_RETRY_WAIT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=_limits(
            max_connections), headers={"Authorization": f"Bearer {api_key}"})
        self.max_reconnects, self.retries, self.read_timeout_s = (
            max_reconnects, retries, read_timeout_s)
        self.max_retry_wait_s = max_retry_wait_s

    async def submit(self, lane: str, messages: list[dict[str, str]] | None = None,
                     prompt: str | None = None, **options: Any) -> Accepted:
        body = _job_body(lane, messages, prompt, **options)
        return Accepted.model_validate(await self._call(
            "POST", "/v1/jobs", json=body, headers=_submit_headers(options)))

    async def job(self, job_id: str) -> Job:
        return Job.model_validate(await self._call("GET", f"/v1/jobs/{job_id}"))

    async def cancel(self, job_id: str) -> Job:
        return Job.model_validate(await self._call("DELETE", f"/v1/jobs/{job_id}"))

    async def _call(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        import asyncio

        for attempt in range(self.retries + 1):
            try:
                resp = await self.http.request(method, url, **kwargs)
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(_retry_wait_s(None, attempt, self.max_retry_wait_s))
                continue
            if resp.status_code not in RETRY_STATUSES or attempt == self.retries:
                return _check(resp)
            await asyncio.sleep(_retry_wait_s(resp, attempt, self.max_retry_wait_s))
        raise AssertionError("unreachable")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def jobs(self, after: str | None = None,
                   **filters: Any) -> AsyncIterator[Job]:
        """As Client.jobs."""
        while True:
            page = await self._call("GET", "/v1/jobs", params=_list_params(after, filters))
            for job in page["data"]:
                yield Job.model_validate(job)
            if not page["has_more"]:
                return
            after = page["next_cursor"]

    async def stream(self, job_id: str, last_event_id: int = -1) -> AsyncIterator[Event]:
        import asyncio

        last, failures = last_event_id, 0
        while True:
            try:
                async for event in self._events_once(job_id, last):
                    last, failures = event.seq, 0
                    yield event
                    if event.terminal:
                        return
            except (*_RETRYABLE, StreamError) as exc:
                failures = _failed(exc, failures, self.max_reconnects)
                await asyncio.sleep(_backoff_s(failures))

    async def _events_once(self, job_id: str, last: int) -> AsyncIterator[Event]:
        headers = {"Last-Event-ID": str(last)} if last >= 0 else {}
        async with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                    timeout=httpx.Timeout(30.0, read=self.read_timeout_s)
                                    ) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _check(resp)
            parser, lines = _SseParser(), _LineBuffer()
            async for chunk in resp.aiter_bytes():
                for line in lines.feed(chunk):
                    if (event := parser.feed(line)) is not None:
                        yield event

    async def aclose(self) -> None:
        await self.http.aclose()

