"""OpenAI's Files API, for the Batch API's input and output files.

    POST   /v1/files                a JSONL input file (multipart, purpose `batch`)
    GET    /v1/files                the caller's files, a page (`purpose`, `limit`, `after`,
                                    `order`, as OpenAI's)
    GET    /v1/files/{id}           its record;  GET /v1/files/{id}/content  its text
    DELETE /v1/files/{id}           gone; the input of an open batch is kept (409)

Every upload is bounded on the bytes read, a chunked one included: the multipart body is
parsed as it arrives (python-multipart's streaming parser), the file part kept in memory
up to TIDEGATE_BATCH_MAX_FILE_BYTES and each of its lines checked against
TIDEGATE_BATCH_MAX_LINE_BYTES as it comes; past either the answer goes at once (413, or
400 naming the line) and nothing more is read. Nothing is spooled to disk. A tenant's
files and their bytes are bounded by quotas (429 `quota_exceeded`), and so are its open
batches (counted when one is created, api/batches.py). What a tenant uploads a minute is
bounded too (TIDEGATE_TENANT_UPLOAD_BYTES_PER_MINUTE, refused uploads' bytes included:
reading them cost the API as much), so a stream of uploads refused at the limit cannot
keep an API process busy parsing them. A file is served in slices read
from the store one after the other (store/batches.py, `file_parts`), never whole.

A file expires: an upload after TIDEGATE_FILE_RETENTION_DAYS (or its `expires_after`, if
sooner), a batch's output and error files after the batch's `output_expires_after` (at
most TIDEGATE_BATCH_OUTPUT_RETENTION_DAYS); the scheduler's purge deletes it then
(scheduler/retention.py).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from api.auth import authenticate
from api.deps import Deps, RouteOptions
from api.errors import ApiError, not_found
from api.limits import charge_upload, check_upload_budget
from api.openai_models import bad
from api.schemas import check_text
from store.batches import Batches, FileQuota, FileRecord
from tidegate.jsontypes import JSONObject
from tidegate.settings import Settings

DAY_S = 86400
# OpenAI's bounds of `expires_after` and `output_expires_after` (seconds after creation).
EXPIRES_AFTER_S = (3600, 30 * DAY_S)
# What a multipart body carries beyond its file: the boundaries and the parts' headers
# (python-multipart bounds each part's headers: 8 of at most 4 KiB) and the small fields.
FORM_OVERHEAD_BYTES = 64 * 1024
MAX_PARTS = 4  # the file, `purpose`, `expires_after[anchor]`, `expires_after[seconds]`
MAX_FIELD_BYTES = 1024
FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")
# GET /v1/files: OpenAI's largest page, and its purposes (only `batch` and `batch_output`
# files are stored here: a filter by another finds none).
MAX_LIST_FILES = 10_000
PURPOSES = ("assistants", "assistants_output", "batch", "batch_output", "fine-tune",
            "fine-tune-results", "vision", "user_data", "evals")
# C0 and C1 control characters and DEL: never in a filename (PostgreSQL refuses NUL; a
# newline or an escape forges lines and terminals wherever the name is shown).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def install(app: FastAPI, deps: Deps, batches: Batches, hidden: RouteOptions) -> None:
    _list_route(app, deps, batches, hidden)
    _file_routes(app, deps, batches, hidden)


def _list_route(app: FastAPI, deps: Deps, batches: Batches, hidden: RouteOptions) -> None:
    @app.get("/v1/files", **hidden)
    async def list_files(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        purpose, after, limit, newest_first = _list_query(request)
        rows = await asyncio.to_thread(batches.list_files, tenant.id, purpose, after,
                                       limit + 1, newest_first)
        if rows is None:  # another tenant's id is answered as an unknown one
            raise bad("after", f"no file {after!r} (a cursor is the id of one of your files)")
        page = rows[:limit]
        return JSONResponse({"object": "list", "data": [file_json(f) for f in page],
                             "first_id": page[0].id if page else None,
                             "last_id": page[-1].id if page else None,
                             "has_more": len(rows) > limit})


def _file_routes(app: FastAPI, deps: Deps, batches: Batches, hidden: RouteOptions) -> None:
    @app.post("/v1/files", **hidden)
    async def upload(request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        ns, budget = deps.settings.namespace, deps.settings.tenant_upload_bytes_per_minute
        await check_upload_budget(deps.redis, ns, tenant.id, budget)
        read = [0]  # the body's bytes read, whatever the answer: what the upload cost
        try:
            form = await read_form(request, deps.settings, read)
        finally:
            await charge_upload(deps.redis, ns, tenant.id, read[0])
        record = await asyncio.to_thread(_store_upload, batches, deps.settings, tenant.id,
                                         form)
        return JSONResponse(file_json(record))

    async def own_file(file_id: str, request: Request) -> FileRecord:
        """The caller's file of that id; 404 for any other (another tenant's included)."""
        tenant = await authenticate(deps.store, request)
        record = await asyncio.to_thread(batches.get_file, file_id, tenant.id)
        if record is None:
            raise not_found("file")
        return record

    @app.get("/v1/files/{file_id}", **hidden)
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        return JSONResponse(file_json(await own_file(file_id, request)))

    @app.get("/v1/files/{file_id}/content", **hidden)
    async def file_content(file_id: str, request: Request) -> StreamingResponse:
        record = await own_file(file_id, request)
        # A sync iterator: Starlette pulls each part on a worker thread (a store read).
        return StreamingResponse(_encoded(batches.file_parts(record.id)),
                                 media_type="application/jsonl",
                                 headers={"Content-Length": str(record.bytes)})

    @app.delete("/v1/files/{file_id}", **hidden)
    async def delete_file(file_id: str, request: Request) -> JSONResponse:
        tenant = await authenticate(deps.store, request)
        done = await asyncio.to_thread(batches.delete_file, file_id, tenant.id)
        if not done.found:
            raise not_found("file")
        if done.in_use_by is not None:
            # Kept rather than pulled from under the batch: its lines are read from this
            # file until it ends (after a restart too), and a batch failing half-way for a
            # delete would be a worse surprise than this answer.
            raise ApiError(409, "file_id", f"file_id: {file_id} is the input of batch "
                           f"{done.in_use_by}, which has not ended; cancel the batch "
                           "(POST /v1/batches/{id}/cancel) or let it end, then delete "
                           "the file", kind="file_in_use")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _list_query(request: Request) -> tuple[str | None, str | None, int, bool]:
    """GET /v1/files' query, as OpenAI's: (purpose, after, limit, newest first)."""
    query = request.query_params
    raw = query.get("limit", str(MAX_LIST_FILES))
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= MAX_LIST_FILES):
        raise bad("limit", f"an integer from 1 to {MAX_LIST_FILES}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("order", "'asc' or 'desc'")
    purpose = query.get("purpose")
    if purpose is not None and purpose not in PURPOSES:
        raise bad("purpose", f"one of {', '.join(PURPOSES)}")
    return purpose, query.get("after"), int(raw), order == "desc"


def _encoded(slices: Iterator[str]) -> Iterator[bytes]:
    for piece in slices:
        yield piece.encode()


# -- the upload ----------------------------------------------------------------------


class Form:
    """A multipart upload as python-multipart's streaming parser hands it over: the file
    part's bytes (each line checked as it arrives) and the small fields' text."""

    def __init__(self, file_limit: int, line_limit: int) -> None:
        self.file_limit, self.line_limit = file_limit, line_limit
        self.fields: dict[str, str] = {}
        self.file: bytearray | None = None
        self.filename = ""
        self.ended = False
        self._parts = 0
        self._headers: dict[bytes, bytes] = {}
        self._header = [b"", b""]  # the header being read: name, value
        self._name = ""  # the current part's field name
        self._value = bytearray()  # the current field's value
        self._in_file = False
        self._line, self._line_bytes = 1, 0  # the file's current line, and its bytes so far

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {"on_part_begin": self._part_begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data,
                "on_part_end": self._part_end, "on_end": self._end}

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise bad("file", f"a multipart body of at most {MAX_PARTS} parts: the file, "
                      f"{', '.join(FIELDS)}")
        self._headers, self._header, self._value = {}, [b"", b""], bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header[0] += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header[1] += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header[0].lower()] = self._header[1]
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        self._in_file = b"filename" in options
        if self._in_file:
            if self._name != "file" or self.file is not None:
                raise bad("file", "one file part, named `file`, is expected")
            self.file = bytearray()
            self.filename = _filename(options[b"filename"])
        elif self._name not in FIELDS:
            raise bad(self._name.encode("unicode_escape").decode("ascii") or "file",
                      "unknown field")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if not self._in_file:
            if len(self._value) + end - start > MAX_FIELD_BYTES:
                raise bad(self._name, f"longer than {MAX_FIELD_BYTES} bytes")
            self._value += data[start:end]
            return
        assert self.file is not None
        if len(self.file) + end - start > self.file_limit:
            raise ApiError(413, "file", f"file: larger than the limit of {self.file_limit} "
                           "bytes")
        self._check_lines(data, start, end)
        self.file += data[start:end]

    def _check_lines(self, data: bytes, start: int, end: int) -> None:
        """Counts the file's lines as its bytes pass; one longer than the limit is refused
        before the rest of it is read. This runs on the event loop: a piece shorter than
        the room left on the current line is counted without a loop over its lines."""
        if self._line_bytes + end - start <= self.line_limit:
            last = data.rfind(b"\n", start, end)
            if last < 0:
                self._line_bytes += end - start
            else:
                self._line += data.count(b"\n", start, end)
                self._line_bytes = end - last - 1
            return
        while True:
            newline = data.find(b"\n", start, end)
            stop = end if newline < 0 else newline
            self._line_bytes += stop - start
            if self._line_bytes > self.line_limit:
                raise bad("file", f"line {self._line} is longer than the limit of "
                          f"{self.line_limit} bytes for a batch line")
            if newline < 0:
                return
            self._line, self._line_bytes, start = self._line + 1, 0, newline + 1

    def _part_end(self) -> None:
        if not self._in_file:
            self.fields[self._name] = self._value.decode("utf-8", "replace")

    def _end(self) -> None:
        self.ended = True


def _filename(raw: bytes) -> str:
    name = raw.decode("utf-8", "replace")
    if CONTROL.search(name):
        raise bad("file", "the filename may not hold control characters (NUL, newlines, "
                  "escapes: U+0000-U+001F, U+007F-U+009F)")
    return name[:255] or "batch.jsonl"


async def read_form(request: Request, settings: Settings, read: list[int]) -> Form:
    """The upload, read as it arrives and stopped at the first byte past a bound; `read[0]`
    counts its bytes as they come. An answer given before the body's end closes the
    connection (`Connection: close`), so the server does not read the rest of the body to
    keep it alive."""
    try:
        return await _read_form(request, settings, read)
    except ApiError as exc:
        exc.headers = {**exc.headers, "Connection": "close"}
        raise


async def _read_form(request: Request, settings: Settings, read: list[int]) -> Form:
    file_limit = settings.batch_max_file_bytes
    body_limit = file_limit + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > body_limit:
        raise ApiError(413, "file", f"file: larger than the limit of {file_limit} bytes")
    kind, params = parse_options_header(request.headers.get("content-type", ""))
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise bad("file", "expected a multipart/form-data body")
    form = Form(file_limit, settings.batch_max_line_bytes or settings.max_body_bytes)
    try:
        parser = MultipartParser(params[b"boundary"], form.callbacks())  # type: ignore[arg-type]
    except FormParserError:
        raise bad("file", "the multipart boundary is not valid") from None
    async for chunk in request.stream():
        read[0] += len(chunk)
        if read[0] > body_limit:
            raise ApiError(413, "file", f"file: larger than the limit of {file_limit} bytes")
        try:
            parser.write(chunk)
        except FormParserError as exc:
            raise bad("file", f"not a valid multipart/form-data body ({exc})") from None
    if not form.ended:
        raise bad("file", "the multipart body ended before its closing boundary")
    return form


def _store_upload(batches: Batches, settings: Settings, tenant_id: int,
                  form: Form) -> FileRecord:
    """The upload checked (400 naming the field) and stored, within the tenant's quotas."""
    if form.fields.get("purpose") != "batch":
        raise bad("purpose", "must be 'batch' (the files API here serves the Batch API)")
    if form.file is None:
        raise bad("file", "a file part is required")
    expires_s = min(settings.file_retention_days * DAY_S,
                    _upload_expiry(form.fields) or float("inf"))
    size = len(form.file)
    text = _request_text(form.file, settings)
    form.file = None  # the bytes go before the store gets the text: one copy at a time
    quota = FileQuota(settings.tenant_max_files, settings.tenant_max_file_bytes)
    record = batches.upload_file(tenant_id, "batch", form.filename, text, size, expires_s,
                                 quota)
    if isinstance(record, str):
        raise _file_quota(record, settings)
    return record


def _request_text(raw: bytearray, settings: Settings) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("file", "not UTF-8 text") from None
    check_text(text, ("file",))
    lines = len(request_lines(text))
    if lines == 0:
        raise bad("file", "holds no request lines")
    if lines > settings.batch_max_lines:
        raise bad("file", f"holds {lines} lines; a batch takes at most "
                  f"{settings.batch_max_lines}")
    return text


def _upload_expiry(fields: dict[str, str]) -> int | None:
    """`expires_after[anchor]` and `expires_after[seconds]`, as the openai SDK sends
    `expires_after`: the seconds, or None when the upload gave none."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    value = int(seconds) if seconds is not None and seconds.isascii() and seconds.isdigit() \
        else seconds
    return expires_after({"anchor": anchor, "seconds": value}, "expires_after")


def expires_after(value: object, field: str) -> int:
    """OpenAI's expiration policy, `{"anchor": "created_at", "seconds": N}`: N, checked."""
    if not isinstance(value, dict) or set(value) - {"anchor", "seconds"}:
        raise bad(field, 'expected {"anchor": "created_at", "seconds": N}')
    if value.get("anchor") != "created_at":
        raise bad(f"{field}.anchor", "must be 'created_at'")
    seconds, (low, high) = value.get("seconds"), EXPIRES_AFTER_S
    if isinstance(seconds, float) and seconds.is_integer():  # 3600.0 is JSON's 3600 too
        seconds = int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise bad(f"{field}.seconds", f"an integer from {low} to {high} (1 hour to 30 days)")
    return seconds


def output_expiry_s(value: object, settings: Settings) -> int:
    """A new batch's `output_expires_after` as the seconds its output and error files
    live: the batch's own choice, at most the deployment's retention (its default)."""
    limit = int(settings.batch_output_retention_days * DAY_S)
    return limit if value is None else min(limit, expires_after(value, "output_expires_after"))


# -- quotas --------------------------------------------------------------------------


def quota_exceeded(field: str | None, message: str) -> ApiError:
    """A tenant's quota is full: 429 as OpenAI answers a spent quota, with
    `x-should-retry: false` (the openai SDK would retry a 429; waiting frees nothing)."""
    return ApiError(429, field, message, kind="quota_exceeded",
                    headers={"x-should-retry": "false"})


def _file_quota(which: str, settings: Settings) -> ApiError:
    if which == "files":
        return quota_exceeded("file", f"quota: a tenant stores at most "
                              f"{settings.tenant_max_files} files "
                              "(TIDEGATE_TENANT_MAX_FILES); delete some (DELETE "
                              "/v1/files/{id}) or let them expire")
    return quota_exceeded("file", f"quota: a tenant stores at most "
                          f"{settings.tenant_max_file_bytes} bytes of files "
                          "(TIDEGATE_TENANT_MAX_FILE_BYTES); this file would pass it; "
                          "delete some (DELETE /v1/files/{id}) or let them expire")


def check_open_batches(batches: Batches, tenant_id: int, settings: Settings) -> None:
    """429 when the tenant has as many open batches as its quota allows."""
    if batches.open_batch_count(tenant_id) >= settings.tenant_max_open_batches:
        raise quota_exceeded(None, f"quota: a tenant has at most "
                             f"{settings.tenant_max_open_batches} batches not ended "
                             "(TIDEGATE_TENANT_MAX_OPEN_BATCHES); wait for one to end "
                             "or cancel one")


# -- shapes --------------------------------------------------------------------------


def request_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def file_json(record: FileRecord) -> JSONObject:
    expires = record.expires_at
    return {"id": record.id, "object": "file", "bytes": record.bytes,
            "created_at": int(record.created_at.timestamp()), "filename": record.filename,
            "purpose": record.purpose, "status": "processed",
            "expires_at": int(expires.timestamp()) if expires is not None else None,
            "status_details": None}
