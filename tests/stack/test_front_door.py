"""The front door (issue 28, finding 5 and items of point 9): unknown callers wait behind
tenants and are refused before they cost anything; every body is bounded on the bytes
read; a revoked key ends at once, its open streams too; /readyz names no path; a request
cannot forge a log line.

Each API runs in this process (tests/helpers.py `api_of_its_own`: real HTTP on a port of
its own) on its own Redis database and a SQLite database of its own, with a chat worker only
advertised, so accepted jobs stay queued. Floods and uploads are real: a process of
threads sending unknown keys, chunked bodies from generators that count what was pulled.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from api import auth
from api.app import create_app
from api.errors import ApiError
from store.tenants import Tenants
from tests.helpers import ApiOfItsOwn, Held, api_of_its_own, metric, own_db
from tidegate.logs import ContextFilter, TextFormatter
from tidegate.settings import Settings
from tidegate_tools.procs import Proc, free_port, wait_until

DB = own_db(__name__, "9")
ASK = [{"role": "user", "content": "Where is my parcel?"}]
JOB = {"lane": "chat", "messages": ASK, "max_tokens": 8}
CHUNK = b" " * (64 * 1024)  # JSON whitespace: a body that is valid until it is too long
HUGE_CHUNKS = 4096  # 256 MiB, never sent whole: the server must stop reading long before
READ_AT_MOST = 16 * 1024 * 1024  # what socket buffers hold, and then some
BODY_LIMIT = 64 * 1024
HOLD_S = 1.0  # TIDEGATE_AUTH_FAILURE_HOLD_S: a 429 for too many 401s comes 0.5-1.5 holds late
LOOKUP_S = 0.02  # a key lookup's time under load, in the flood
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # what breaks or hides a line


@contextlib.contextmanager
def front_door(redis_server: str, tmp_root: Path, name: str,
               **settings: Any) -> Iterator[ApiOfItsOwn]:
    with api_of_its_own(redis_server, tmp_root, name, DB, [("chat", "vllm")],
                        max_body_bytes=BODY_LIMIT, **settings) as own:
        yield own


def client(own: ApiOfItsOwn, key: str | None = None, address: str | None = None,
           timeout_s: float = 30) -> httpx.Client:
    """An HTTP client of the API, from a loopback `address` of its own when given (the
    401 limit counts per client address)."""
    transport = httpx.HTTPTransport(local_address=address) if address else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=own.base_url, timeout=timeout_s, headers=headers,
                        transport=transport)


def unknown_key() -> str:
    return "tg_" + secrets.token_urlsafe(32)


class Pulled:
    """A chunked body of HUGE_CHUNKS `chunk`s after `head`, counting the bytes pulled."""

    def __init__(self, head: bytes = b"", chunk: bytes = CHUNK) -> None:
        self.head, self.chunk, self.bytes = head, chunk, 0

    def __iter__(self) -> Iterator[bytes]:
        self.bytes += len(self.head)
        yield self.head
        for _ in range(HUGE_CHUNKS):
            self.bytes += len(self.chunk)
            yield self.chunk


# -- unknown callers ---------------------------------------------------------------------

FLOOD = r"""
import json, secrets, sys, threading, time
import httpx

base, seconds, threads, per_s = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), \
    float(sys.argv[4])
body = json.dumps({"lane": "chat", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 8})
counts, lock = {}, threading.Lock()
end = time.monotonic() + seconds

def flood():
    period, next_at = threads / per_s, time.monotonic()
    with httpx.Client(base_url=base, timeout=30) as http:
        while (now := time.monotonic()) < end:
            if now < next_at:
                time.sleep(next_at - now)
            next_at += period
            headers = {"Authorization": "Bearer tg_" + secrets.token_urlsafe(32),
                       "Content-Type": "application/json"}
            try:
                status = str(http.post("/v1/jobs", content=body, headers=headers).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            with lock:
                counts[status] = counts.get(status, 0) + 1

workers = [threading.Thread(target=flood) for _ in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
print("FLOOD " + json.dumps(counts), flush=True)
"""


def test_a_flood_of_unknown_keys_leaves_a_tenants_submits_accepted(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    """Up to 1,000 submits a second with unknown keys, from 48 threads of another process
    for 4 s, while a tenant submits: every one of the tenant's submits is 202.

    Each key lookup takes 20 ms more, as a PostgreSQL under load may (a wrapper around the
    real lookup), and only 4 calls may wait for admission: unknown callers queued among
    the tenants' submits, as they were, take every place and the tenant hears 503."""
    with front_door(redis_server, tmp_root, "flood", max_admission_waiting=4,
                    auth_failures=1_000_000) as own:
        store = own.app.state.deps.store
        lookup = store.tenants.tenant_by_key

        def slow_lookup(key: str) -> Any:
            time.sleep(LOOKUP_S)
            return lookup(key)

        store.tenants.tenant_by_key = slow_lookup
        key = own.store.tenants.create_tenant("flood-victim", ["chat"])[1]
        with client(own, key) as http:
            assert http.post("/v1/jobs", json=JOB).status_code == 202  # a key in use
            flood = Proc("flood", [sys.executable, "-c", FLOOD, own.base_url, "4", "48", "1000"],
                         tmp_root / "logs" / "front-door-flood.log", dict(os.environ))
            try:
                wait_until(lambda: _answered(own) >= 50, 60, "the flood's first 401s", [flood])
                statuses = []
                while flood.alive() and len(statuses) < 40:
                    statuses.append(http.post("/v1/jobs", json=JOB).status_code)
                flood.popen.wait(60)
            finally:
                flood.stop()
    counts = json.loads(flood.tail().split("FLOOD ", 1)[1].splitlines()[0])
    assert len(statuses) >= 5, f"the tenant sent only {len(statuses)} submits in the flood"
    assert statuses == [202] * len(statuses), statuses
    assert counts.get("401", 0) >= 200, counts  # the flood reached the API, and was refused
    assert set(counts) <= {"401", "503"}, counts  # never accepted


def _answered(own: ApiOfItsOwn) -> float:
    """401s the API has answered, as its /metrics counts them."""
    text = httpx.get(f"{own.base_url}/metrics", timeout=30).text
    return metric(text, "tidegate_requests_rejected_total", status="401")


def test_an_unknown_key_hears_401_before_its_body_is_read(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    """A 256 MiB chunked submit with an unknown key: 401, with the body barely pulled (the
    server closes rather than read on)."""
    with front_door(redis_server, tmp_root, "unread") as own, client(own, unknown_key()) as http:
        body = Pulled(b'{"lane": "chat", "prompt": "hi", "max_tokens": 8')
        resp = http.post("/v1/jobs", content=iter(body),
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["field"] == "authorization"
    assert body.bytes < READ_AT_MOST, f"{body.bytes} bytes were pulled from the body"


def test_401s_past_the_limit_from_one_address_answer_429_with_retry_after(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    with front_door(redis_server, tmp_root, "authlimit", auth_failures=5,
                    auth_failure_hold_s=HOLD_S) as own:
        key = own.store.tenants.create_tenant("authlimit", ["chat"])[1]
        with client(own, key, "127.0.0.3") as known:
            assert known.post("/v1/jobs", json=JOB).status_code == 202
        with client(own, address="127.0.0.3") as http:
            for _ in range(5):
                resp = http.get("/v1/jobs", headers={"Authorization": f"Bearer {unknown_key()}"})
                assert resp.status_code == 401, resp.text
            for headers in ({"Authorization": f"Bearer {unknown_key()}"}, {}):
                asked = time.monotonic()
                resp = http.get("/v1/jobs", headers=headers)
                assert resp.status_code == 429, resp.text
                # held back (at least half a hold): a flood's connection sends one a hold
                assert time.monotonic() - asked >= HOLD_S / 2
                assert resp.json()["error"]["type"] == "auth_failures"
                assert 1 <= int(resp.headers["Retry-After"]) <= 60
        with client(own, key, "127.0.0.3") as known:  # a key found valid before goes on
            assert known.post("/v1/jobs", json=JOB).status_code == 202
        with client(own, unknown_key(), "127.0.0.4") as elsewhere:  # another address
            assert elsewhere.get("/v1/jobs").status_code == 401


def test_a_resume_with_an_unknown_key_or_of_another_tenants_job_gets_no_resume_rank(
        redis_server: str, model_path: Path, tmp_root: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every admission thread held: another tenant's `Last-Event-ID: 0` for a job is a
    404 at once, and an unknown key's waits behind a tenant's submit, where the resume
    rank used to put both ahead of every submit."""
    monkeypatch.setattr(auth, "KEY_CACHE_S", 600.0)  # the keys stay known through the test
    with front_door(redis_server, tmp_root, "resume") as own, \
            ThreadPoolExecutor(4) as pool:
        owner_key = own.store.tenants.create_tenant("resume-owner", ["chat"])[1]
        other_key = own.store.tenants.create_tenant("resume-other", ["chat"])[1]
        owner, other = client(own, owner_key), client(own, other_key)
        stranger = client(own, unknown_key())
        job_id = owner.post("/v1/jobs", json=JOB).json()["job_id"]
        assert other.get("/v1/jobs").status_code == 200  # its key found valid
        events = f"/v1/jobs/{job_id}/events"
        held = Held(own)
        try:
            for _ in range(4):  # every admission thread
                held.hold((-100.0,))
            theirs = pool.submit(other.get, events, headers={"Last-Event-ID": "0"})
            assert theirs.result(timeout=15).status_code == 404
            resumed = _sent(pool, lambda: stranger.get(events, headers={"Last-Event-ID": "0"}),
                            held.admission)
            submitted = _sent(pool, lambda: owner.post("/v1/jobs", json=JOB), held.admission)
            held.hold((50.0,), taken=False)  # behind the submit, ahead of unknown callers
            held.release(0)  # one thread: it takes the top of the queue, then the hold
            assert submitted.result(timeout=15).status_code == 202
            assert not resumed.done()  # behind the hold
            held.release()
            assert resumed.result(timeout=15).status_code == 401
        finally:
            held.close()
            for http in (owner, other, stranger):
                http.close()


def _sent(pool: ThreadPoolExecutor, call: Callable[[], httpx.Response],
          admission: Any) -> Future[httpx.Response]:
    """`call` sent from the pool, once it waits in the admission queue."""
    waiting = admission.waiting()
    future = pool.submit(call)
    wait_until(lambda: admission.waiting() > waiting or future.done(), 15,
               "the request to wait for admission", poll_s=0.01)
    assert not future.done(), future.result().text
    return future


# -- bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "head"), [
    ("/v1/jobs", b'{"lane": "chat", "prompt": "hi", "max_tokens": 8'),
    ("/v1/chat/completions", b'{"model": "tidegate-test", "messages": []'),
])
def test_a_chunked_body_over_the_limit_is_413_and_stops_reading(
        redis_server: str, model_path: Path, tmp_root: Path, path: str, head: bytes) -> None:
    name = "bodies" + path.rsplit("/", 1)[1]
    with front_door(redis_server, tmp_root, name) as own:
        key = own.store.tenants.create_tenant(name, ["chat"])[1]
        with client(own, key) as http:
            body = Pulled(head)
            resp = http.post(path, content=iter(body),
                             headers={"Content-Type": "application/json"})
        assert resp.status_code == 413, resp.text
        error = resp.json()["error"]
        assert error.get("field", error.get("param")) == "body"
        assert str(BODY_LIMIT) in error["message"]
        assert body.bytes < READ_AT_MOST, f"{body.bytes} bytes were pulled from the body"
        assert own.store.jobs.count_jobs() == 0


def test_an_upload_may_pass_the_body_limit_up_to_the_file_limit_and_no_further(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    """POST /v1/files is bounded by the file limit (and its form), not the body limit: a
    file four times the body limit is taken; a chunked upload past the file limit is 413
    naming the file, and its body stops being read."""
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tidegate-test", "messages": ASK}})
    text = "\n".join([line] * (4 * BODY_LIMIT // len(line))) + "\n"
    boundary = "front-door"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            'filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n').encode()
    with front_door(redis_server, tmp_root, "upload", batch_max_lines=100_000,
                    batch_max_file_bytes=8 * BODY_LIMIT) as own:
        key = own.store.tenants.create_tenant("upload", ["chat", "batch"])[1]
        with client(own, key) as http:
            taken = http.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", io.BytesIO(text.encode()))})
            body = Pulled(head, (line + "\n").encode() * (len(CHUNK) // len(line)))
            refused = http.post("/v1/files", content=iter(body), headers={
                "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert taken.status_code == 200, taken.text
    assert taken.json()["bytes"] == len(text.encode())
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["param"] == "file"
    assert body.bytes < READ_AT_MOST, f"{body.bytes} bytes were pulled from the upload"


# -- revocation --------------------------------------------------------------------------


def test_a_revocation_during_a_lookup_is_not_cached_as_valid() -> None:
    """A key found valid by a lookup that began before its revocation was announced is
    looked up again at its next use (it used to be trusted for KEY_CACHE_S more)."""

    class SlowStore:
        def __init__(self) -> None:
            self.valid, self.reading, self.go_on = True, threading.Event(), threading.Event()
            self.tenants = self  # Store.tenants: the one method the API's auth calls is here

        def tenant_by_key(self, key: str) -> Any:
            found = self.valid
            self.reading.set()
            self.go_on.wait(10)
            return _record(7) if found else None

    store, key = SlowStore(), unknown_key()
    with ThreadPoolExecutor(1) as pool:
        looking = pool.submit(auth.tenant_for_key, store, key)  # type: ignore[arg-type]
        assert store.reading.wait(10)
        store.valid = False  # revoked, and announced while the lookup is out
        auth.announce_change(_NoRedis(), "race")
        store.go_on.set()
        assert looking.result(timeout=10).id == 7  # valid when it was read
    with pytest.raises(ApiError) as refused:
        auth.tenant_for_key(store, key)  # type: ignore[arg-type]
    assert refused.value.status == 401


class _NoRedis:
    def publish(self, channel: str, message: str) -> int:
        return 0


def _record(tenant_id: int) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(id=tenant_id, name=f"t{tenant_id}", lanes=["chat"],
                           requests_per_minute=None, tokens_per_minute=None, webhook_url=None,
                           max_priority=None, monthly_token_budget=None, fair_weight=None)


def test_revoking_a_key_ends_its_open_streams_and_refuses_it_at_once(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    """A native event stream and a streamed chat completion opened with a key end with an
    error once it is revoked; a stream of the tenant's other key goes on."""
    with front_door(redis_server, tmp_root, "revoke", sse_keepalive_s=0.2) as own, \
            ThreadPoolExecutor(3) as pool:
        admin = Tenants(own.store).create_admin_key("ops")
        with client(own, admin) as ops:
            made = ops.post("/admin/v1/tenants", json={"name": "revoked", "lanes": ["chat"]})
            assert made.status_code == 201, made.text
            kept = made.json()["key"]["secret"]
            second = ops.post("/admin/v1/tenants/revoked/keys", json={"name": "crm"}).json()
        key = second["secret"]
        with client(own, key) as http, client(own, kept) as other:
            job_id = http.post("/v1/jobs", json=JOB).json()["job_id"]
            native = _Stream(http, "GET", f"/v1/jobs/{job_id}/events")
            chat = _Stream(http, "POST", "/v1/chat/completions",
                           json={"model": "tidegate-test", "messages": ASK, "max_tokens": 4,
                                 "stream": True})
            survivor = _Stream(other, "GET", f"/v1/jobs/{job_id}/events")
            ends = [pool.submit(s.until_end) for s in (native, chat)]
            for stream in (native, chat, survivor):
                wait_until(lambda s=stream: s.lines > 0, 15, "the stream to open")  # type: ignore[misc]
            with client(own, admin) as ops:
                gone = ops.delete(f"/admin/v1/tenants/revoked/keys/{second['id']}")
                assert gone.status_code == 200, gone.text
            assert http.get("/v1/jobs").status_code == 401  # at once, on every request
            native_end, chat_end = (f.result(timeout=30) for f in ends)
            assert native_end[-2:] == ["event: error", native_end[-1]]
            assert json.loads(native_end[-1].removeprefix("data: "))["code"] == "unauthorized"
            error = json.loads(chat_end[-2].removeprefix("data: "))["error"]
            assert error["code"] == "invalid_api_key" and chat_end[-1] == "data: [DONE]"
            seen = survivor.lines
            wait_until(lambda: survivor.read_one() and survivor.lines > seen, 15,
                       "the other key's stream to go on")
            assert other.get("/v1/jobs").status_code == 200
            for stream in (native, chat, survivor):
                stream.close()


class _Stream:
    """A streamed response read line by line (blank lines skipped), with a deadline."""

    def __init__(self, http: httpx.Client, method: str, path: str, **kwargs: Any) -> None:
        self._context = http.stream(method, path, timeout=httpx.Timeout(30, read=15), **kwargs)
        self.resp = self._context.__enter__()
        assert self.resp.status_code == 200, self.resp.read()
        self._lines = self.resp.iter_lines()
        self.seen: list[str] = []
        self.lines = 0
        self._lock = threading.Lock()
        self._first = threading.Thread(target=self.read_one, daemon=True)
        self._first.start()

    def read_one(self) -> bool:
        with self._lock:
            for line in self._lines:
                if line:
                    self.seen.append(line)
                    self.lines += 1
                    return True
        return False

    def until_end(self, deadline_s: float = 15.0) -> list[str]:
        """Every line up to the stream's end, or up to `deadline_s` if it goes on."""
        self._first.join()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and self.read_one():
            pass
        return self.seen

    def close(self) -> None:
        self._context.__exit__(None, None, None)


# -- what anyone may read ----------------------------------------------------------------


def test_readyz_names_no_path(redis_server: str, model_path: Path, tmp_root: Path) -> None:
    folder = tmp_root / "front-door-no-model"
    folder.mkdir(exist_ok=True)
    with front_door(redis_server, tmp_root, "readyz", model=str(folder)) as own, \
            httpx.Client(base_url=own.base_url, timeout=30) as http:
        wait_until(lambda: http.get("/readyz").json()["checks"]["tokenizer"].get("error")
                   not in (None, "loading"), 60, "the tokenizer to fail to load")
        resp = http.get("/readyz")
    assert resp.status_code == 503
    assert resp.json()["checks"]["tokenizer"]["ok"] is False
    assert str(folder) not in resp.text and str(tmp_root) not in resp.text
    assert "/" not in json.dumps(resp.json()["checks"]["tokenizer"])


def test_a_request_path_with_a_newline_writes_one_log_line(
        redis_server: str, model_path: Path, tmp_root: Path) -> None:
    """The text format: a path decoded from %0a, %0b, %1b (a terminal's escape), %e2%80%a8
    (a line separator), logged when the database is down, stays on its line, escaped.
    (Starlette's URL parsing drops a decoded \\n and \\r; the other line breaks and
    escapes it keeps.)"""
    settings = Settings(redis_url=redis_server.rsplit("/", 1)[0] + f"/{DB}",
                        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x",
                        namespace="tgfrontlogs")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter())
    handler.addFilter(ContextFilter("api"))
    logger = logging.getLogger("tidegate.api")
    logger.addHandler(handler)
    try:
        with TestClient(create_app(settings)) as http:
            resp = http.get("/v1/jobs/x%0aA%0bFORGED%1b[2K%e2%80%a8LINE%0d%0a",
                            headers={"Authorization": f"Bearer {unknown_key()}"})
    finally:
        logger.removeHandler(handler)
    assert resp.status_code == 503, resp.text
    lines = [line for line in out.getvalue().splitlines() if "FORGED" in line or "LINE" in line]
    assert len(lines) == 1, lines
    assert "GET /v1/jobs/x" in lines[0] and "\\x0bFORGED\\x1b[2K\\u2028LINE" in lines[0]
    assert not CONTROL.search(lines[0]), lines
