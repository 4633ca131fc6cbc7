"""The Files API is bounded on what it reads, stores and serves: an upload stops at its
limit on the bytes read (a real chunked upload to a real server), a batch line longer than
its limit is refused naming its line, each tenant's files, bytes and open batches have
quotas, a file is deleted, a file is served a part at a time, and a NUL or a control
character in a file id or a filename is a 4xx, never a 500 (on PostgreSQL, which refuses
NUL in text). The API runs in a thread of the test process on its own Redis database."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from store import Store, upgrade
from store.batches import Batches
from tests.helpers import ApiOfItsOwn, api_of_its_own, own_db, own_redis_url, postgres_or_skip
from tidegate_tools.pg import private_database

MIB = 1024 * 1024
FILE_LIMIT = 12 * MIB
LINE_LIMIT = 4096
BOUNDARY = "tg-files-boundary"
LINE = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}})
# A line of 2,000 bytes: megabytes of them stay under the 10,000 lines a batch takes.
WIDE = json.dumps({"custom_id": "w", "pad": "x" * (2000 - 30)})


@pytest.fixture(scope="module")
def api(redis_server: str, tmp_root: Path) -> Iterator[ApiOfItsOwn]:
    with api_of_its_own(redis_server, tmp_root, "filesbounds", own_db(__name__, "8"),
                        [("chat", "vllm")],
                        batch_max_file_bytes=FILE_LIMIT, batch_max_line_bytes=LINE_LIMIT,
                        tenant_max_files=3, tenant_max_file_bytes=16 * MIB,
                        tenant_max_open_batches=1) as running:
        yield running


def tenant(api: ApiOfItsOwn, name: str) -> httpx.Client:
    _, key = api.store.tenants.create_tenant(name, ["chat", "batch"])
    return httpx.Client(base_url=api.base_url, timeout=60,
                        headers={"Authorization": f"Bearer {key}"})


def upload(http: httpx.Client | TestClient, content: bytes,
           filename: str = "in.jsonl") -> httpx.Response:
    return http.post("/v1/files", data={"purpose": "batch"},
                     files={"file": (filename, content, "application/jsonl")})


def lines(count: int, line: str = LINE) -> bytes:
    return ((line + "\n") * count).encode()


def multipart(filename: bytes, content: bytes) -> bytes:
    """A multipart body written by hand: a client library escapes what this test sends."""
    b = BOUNDARY.encode()
    return (b"--" + b + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename="'
            + filename + b'"\r\nContent-Type: application/jsonl\r\n\r\n' + content
            + b"\r\n--" + b + b"--\r\n")


def error(resp: httpx.Response) -> dict[str, Any]:
    return resp.json()["error"]


# -- bounded on the bytes read ---------------------------------------------------------


def test_a_chunked_upload_past_the_limit_is_refused_without_reading_the_rest(
        api: ApiOfItsOwn) -> None:
    """A real chunked upload (no Content-Length) of 256 MiB against a 12 MiB limit: 413
    naming `file`, and the server stopped pulling the body near the limit (what the
    client got rid of past it is what the sockets' buffers hold)."""
    http = tenant(api, "chunked")
    pulled = 0
    offered = 256 * MIB

    def body() -> Iterator[bytes]:
        nonlocal pulled
        whole = multipart(b"big.jsonl", b"")
        end = whole.rindex(b"\r\n--")  # the file part is the last: its data goes here
        head, tail = whole[:end], whole[end:]
        yield head
        chunk = lines(64 * 1024 // (len(LINE) + 1))
        while pulled < offered:
            pulled += len(chunk)
            yield chunk
        yield tail

    resp = http.post("/v1/files", content=body(),
                     headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert resp.status_code == 413, resp.text
    assert error(resp)["param"] == "file" and "limit" in error(resp)["message"]
    assert pulled < FILE_LIMIT + 16 * MIB, f"the server read {pulled / MIB:.0f} MiB"
    # The server is fine: the next upload of the tenant goes through.
    assert upload(http, lines(2)).status_code == 200


def chunked_upload(http: httpx.Client, offered: int) -> tuple[httpx.Response, int]:
    """A chunked upload offering `offered` bytes of lines; (the answer, bytes pulled)."""
    pulled = 0

    def body() -> Iterator[bytes]:
        nonlocal pulled
        whole = multipart(b"big.jsonl", b"")
        end = whole.rindex(b"\r\n--")
        yield whole[:end]
        chunk = lines(64 * 1024 // (len(LINE) + 1))
        while pulled < offered:
            pulled += len(chunk)
            yield chunk
        yield whole[end:]

    resp = http.post("/v1/files", content=body(),
                     headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    return resp, pulled


def test_uploads_refused_at_the_limit_spend_the_tenants_upload_budget(
        redis_server: str, tmp_root: Path) -> None:
    """A tenant that keeps sending uploads past the file limit pays for what the API read
    of them: once its bytes a minute are spent, its next upload is a 429 before its body is
    read, while another tenant uploads as before."""
    with api_of_its_own(redis_server, tmp_root, "uploadbudget", own_db(__name__, "15"),
                        [("chat", "vllm")],
                        batch_max_file_bytes=FILE_LIMIT,
                        tenant_upload_bytes_per_minute=8 * MIB) as own:
        hostile, other = tenant(own, "uploads-a-lot"), tenant(own, "uploads-once")
        answers = []
        for _ in range(3):  # one refused upload spends the budget; a minute may turn once
            resp, pulled = chunked_upload(hostile, 64 * MIB)
            answers.append(resp.status_code)
            if resp.status_code == 429:
                break
        assert answers[0] == 413 and answers[-1] == 429, answers
        assert error(resp)["code"] == "rate_limited" and error(resp)["param"] == "file"
        assert 0 < int(resp.headers["retry-after"]) <= 60
        assert pulled < 4 * MIB, f"the refused upload's body was read: {pulled / MIB:.0f} MiB"
        assert upload(other, lines(2)).status_code == 200


def test_a_batch_line_longer_than_its_limit_is_refused_naming_its_line(
        api: ApiOfItsOwn) -> None:
    http = tenant(api, "long-line")
    long = json.dumps({"custom_id": "long", "pad": "x" * LINE_LIMIT})
    resp = upload(http, lines(2) + long.encode() + b"\n" + lines(1))
    assert resp.status_code == 400, resp.text
    assert error(resp)["param"] == "file"
    assert "line 3" in error(resp)["message"] and str(LINE_LIMIT) in error(resp)["message"]
    just = json.dumps({"custom_id": "just", "pad": "x" * (LINE_LIMIT - 30)})[:LINE_LIMIT]
    assert upload(http, just.encode() + b"\n").status_code == 200  # at the limit: fine


# -- quotas ----------------------------------------------------------------------------


def test_a_tenant_stores_at_most_its_quota_of_files(api: ApiOfItsOwn) -> None:
    http = tenant(api, "many-files")
    ids = [upload(http, lines(1)).json()["id"] for _ in range(3)]
    refused = upload(http, lines(1))
    assert refused.status_code == 429, refused.text
    assert error(refused)["code"] == "quota_exceeded" and error(refused)["param"] == "file"
    assert "3 files" in error(refused)["message"]
    assert refused.headers["x-should-retry"] == "false"
    other = tenant(api, "many-files-neighbour")  # a quota is the tenant's own
    assert upload(other, lines(1)).status_code == 200
    assert http.delete(f"/v1/files/{ids[0]}").status_code == 200
    assert upload(http, lines(1)).status_code == 200  # room again


def test_a_tenant_stores_at_most_its_quota_of_bytes(api: ApiOfItsOwn) -> None:
    http = tenant(api, "big-files")
    nine_mib = lines(9 * MIB // (len(WIDE) + 1), WIDE)
    assert upload(http, nine_mib).status_code == 200
    refused = upload(http, nine_mib)
    assert refused.status_code == 429, refused.text
    assert error(refused)["code"] == "quota_exceeded" and "bytes" in error(refused)["message"]
    assert upload(http, lines(10)).status_code == 200  # what fits still goes in


def test_a_tenant_has_at_most_its_quota_of_open_batches(api: ApiOfItsOwn) -> None:
    http = tenant(api, "many-batches")
    file_id = upload(http, lines(2)).json()["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
              "completion_window": "24h"}
    first = http.post("/v1/batches", json=create)
    assert first.status_code == 200, first.text
    refused = http.post("/v1/batches", json=create)
    assert refused.status_code == 429, refused.text
    assert error(refused)["code"] == "quota_exceeded" and "1 batches" in error(refused)["message"]
    assert [b["id"] for b in http.get("/v1/batches").json()["data"]] == [first.json()["id"]]
    Batches(api.store).update_batch(first.json()["id"], status="cancelled")  # it ended
    assert http.post("/v1/batches", json=create).status_code == 200


# -- delete ----------------------------------------------------------------------------


def test_a_file_is_deleted_and_gone(api: ApiOfItsOwn) -> None:
    http = tenant(api, "deleter")
    file_id = upload(http, lines(2)).json()["id"]
    stranger = tenant(api, "deleter-neighbour")
    assert stranger.delete(f"/v1/files/{file_id}").status_code == 404
    assert http.get(f"/v1/files/{file_id}").status_code == 200
    resp = http.delete(f"/v1/files/{file_id}")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"id": file_id, "object": "file", "deleted": True}
    assert http.get(f"/v1/files/{file_id}").status_code == 404
    assert http.get(f"/v1/files/{file_id}/content").status_code == 404
    assert http.delete(f"/v1/files/{file_id}").status_code == 404


def test_the_input_of_an_open_batch_is_kept_until_the_batch_ends(api: ApiOfItsOwn) -> None:
    http = tenant(api, "batch-input")
    file_id = upload(http, lines(2)).json()["id"]
    batch = http.post("/v1/batches", json={"input_file_id": file_id,
                                           "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()
    refused = http.delete(f"/v1/files/{file_id}")
    assert refused.status_code == 409, refused.text
    assert error(refused)["code"] == "file_in_use" and batch["id"] in error(refused)["message"]
    assert http.get(f"/v1/files/{file_id}/content").content == lines(2)
    Batches(api.store).update_batch(batch["id"], status="completed")
    assert http.delete(f"/v1/files/{file_id}").status_code == 200


# -- served a part at a time -----------------------------------------------------------


def test_a_large_file_is_served_whole_without_being_held_whole(api: ApiOfItsOwn) -> None:
    """10 MiB of lines with two-, three- and four-byte characters: the bytes served are
    the bytes uploaded, and serving them never held anything near the file in memory (the
    API runs in this process: tracemalloc sees its allocations)."""
    http = tenant(api, "large")
    line = json.dumps({"custom_id": "é€😀", "text": "ça coûte 5 € 😀 " * 90},
                      ensure_ascii=False)
    content = lines(10 * MIB // len(line.encode()), line)
    file_id = upload(http, content).json()["id"]
    digest, size = hashlib.sha256(), 0
    tracemalloc.start()
    try:
        with http.stream("GET", f"/v1/files/{file_id}/content") as resp:
            assert resp.status_code == 200
            assert int(resp.headers["content-length"]) == len(content)
            for chunk in resp.iter_bytes():
                digest.update(chunk)
                size += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == len(content) and digest.hexdigest() == hashlib.sha256(content).hexdigest()
    # A part is 256 Ki characters (1 MiB as a str with four-byte characters in it, 0.5 MiB
    # encoded): measured 1.5 MiB steady and a 4 MiB peak. Held whole, the file's bytes
    # alone are 10 MiB, and its str 20 MiB more.
    assert peak < len(content) / 2, f"serving held {peak / MIB:.1f} MiB at once"


# -- NUL and control characters (PostgreSQL) -------------------------------------------


@pytest.fixture(scope="module")
def pg_api(redis_server: str) -> Iterator[tuple[TestClient, str]]:
    postgres_or_skip()
    from api.app import create_app
    from tidegate.settings import Settings

    with private_database("tidegate_files_bounds") as url:
        upgrade(url)
        store = Store(url)
        _, key = store.tenants.create_tenant("files-pg", ["chat", "batch"])
        redis_url = own_redis_url(redis_server, __name__, "39")
        settings = Settings(redis_url=redis_url, database_url=url, namespace="tgfilespg")
        try:
            with TestClient(create_app(settings)) as http:
                http.headers["Authorization"] = f"Bearer {key}"
                yield http, key
        finally:
            redis.Redis.from_url(redis_url).flushdb()
            store.close()


@pytest.mark.postgres
def test_nul_in_a_file_id_is_a_404_on_postgres(pg_api: tuple[TestClient, str]) -> None:
    http, _ = pg_api
    file_id = upload(http, lines(2)).json()["id"]
    assert http.get(f"/v1/files/{file_id}/content").content == lines(2)
    for bad in ("file-%00", f"{file_id}%00", "%00", "file-%01abc"):
        for method, path in (("GET", f"/v1/files/{bad}"), ("GET", f"/v1/files/{bad}/content"),
                             ("DELETE", f"/v1/files/{bad}")):
            resp = http.request(method, path)
            assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
    resp = http.post("/v1/batches", json={"input_file_id": "file-\u0000",
                                          "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"})
    assert resp.status_code in (400, 404), resp.text
    assert http.get(f"/v1/files/{file_id}").status_code == 200


@pytest.mark.postgres
def test_control_characters_in_a_filename_are_a_400_on_postgres(
        pg_api: tuple[TestClient, str]) -> None:
    http, _ = pg_api
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    for name in (b"in\x00.jsonl", b"\x1b[31mred.jsonl", b"bell\x07.jsonl", b"c1\xc2\x85.jsonl"):
        resp = http.post("/v1/files", content=multipart(name, lines(1)), headers=headers)
        assert resp.status_code == 400, (name, resp.status_code, resp.text)
        assert error(resp)["param"] == "file" and "filename" in error(resp)["message"]
    fine = http.post("/v1/files", content=multipart("ça.jsonl".encode(), lines(1)),
                     headers=headers)
    assert fine.status_code == 200 and fine.json()["filename"] == "ça.jsonl"
