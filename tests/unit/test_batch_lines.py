"""A batch's input lines are parsed one at a time, as the driver needs them
(api/batch_lines.py), with the same verdicts as a parse of the whole file, and nothing a
line holds raises."""

from __future__ import annotations

import json

from api.batch_lines import BatchInput, parse_lines

CHAT = "/v1/chat/completions"


def request(custom_id: object, **extra: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": "chat", "messages": []}, **extra})


RAW = [request("a"), "this is not json", request("b"), "[1, 2]", request("a"),
       request(""), request("c", method="GET"), request("b"), "[" * 100_000, request("d")]
VERDICTS = [None, "not valid JSON", None, "not a JSON object",
            "custom_id: 'a' is used by an earlier line",
            "custom_id: a non-empty string is required", "method: must be 'POST'",
            "custom_id: 'b' is used by an earlier line", "not valid JSON", None]


def test_each_line_gets_its_verdict_and_none_raises() -> None:
    assert [line.error for line in parse_lines(RAW, CHAT)] == VERDICTS


def test_a_line_read_alone_knows_the_custom_ids_before_it() -> None:
    # As a driver that took over half-way reads it: the lines before are never parsed
    # into requests, yet a custom_id they used still makes a later line a duplicate.
    for i in (7, 4, 9, 0):
        source = BatchInput(RAW, CHAT)
        assert source.line(i).error == VERDICTS[i], i
    source = BatchInput(RAW, CHAT)
    assert [source.line(i).error for i in reversed(range(len(RAW)))] == VERDICTS[::-1]


def test_a_line_keeps_its_custom_id_and_body() -> None:
    line = BatchInput(RAW, CHAT).line(2)
    assert line.custom_id == "b" and line.body == {"model": "chat", "messages": []}
