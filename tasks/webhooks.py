"""Webhooks: a job's end POSTed to its `callback_url`, signed as the Standard Webhooks
specification says, by processes of their own (`tidegate webhooks`), never a GPU worker.

    outbox      the transaction that ends a job writes its delivery (store/db.py `_ended`)
    dispatcher  a thread of each webhook process, one at a time (a Redis lock per
                period): claims the due deliveries and sends each as a Celery task on the
                webhooks queue
    task        one attempt: check the URL's addresses against the policy, sign with
                each of the tenant's live secrets, POST with a timeout, record the
                attempt; a failure is due again after an exponential backoff with
                jitter, until `webhook_give_up_s` after the job's end

A delivery keeps its id (the `webhook-id` header) over every attempt, so a receiver
dedupes on it; a task lost with its process is claimed again when its lease lapses.

The URL policy (`check_url`): http or https, a host, and no private, loopback,
link-local or otherwise non-public address unless `TIDEGATE_WEBHOOK_ALLOW_PRIVATE` (or
the host is in `TIDEGATE_WEBHOOK_ALLOW_HOSTS`); hosts in `TIDEGATE_WEBHOOK_DENY_HOSTS`
never. The API checks what it can without DNS at submit (400 naming `callback_url`); a
delivery resolves the host and checks every address before it connects.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import socket
import threading
import time
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from celery import Celery
from kombu import Queue
from standardwebhooks.webhooks import Webhook

from store import JobRecord, Store
from store.webhooks import DeliveryRecord, Webhooks
from tasks.app import make_app, run_celery
from tidegate import keys, redisconn
from tidegate.logs import setup_logging
from tidegate.settings import Settings, get_settings

log = logging.getLogger("tidegate.webhooks")

DELIVER = "tidegate.webhook.deliver"
EVENT_TYPE = "job.ended"
CLAIM_LIMIT = 200  # deliveries the dispatcher sends a period
MAX_BACKOFF_S = 3600.0
MAX_URL = 2048


class UrlRefused(ValueError):
    """A callback URL the policy refuses; the message says why."""


def webhook_queue(settings: Settings) -> str:
    return f"{settings.namespace}.webhooks"


# -- the URL policy --------------------------------------------------------------------


def check_url(url: str, settings: Settings, resolve: bool = False) -> str:
    """The URL's host, if the policy allows it; UrlRefused otherwise. Without `resolve`,
    only an address literal (or `localhost`) is checked against the private ranges."""
    if len(url) > MAX_URL:
        raise UrlRefused(f"longer than {MAX_URL} characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UrlRefused("must be an http:// or https:// URL with a host")
    host = parts.hostname.lower()
    if host in _hosts(settings.webhook_deny_hosts):
        raise UrlRefused(f"host {host!r} is denied (TIDEGATE_WEBHOOK_DENY_HOSTS)")
    if settings.webhook_allow_private or host in _hosts(settings.webhook_allow_hosts):
        return host
    for address in _addresses(host, parts.port, resolve):
        if not address.is_global:
            raise UrlRefused(f"host {host!r} is a private, loopback or reserved address "
                             f"({address}); TIDEGATE_WEBHOOK_ALLOW_PRIVATE allows it")
    return host


def _hosts(setting: str) -> set[str]:
    return {h.strip().lower() for h in setting.split(",") if h.strip()}


def _addresses(host: str, port: int | None,
               resolve: bool) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    if host == "localhost" or host.endswith(".localhost"):
        return [ipaddress.ip_address("127.0.0.1")]
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    if not resolve:
        return []
    try:
        infos = socket.getaddrinfo(host, port or 443, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise UrlRefused(f"host {host!r} does not resolve ({exc})") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


# -- one attempt -----------------------------------------------------------------------


def body_of(job: JobRecord) -> str:
    """The webhook's body: Standard Webhooks' {type, timestamp, data}, data the job's
    terminal record as GET /v1/jobs/{id} shows it."""
    data = asdict(job)
    for hidden in ("tenant_id", "idempotency_key"):
        data.pop(hidden, None)
    for name, value in data.items():
        if isinstance(value, datetime):
            data[name] = value.isoformat()
    stamp = (job.finished_at or datetime.now(UTC)).isoformat()
    return json.dumps({"type": EVENT_TYPE, "timestamp": stamp, "data": data},
                      ensure_ascii=False, separators=(",", ":"))


def signed_headers(delivery_id: str, body: str, secrets_: list[str]) -> dict[str, str]:
    """webhook-id, webhook-timestamp and a signature by each live secret (the receiver
    accepts any one: a rotation's overlap)."""
    now = datetime.now(UTC)
    signatures = " ".join(Webhook(secret).sign(delivery_id, now, body) for secret in secrets_)
    return {"webhook-id": delivery_id, "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": signatures, "content-type": "application/json",
            "user-agent": "tidegate-webhooks"}


def backoff_s(attempt: int, base_s: float) -> float:
    """Exponential, capped at an hour, with full jitter in [0.5, 1.5) of it."""
    return min(base_s * 2 ** (attempt - 1), MAX_BACKOFF_S) * random.uniform(0.5, 1.5)


def attempt(delivery_id: str, store: Store, settings: Settings) -> str:
    """One POST of a delivery; its outcome is recorded. Returns what happened."""
    hooks = Webhooks(store)
    delivery = hooks.get(delivery_id)
    if delivery is None or delivery.status in ("delivered", "failed"):
        return "nothing to do"
    job = store.get_job(delivery.job_id)
    secrets_ = hooks.secrets_of(delivery.tenant_id)
    if job is None or not secrets_:
        why = "the job is gone" if job is None else "the tenant has no signing secret"
        return _record(hooks, delivery, None, why, 0.0, settings)
    started = time.monotonic()
    try:
        check_url(delivery.url, settings, resolve=True)
        body = body_of(job)
        resp = httpx.post(delivery.url, content=body.encode(), timeout=settings.webhook_timeout_s,
                          headers=signed_headers(delivery.id, body, secrets_),
                          follow_redirects=False)
        status, error = resp.status_code, None if resp.is_success else f"HTTP {resp.status_code}"
    except (httpx.HTTPError, UrlRefused) as exc:
        status, error = None, f"{type(exc).__name__}: {exc}"[:500]
    return _record(hooks, delivery, status, error, (time.monotonic() - started) * 1000,
                   settings)


def _record(hooks: Webhooks, delivery: DeliveryRecord, status: int | None, error: str | None,
            duration_ms: float, settings: Settings) -> str:
    due = datetime.now(UTC) + timedelta(seconds=backoff_s(delivery.attempts + 1,
                                                          settings.webhook_backoff_s))
    give_up = delivery.created_at + timedelta(seconds=settings.webhook_give_up_s)
    after = hooks.record_attempt(delivery.id, status, error, duration_ms,
                                 due if due < give_up else None)
    outcome = after.status if after is not None else "already settled"
    log.info("webhook %s of job %s: attempt %d, %s, %s", delivery.id, delivery.job_id,
             delivery.attempts + 1, status or error, outcome,
             extra={"job_id": delivery.job_id})
    return outcome


# -- the process -----------------------------------------------------------------------


def make_webhook_app(settings: Settings, store: Store) -> Celery:
    app = make_app(settings)
    app.conf.task_queues = [Queue(webhook_queue(settings))]
    app.conf.task_default_queue = webhook_queue(settings)

    @app.task(name=DELIVER, ignore_result=True, acks_late=False)
    def _deliver(delivery_id: str) -> str:
        return attempt(delivery_id, store, settings)

    return app


def dispatch(app: Celery, client: Any, store: Store, settings: Settings) -> int:
    """Send the due deliveries to the webhook queue, if this process holds the period."""
    period = int(time.time() // settings.webhook_dispatch_s)
    lock = keys.scheduler_lock(settings.namespace, "webhooks", period)
    if not client.set(lock, "1", nx=True, px=int(settings.webhook_dispatch_s * 2000)):
        return 0
    lease = timedelta(seconds=settings.webhook_timeout_s * 3 + 30)
    due = Webhooks(store).claim_due(lease, CLAIM_LIMIT)
    for delivery in due:
        app.send_task(DELIVER, args=[delivery.id], queue=webhook_queue(settings))
    return len(due)


def _dispatch_forever(app: Celery, settings: Settings, store: Store) -> None:
    client = redisconn.sync_client(settings.redis_url)
    while True:
        try:
            dispatch(app, client, store, settings)
        except Exception as exc:  # an outage: the next period tries again
            log.warning("webhook dispatch failed (%s)", type(exc).__name__)
        time.sleep(settings.webhook_dispatch_s)


def run_webhook_worker(loglevel: str = "INFO") -> None:
    """`tidegate webhooks`: the delivery tasks on threads, and the dispatcher."""
    settings = get_settings()
    setup_logging(settings, "webhooks")
    store = Store(settings.db_url)
    app = make_webhook_app(settings, store)
    threading.Thread(target=_dispatch_forever, args=(app, settings, store), daemon=True,
                     name="webhook-dispatch").start()
    run_celery(app, ["worker", "-P", "threads", "-c", str(settings.webhook_concurrency),
                     "-Q", webhook_queue(settings), "-n", f"webhooks-{int(time.time())}@%h",
                     "--loglevel", loglevel, "--without-gossip", "--without-mingle"])
