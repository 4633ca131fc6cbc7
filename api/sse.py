"""The bytes of a server-sent event stream, for both front doors that stream a job: the jobs
API's frames (each job event with its id, and an `error` event of the stream's own) and
the OpenAI routes' `data:` chunks. No I/O here: api/jobstream.py reads the events,
api/job_sse.py and api/openai_stream.py render them with these."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from api.streamhub import Entry
from tidegate import keys
from tidegate.events import TERMINAL, Event

KEEPALIVE = b": keep-alive\n\n"  # a comment line: no event, keeps proxies from timing out
TERMINAL_KINDS = frozenset(kind.encode() for kind in TERMINAL)


def kind_of(fields: Mapping[bytes, bytes]) -> bytes:
    return fields.get(b"k") or Event.from_json(fields[b"e"]).kind.encode()  # entries without it


def job_frames(entries: Sequence[Entry]) -> tuple[bytes, bool]:
    """Stream entries as SSE frames in one chunk (one write for all that were waiting), and
    whether a terminal event ended them. The event's JSON goes out as the worker stored it:
    only its kind is read, from the entry's own field, so a token costs no parse."""
    out = bytearray()
    for entry_id, fields in entries:
        kind = kind_of(fields)
        out += b"id: %d\nevent: %s\ndata: %s\n\n" % (keys.seq_of(entry_id), kind, fields[b"e"])
        if kind in TERMINAL_KINDS:
            return bytes(out), True
    return bytes(out), False


def data_frame(body: Mapping[str, object]) -> bytes:
    """One OpenAI chunk: `data:` and its compact JSON (non-ASCII text as it is)."""
    return b"data: %s\n\n" % json.dumps(body, ensure_ascii=False,
                                          separators=(",", ":")).encode()


def error_frame(code: str, message: str, *, openai: bool = False) -> bytes:
    """The frame that ends a stream in error. The jobs API's: an `error` event with no id
    (the client's Last-Event-ID stays its last job event) and data {"code", "message"}.
    OpenAI's: a chunk holding `error`, which the SDK raises."""
    if openai:
        return data_frame({"error": {"message": message, "type": "server_error",
                                     "param": None, "code": code}})
    return b"event: error\ndata: %s\n\n" % json.dumps({"code": code,
                                                         "message": message}).encode()
