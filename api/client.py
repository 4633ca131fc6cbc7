"""The Python SDK: a producer's `submit` and a consumer's `stream`, sync and async.

`stream` resumes after a dropped connection from the last event it handed out
(`Last-Event-ID`), so the caller never loses or repeats a token. The API ends a stream
with an `error` event of its own (no id; api/app.py `_sse`) when it will not go on:
`reconnect` and `unavailable` reopen it, any other code raises StreamError.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from tidegate.events import Event

_RETRYABLE = (httpx.TransportError,)


class TidegateError(Exception):
    """The API refused a request; `field` names what was wrong when it is the caller's."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status, self.field = status, err.get("field")
        super().__init__(f"{status}: {err.get('message', body)}")


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


def _job_body(lane: str, messages: list[dict[str, str]] | None, prompt: str | None,
              **options: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"lane": lane, **{k: v for k, v in options.items() if v is not None}}
    if messages is not None:
        body["messages"] = messages
    if prompt is not None:
        body["prompt"] = prompt
    return body


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
            return Event.from_json(data)
        if line.startswith("data:"):
            self.data.append(line[5:].lstrip())
        elif line.startswith("event:"):
            self.kind = line[6:].strip()
        elif line.startswith("id:"):
            self.has_id = True
        return None


class Client:
    def __init__(self, base_url: str, api_key: str, timeout_s: float = 30.0,
                 max_reconnects: int = 20) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {api_key}"})
        self.max_reconnects = max_reconnects

    def submit(self, lane: str, messages: list[dict[str, str]] | None = None,
               prompt: str | None = None, **options: Any) -> dict[str, Any]:
        """Enqueue a job; returns the API's answer (`job_id`, `events_url`, ...)."""
        return _check(self.http.post("/v1/jobs", json=_job_body(lane, messages, prompt, **options)))

    def job(self, job_id: str) -> dict[str, Any]:
        return _check(self.http.get(f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return _check(self.http.delete(f"/v1/jobs/{job_id}"))

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
                              timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                resp.read()
                _check(resp)
            parser = _SseParser()
            for line in resp.iter_lines():
                if (event := parser.feed(line)) is not None:
                    yield event

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncClient:
    def __init__(self, base_url: str, api_key: str, timeout_s: float = 30.0,
                 max_reconnects: int = 20) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s,
                                      headers={"Authorization": f"Bearer {api_key}"})
        self.max_reconnects = max_reconnects

    async def submit(self, lane: str, messages: list[dict[str, str]] | None = None,
                     prompt: str | None = None, **options: Any) -> dict[str, Any]:
        body = _job_body(lane, messages, prompt, **options)
        return _check(await self.http.post("/v1/jobs", json=body))

    async def job(self, job_id: str) -> dict[str, Any]:
        return _check(await self.http.get(f"/v1/jobs/{job_id}"))

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return _check(await self.http.delete(f"/v1/jobs/{job_id}"))

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
                                    timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _check(resp)
            parser = _SseParser()
            async for line in resp.aiter_lines():
                if (event := parser.feed(line)) is not None:
                    yield event

    async def aclose(self) -> None:
        await self.http.aclose()


