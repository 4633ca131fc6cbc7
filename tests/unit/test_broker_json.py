"""workers/broker.py's JSON for kombu: orjson where it reads and writes what kombu's own
does, kombu's own everywhere else (its typed values, NaN)."""

from __future__ import annotations

import datetime
import decimal
import math

from kombu.utils import json as kombu_json

from workers.broker import fast_dumps, fast_loads


def test_plain_messages_read_back_as_kombus_json_reads_them() -> None:
    message = [{"body": "eyJqb2IiOiAxfQ==", "content-encoding": "utf-8",
                "headers": {"id": "job-1", "retries": 0, "eta": None, "x\u00e9": [1, 2.5]},
                "properties": {"priority": 5, "delivery_tag": "d-1"}}, "", "chat.vllm"]
    assert kombu_json.loads(fast_dumps(message)) == message
    assert fast_loads(kombu_json.dumps(message).encode()) == message
    assert fast_loads(fast_dumps(message)) == message


def test_kombus_typed_values_keep_kombus_encoding() -> None:
    value = {"at": datetime.datetime(2026, 12, 6, 23, 0), "amount": decimal.Decimal("1.5")}
    assert fast_dumps(value) == kombu_json.dumps(value)
    assert fast_loads(fast_dumps(value)) == value


def test_what_only_the_standard_json_reads_still_reads() -> None:
    nan = fast_loads(b'{"x": NaN}')["x"]
    assert math.isnan(nan)
    assert fast_loads('{"big": 123456789012345678901234567890}')["big"] == \
        123456789012345678901234567890
