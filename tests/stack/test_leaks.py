"""Isolation and hygiene (issue 10, finding 11), on the session's stack:

- a job's prompt and output appear in no Celery event (what Flower records), in no
  answer of `inspect` (what Flower's worker page shows), in no log file of the run, and
  an isolated lane keeps no tenant's system prompt in Redis;
- tenants do not share the prefix cache: a tenant's `cached_tokens` says nothing of
  another tenant's prompt, while its own repeat still hits;
- hot prefixes (a sharing lane's system prompts) expire after their last use.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from tidegate_client import Client

from store import JobRecord
from tests.helpers import Stack, celery_on, make_tenant
from tidegate import hot, keys
from tidegate_tools.procs import wait_until

LANE = "finance"  # isolated, as every lane is by default


class EventTap:
    """Every Celery event on the broker while open, as Flower's receiver gets them."""

    def __init__(self, app: Celery) -> None:
        self.events: list[dict[str, Any]] = []
        self._conn = app.connection_for_read()
        self._receiver = app.events.Receiver(self._conn, handlers={"*": self.events.append})
        self._thread = threading.Thread(target=self._receiver.capture, daemon=True,
                                        kwargs={"limit": None, "timeout": None, "wakeup": True})

    def __enter__(self) -> EventTap:
        self._thread.start()
        # Events travel over pub/sub: only a subscribed receiver gets them. Workers send a
        # heartbeat event every few seconds (and one at once for `wakeup`).
        wait_until(lambda: bool(self.events), 30, "the first Celery event")
        return self

    def __exit__(self, *_: object) -> None:
        self._receiver.should_stop = True
        self._thread.join(timeout=10)
        self._conn.release()

    def saw(self, kind: str, job_id: str) -> bool:
        return any(e.get("type") == kind and e.get("uuid") == job_id for e in self.events)


def inspect_replies(app: Celery, worker: str, job_id: str) -> dict[str, Any]:
    """What Flower asks a worker for its page: tasks active, reserved, and one by id."""
    inspect = app.control.inspect(destination=[worker], timeout=2)
    return {"active": inspect.active(), "reserved": inspect.reserved(),
            "query_task": inspect.query_task(job_id)}


def log_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def hot_keys_text(stack: Stack, lane: str) -> str:
    """Everything Redis holds under the lane's hot-prefix keys, as text."""
    parts = []
    for key in stack.redis.scan_iter(match=f"{keys.hot_prefixes(stack.namespace, lane)}*"):
        kind = stack.redis.type(key)
        if kind == b"zset":
            parts += [m.decode() for m in stack.redis.zrange(key, 0, -1)]
        elif kind == b"string":
            parts.append(stack.redis.get(key).decode())  # type: ignore[union-attr]
    return "\n".join(parts)


def test_no_prompt_or_output_in_events_flower_or_logs(stack: Stack, tmp_root: Path) -> None:
    marks = [f"sysmark{uuid.uuid4().hex}", f"usermark{uuid.uuid4().hex}"]
    messages = [{"role": "system", "content": f"You audit ledgers. Case {marks[0]}."},
                {"role": "user", "content": f"Summarise invoice {marks[1]} for me."}]
    app, worker = celery_on(stack.broker_url), stack.workers[LANE]
    seen: list[dict[str, Any]] = []
    with EventTap(app) as tap, Client(stack.base_url, stack.api_key) as client:
        job_id = client.submit(LANE, messages=messages, max_tokens=600, seed=3)["job_id"]

        def inspected_while_running() -> bool:
            seen.append(inspect_replies(app, worker, job_id))
            return job_id in json.dumps(seen[-1]["active"])

        wait_until(inspected_while_running, 60, "the job to show in `inspect active`")
        assert list(client.stream(job_id))[-1].kind == "done"
        wait_until(lambda: tap.saw("task-succeeded", job_id), 30, "the task-succeeded event")
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "done" and row.completion_tokens == 600
    assert row.output_text and len(row.output_text) >= 32
    texts = [*marks, row.output_text]
    assert tap.saw("task-received", job_id)  # the events that carry arguments were captured
    captured = {"events": json.dumps(tap.events, default=str),
                "inspect": json.dumps(seen, default=str),
                "redis hot prefixes": hot_keys_text(stack, LANE)}
    for path in log_files(tmp_root / "logs"):
        captured[str(path)] = path.read_bytes().decode("utf-8", errors="replace")
    leaks = [(where, text[:20]) for where, body in captured.items() for text in texts
             if text in body]
    assert not leaks, f"prompt or output text found in: {leaks}"


def run_one(stack: Stack, key: str, prompt: str) -> JobRecord:
    with Client(stack.base_url, key) as client:
        job_id = client.submit(LANE, prompt=prompt, max_tokens=1)["job_id"]
        assert list(client.stream(job_id))[-1].kind == "done"
    row = stack.store.jobs.get_job(job_id)
    assert row is not None and row.status == "done"
    return row


def test_tenants_do_not_share_the_prefix_cache(stack: Stack) -> None:
    _, other_key = make_tenant(stack.store, f"leaks-other-{uuid.uuid4().hex[:8]}", [LANE])
    # New to the engine, and several KV blocks long whatever the block size (128 on CPU).
    prompt = f"Account {uuid.uuid4().hex}. " + "Revenue rose while invoice totals fell. " * 60
    first = run_one(stack, stack.api_key, prompt)
    other = run_one(stack, other_key, prompt)
    again = run_one(stack, stack.api_key, prompt)
    assert first.worker == other.worker == again.worker  # one engine, one prefix cache
    assert first.prompt_tokens >= 512
    assert (again.cached_tokens or 0) >= 256, "the tenant's own repeat should hit its cache"
    assert other.cached_tokens == 0, (
        f"another tenant found {other.cached_tokens} of this tenant's prompt tokens cached")


def test_hot_prefixes_expire_after_their_last_use(stack: Stack) -> None:
    ns, lane = stack.namespace, f"hot-{uuid.uuid4().hex[:8]}"
    prefix = f"<system>You answer about parcels {uuid.uuid4().hex}.</system>"
    text_key = keys.hot_prefix_text(ns, lane, hashlib.sha256(prefix.encode()).hexdigest())
    ranking = keys.hot_prefixes(ns, lane)

    def use(ttl_s: int) -> None:
        pipe = stack.redis.pipeline(transaction=False)
        hot.record(pipe, ns, lane, prefix, ttl_s)
        pipe.execute()

    use(600)
    assert hot.read(stack.redis, ns, lane, 5) == [prefix]
    assert 0 < stack.redis.ttl(text_key) <= 600 and 0 < stack.redis.ttl(ranking) <= 600
    assert prefix.encode() not in stack.redis.zrange(ranking, 0, -1)  # digests only
    stack.redis.expire(text_key, 5)  # as if it had been last used long ago ...
    use(600)  # ... and is used again: its lifetime starts over
    assert stack.redis.ttl(text_key) > 5
    use(1)  # a last use, after which it lapses
    wait_until(lambda: not stack.redis.exists(text_key, ranking), 10, "the hot prefix to expire")
    assert hot.read(stack.redis, ns, lane, 5) == []
