"""Webhooks: a job's end POSTed to its `callback_url`, signed as the Standard Webhooks
specification says, by processes of their own (`tidegate webhooks`), never a GPU worker.

    outbox      the transaction that ends a job writes its delivery (store/runs.py),
                and so does the one that ends a batch (`batch.completed` and the like, to
                the tenant's webhook URL: store/batches.py `end_batch`)
    dispatcher  a thread of each webhook process, one at a time (a period lock,
                tidegate/locks.py): fails the deliveries past their give-up time, claims
                the due ones (at most CLAIM_PER_TENANT of a tenant's a period) for a lease
                longer than the worst attempt, and sends each as a Celery task on the
                webhooks queue
    task        one attempt (`Sender.attempt`): one in flight per delivery (a lock), a
                slot of the tenant's and of the host's (concurrency caps across every
                webhook process; a full cap defers the delivery, it does not fail it),
                the URL parsed and its addresses vetted once (tasks/webhook_urls.py),
                signed with each of the tenant's live secrets, POSTed to the vetted
                address within one total deadline, the answer read up to a cap
                (tasks/webhook_http.py), and the outcome recorded as a class, whatever
                was raised; a failure is due again after an exponential backoff with
                jitter, until `webhook_give_up_s` after the job's end

A delivery keeps its id (the `webhook-id` header) over every attempt, so a receiver
dedupes on it; a task lost with its process is claimed again when its lease lapses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from dataclasses import asdict
from datetime import UTC, datetime, timedelta

import redis
from celery import Celery
from kombu import Queue
from standardwebhooks.webhooks import Webhook

from store import JobRecord, Store
from store.webhooks import DeliveryRecord, Outcome, Sealer, Webhooks
from tasks.app import make_app, run_celery
from tasks.webhook_http import Answer, post
from tasks.webhook_urls import (
    CallbackUrl,
    ResolveFailed,
    Resolver,
    UrlMalformed,
    UrlRefused,
    check_parsed,
    check_url,
    parse_url,
    vet,
)
from tidegate import keys, redisconn, sealing
from tidegate.locks import RedisLock, new_token, take_period
from tidegate.logs import setup_logging
from tidegate.settings import Settings, get_settings

__all__ = ["UrlMalformed", "UrlRefused", "check_url"]  # the API's and the CLI's check

log = logging.getLogger("tidegate.webhooks")

DELIVER = "tidegate.webhook.deliver"
EVENT_TYPE = "job.ended"  # a batch's events: store/batches.py BATCH_EVENTS
CLAIM_LIMIT = 200  # deliveries the dispatcher sends a period
CLAIM_PER_TENANT = 50  # of which one tenant's at most: others' deliveries are never behind
MAX_BACKOFF_S = 3600.0


def webhook_queue(settings: Settings) -> str:
    return f"{settings.namespace}.webhooks"


def lease_s(settings: Settings) -> float:
    """A claim's lease, and the life of an attempt's lock and slots: longer than the
    worst attempt (its total deadline, DNS included) with room to record it and for the
    task's wait for a thread. A task that waited longer finds its delivery claimed again:
    `Webhooks.begin` and the in-flight lock make the second one a no-op."""
    return 2 * settings.webhook_timeout_s + 30


# -- what is sent ----------------------------------------------------------------------


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


def batch_body(delivery: DeliveryRecord) -> str:
    """A batch event's body, as OpenAI's webhooks send it: {id, object: "event",
    created_at, type (`batch.completed`, `batch.expired`, `batch.cancelled`,
    `batch.failed`), data: {id: the batch}}; the receiver reads the batch (GET
    /v1/batches/{id}) for the rest. Its id is the delivery's, the `webhook-id` header."""
    return json.dumps({"id": delivery.id, "object": "event",
                       "created_at": int(delivery.created_at.timestamp()),
                       "type": delivery.event, "data": {"id": delivery.batch_id}},
                      separators=(",", ":"))


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


# -- concurrency caps ------------------------------------------------------------------

# KEYS: slot sets; ARGV: now (ms), the slot's end (ms), the holder's token, then each
# set's cap. A set is a sorted set of holders scored by when their slot ends, so a
# holder that died frees its slot at that time; all slots are taken, or none.
TAKE_SLOTS = """
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[1])
  if redis.call('ZCARD', key) >= tonumber(ARGV[3 + i]) then return 0 end
end
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, ARGV[2], ARGV[3])
  redis.call('PEXPIREAT', key, ARGV[2])
end
return 1
"""


class Slots:
    """Deliveries in flight per tenant and per host, across every webhook process: one
    tenant's slow receivers hold at most its own slots, never every thread."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client, self.settings = client, settings
        self.ttl_ms = int(lease_s(settings) * 1000)
        self._take = client.register_script(TAKE_SLOTS)  # EVALSHA, loaded when missing

    def _keys(self, tenant_id: int, host: str) -> list[str]:
        ns = self.settings.namespace
        return [keys.webhook_slots(ns, "tenant", str(tenant_id)),
                keys.webhook_slots(ns, "host", host)]

    def take(self, tenant_id: int, host: str, token: str) -> bool:
        now = int(time.time() * 1000)
        caps = (self.settings.webhook_tenant_concurrency, self.settings.webhook_host_concurrency)
        return bool(self._take(keys=self._keys(tenant_id, host),
                               args=[now, now + self.ttl_ms, token, *caps]))

    def full_tenants(self, tenant_ids: set[int]) -> frozenset[int]:
        """Those of `tenant_ids` whose deliveries in flight fill their cap now."""
        if not tenant_ids:
            return frozenset()
        now, ns = int(time.time() * 1000), self.settings.namespace
        ordered = sorted(tenant_ids)
        pipe = self.client.pipeline(transaction=False)
        for tenant_id in ordered:
            pipe.zcount(keys.webhook_slots(ns, "tenant", str(tenant_id)), now, "+inf")
        counts = pipe.execute()
        cap = self.settings.webhook_tenant_concurrency
        return frozenset(t for t, n in zip(ordered, counts, strict=True) if int(n) >= cap)

    def release(self, tenant_id: int, host: str, token: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key in self._keys(tenant_id, host):
            pipe.zrem(key, token)
        pipe.execute()


# -- one attempt -----------------------------------------------------------------------


class Sender:
    """What a webhook process's tasks share: the store, Redis (locks and slots), the
    secrets' sealer and the resolver (socket.getaddrinfo unless one is given)."""

    def __init__(self, store: Store, client: redis.Redis, settings: Settings,
                 sealer: Sealer | None = None, resolve: Resolver | None = None) -> None:
        self.store, self.client, self.settings, self.resolve = store, client, settings, resolve
        self.hooks = Webhooks(store, sealer or sealing.sealer(settings))
        self.slots = Slots(client, settings)

    def attempt(self, delivery_id: str) -> str:
        """One POST of a claimed delivery, recorded whatever happens. Returns what did."""
        lease = lease_s(self.settings)
        delivery = self.hooks.begin(delivery_id, timedelta(seconds=lease))
        if delivery is None:
            return "nothing to do"
        lock = RedisLock(self.client, keys.webhook_sending(self.settings.namespace, delivery_id),
                         ttl_s=lease)
        try:
            if not lock.acquire():
                return "in flight elsewhere"
        except redis.RedisError:  # no lock and no caps now: later
            return self._defer(delivery)
        try:
            return self._attempt(delivery)
        finally:
            with contextlib.suppress(redis.RedisError):  # it lapses with the lease
                lock.release()

    def _attempt(self, delivery: DeliveryRecord) -> str:
        started = time.monotonic()
        try:
            url = parse_url(delivery.url)
        except UrlRefused:  # a URL from before the strict parse (or a tenant's default)
            return self._record(delivery, Answer(Outcome.REFUSED_BY_POLICY), started)
        token = new_token("webhook")
        try:
            slotted = self.slots.take(delivery.tenant_id, url.host, token)
        except redis.RedisError:
            slotted = False
        if not slotted:
            return self._defer(delivery)
        try:
            answer = self._send(delivery, url, started + self.settings.webhook_timeout_s)
        except Exception:  # a bug: recorded as a failed attempt, never left to loop
            log.exception("webhook %s: the attempt raised", delivery.id)
            answer = Answer(Outcome.ERROR)
        finally:
            with contextlib.suppress(redis.RedisError):  # it lapses with the lease
                self.slots.release(delivery.tenant_id, url.host, token)
        return self._record(delivery, answer, started)

    def _send(self, delivery: DeliveryRecord, url: CallbackUrl, deadline: float) -> Answer:
        if delivery.job_id is None:  # a batch's event: its body is the delivery's own
            body = batch_body(delivery)
        else:
            job = self.store.jobs.get_job(delivery.job_id)
            if job is None:
                return Answer(Outcome.JOB_GONE)
            body = body_of(job)
        secrets_ = self._secrets(delivery.tenant_id)
        if not secrets_:
            return Answer(Outcome.NO_SIGNING_SECRET)
        proxy = self.settings.webhook_proxy_url
        addresses = None  # through a proxy: the proxy resolves, and decides
        try:
            if proxy:
                check_parsed(url, self.settings)
            else:
                addresses = vet(url, self.settings, deadline, self.resolve)
        except UrlRefused:
            return Answer(Outcome.REFUSED_BY_POLICY)
        except ResolveFailed as exc:
            return Answer(Outcome.TIMEOUT if exc.timed_out else Outcome.CONNECT_FAILED)
        return post(url, addresses, body.encode(), signed_headers(delivery.id, body, secrets_),
                    deadline, proxy)

    def _secrets(self, tenant_id: int) -> list[str]:
        try:
            return self.hooks.secrets_of(tenant_id)
        except (sealing.InvalidToken, sealing.KeyMissing) as exc:
            log.error("tenant %d's webhook secrets cannot be opened with this process's key "
                      "(%s): %s", tenant_id, type(exc).__name__, sealing.KEY_HELP)
            return []

    def _defer(self, delivery: DeliveryRecord) -> str:
        wait_s = max(1.0, self.settings.webhook_dispatch_s) * random.uniform(1.0, 2.0)
        self.hooks.defer(delivery.id, datetime.now(UTC) + timedelta(seconds=wait_s))
        return "deferred"

    def _record(self, delivery: DeliveryRecord, answer: Answer, started: float) -> str:
        settings = self.settings
        due = datetime.now(UTC) + timedelta(seconds=backoff_s(delivery.attempts + 1,
                                                              settings.webhook_backoff_s))
        give_up = delivery.created_at + timedelta(seconds=settings.webhook_give_up_s)
        after = self.hooks.record_attempt(delivery.id, answer.status_code, answer.outcome,
                                          (time.monotonic() - started) * 1000,
                                          due if due < give_up else None)
        outcome = after.status if after is not None else "already settled"
        log.info("webhook %s of %s %s: attempt %d, %s, %s", delivery.id,
                 "job" if delivery.job_id else "batch", delivery.job_id or delivery.batch_id,
                 delivery.attempts + 1, answer.outcome.value, outcome,
                 extra={"job_id": delivery.job_id} if delivery.job_id else {})
        return outcome


# -- the process -----------------------------------------------------------------------


def make_webhook_app(settings: Settings, sender: Sender) -> Celery:
    app = make_app(settings)
    app.conf.task_queues = [Queue(webhook_queue(settings))]
    app.conf.task_default_queue = webhook_queue(settings)

    @app.task(name=DELIVER, ignore_result=True, acks_late=False)
    def _deliver(delivery_id: str) -> str:
        return sender.attempt(delivery_id)

    return app


def dispatch(app: Celery, client: redis.Redis, store: Store, settings: Settings) -> int:
    """Send the due deliveries to the webhook queue, if this process holds the period."""
    period = int(time.time() // settings.webhook_dispatch_s)
    lock = keys.scheduler_lock(settings.namespace, "webhooks", period)
    if not take_period(client, lock, settings.webhook_dispatch_s):
        return 0
    hooks = Webhooks(store)
    # A tenant whose slots are all held (its receivers are slow) is not claimed at all:
    # each claim would only be deferred, and that churn would be the sender's work spent
    # on the slowest tenant. A tenant is claimed at most its cap a period, for the same.
    full = Slots(client, settings).full_tenants(hooks.due_tenants())
    due = hooks.claim_due(timedelta(seconds=lease_s(settings)), CLAIM_LIMIT,
                          timedelta(seconds=settings.webhook_give_up_s),
                          min(CLAIM_PER_TENANT, settings.webhook_tenant_concurrency), full)
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
    store = Store(settings.db_url, **settings.store_timeouts)
    try:
        sealer = sealing.sealer(settings)
    except sealing.KeyMissing as exc:
        raise SystemExit(f"tidegate webhooks: {exc}") from None
    sealed = Webhooks(store, sealer).seal_plain()
    if sealed:
        log.info("sealed %d webhook secrets stored before sealing", sealed)
    sender = Sender(store, redisconn.sync_client(settings.redis_url), settings, sealer)
    app = make_webhook_app(settings, sender)
    threading.Thread(target=_dispatch_forever, args=(app, settings, store), daemon=True,
                     name="webhook-dispatch").start()
    run_celery(app, ["worker", "-P", "threads", "-c", str(settings.webhook_concurrency),
                     "-Q", webhook_queue(settings), "-n", f"webhooks-{int(time.time())}@%h",
                     "--loglevel", loglevel, "--without-gossip", "--without-mingle"])
