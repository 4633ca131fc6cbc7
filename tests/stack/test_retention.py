"""What is kept, and for how long: the scheduler's purge (scheduler/retention.py), driven
here directly at a chosen moment (`now`), never by waiting. A batch's output files carry
the expiry its `output_expires_after` asked for and go after it; an uploaded file goes after
its retention unless a batch not ended reads it; a job's output text goes after its
retention while its row and usage stay; the beat runs the purge once per period. The API
and the batch driver run in this process, on its own Redis database."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import openai
import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from scheduler import retention
from scheduler.service import make_scheduler_app, purge_pass
from store import Store, upgrade, utcnow
from store.batches import Batches, FileQuota
from store.models import File
from tests.helpers import own_redis_url, running_driver
from tests.stack.test_openai_validation import advertise_chat_worker
from tidegate import keys
from tidegate.records import JobStatus
from tidegate.settings import Settings
from tidegate_tools.procs import wait_until

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)


@dataclass
class Api:
    sdk: openai.OpenAI
    store: Store
    settings: Settings
    tenant_id: int


@pytest.fixture(scope="module")
def api(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[Api]:
    url = f"sqlite:///{tmp_root / 'retention.db'}"
    upgrade(url)
    redis_url = own_redis_url(redis_server, __name__, "8")
    settings = Settings(redis_url=redis_url, database_url=url, namespace="tgretention",
                        batch_poll_s=0.05)
    store = Store(url)
    tenant, key = store.tenants.create_tenant("retention", ["chat", "batch"])
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    advertise_chat_worker(client, settings)
    try:
        with TestClient(create_app(settings)) as http, running_driver(settings):
            sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=key,
                                http_client=http, max_retries=0)
            yield Api(sdk, store, settings, tenant.id)
    finally:
        client.flushdb()


def request_lines(count: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": {"model": "chat", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "Hello?"}]}})
                   + "\n" for i in range(count)).encode()


def run_batch(api: Api, **create: object) -> openai.types.Batch:
    """A two-line batch, its jobs ended as a worker ends them, driven to `completed`."""
    upload = api.sdk.files.create(file=("in.jsonl", io.BytesIO(request_lines(2))),
                                  purpose="batch")
    batch = api.sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                   completion_window="24h", **create)  # type: ignore[arg-type]
    prefix = f"{batch.id}:"
    wait_until(lambda: len(line_jobs(api, prefix)) == 2, 20, "the driver to submit the lines")
    for job in line_jobs(api, prefix):
        api.store.runs.claim_job(job.id, "chat-batch@test", "vllm")
        api.store.runs.end_job(job.id, JobStatus.DONE, finish_reason="length", output_text="fine",
                               completion_tokens=2)
    wait_until(lambda: api.sdk.batches.retrieve(batch.id).status == "completed", 20,
               "the driver to complete the batch")
    return api.sdk.batches.retrieve(batch.id)


def line_jobs(api: Api, prefix: str) -> list:
    return [job for job in api.store.jobs.list_jobs(api.tenant_id)
            if (job.idempotency_key or "").startswith(prefix)]


def file_gone(api: Api, file_id: str) -> bool:
    try:
        api.sdk.files.retrieve(file_id)
    except openai.NotFoundError:
        return True
    return False


# -- files -------------------------------------------------------------------------------


def test_output_expires_after_gives_the_output_file_its_expiry_and_the_purge_keeps_it(
        api: Api) -> None:
    done = run_batch(api, extra_body={"output_expires_after": {"anchor": "created_at",
                                                               "seconds": 7200}})
    assert done.output_file_id is not None
    output = api.sdk.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 7200
    uploaded = api.sdk.files.retrieve(done.input_file_id)
    assert uploaded.expires_at == uploaded.created_at + 30 * 86400  # the default retention
    assert retention.purge(api.store, api.settings, now=utcnow() + HOUR)["files"] == 0
    assert api.sdk.files.content(done.output_file_id).text.count("\n") == 2
    removed = retention.purge(api.store, api.settings, now=utcnow() + 3 * HOUR)
    assert removed["files"] >= 1
    assert file_gone(api, done.output_file_id)
    assert not file_gone(api, done.input_file_id)  # its own retention is 30 days


def test_output_files_without_output_expires_after_expire_after_the_default(
        api: Api) -> None:
    done = run_batch(api)
    assert done.output_file_id is not None
    output = api.sdk.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 30 * 86400
    with pytest.raises(openai.BadRequestError) as caught:
        api.sdk.batches.create(input_file_id=done.input_file_id,
                               endpoint="/v1/chat/completions", completion_window="24h",
                               extra_body={"output_expires_after": {"anchor": "created_at",
                                                                    "seconds": 60}})
    assert caught.value.param == "output_expires_after.seconds"


@dataclass
class Db:
    """A store with no API and no batch driver on it: its batches stay as a test puts
    them."""

    store: Store
    batches: Batches
    settings: Settings
    tenant_id: int


@pytest.fixture(scope="module")
def db(redis_server: str, tmp_root: Path) -> Iterator[Db]:
    url = f"sqlite:///{tmp_root / 'retention-store.db'}"
    upgrade(url)
    store = Store(url)
    tenant, _ = store.tenants.create_tenant("retention-store", ["chat", "batch"])
    settings = Settings(redis_url=own_redis_url(redis_server, __name__, "8"), database_url=url,
                        namespace="tgretentionstore")
    try:
        yield Db(store, Batches(store), settings, tenant.id)
    finally:
        redis.Redis.from_url(settings.redis_url).flushdb()
        store.close()


def uploaded(db: Db, name: str) -> str:
    """A file as POST /v1/files stores it: expiring after the upload retention."""
    record = db.batches.upload_file(db.tenant_id, "batch", name, request_lines(1).decode(),
                                    len(request_lines(1)), 30 * 86400,
                                    FileQuota(files=1000, bytes=10**9))
    assert not isinstance(record, str)
    return record.id


def test_an_uploaded_file_goes_after_its_retention_unless_an_open_batch_reads_it(
        db: Db) -> None:
    reads, idle, legacy = uploaded(db, "read.jsonl"), uploaded(db, "idle.jsonl"), uploaded(
        db, "old.jsonl")
    with db.store.write() as session:  # a file from before migration 0013: no expires_at
        session.execute(update(File).where(File.id == legacy).values(expires_at=None))
    batch = db.batches.create_batch(db.tenant_id, "/v1/chat/completions", DAY, "24h", reads,
                                    1, None)
    db.batches.update_batch(batch.id, status="cancelling")  # not ended yet
    assert retention.purge(db.store, db.settings, now=utcnow() + 29 * DAY)["files"] == 0
    later = utcnow() + 31 * DAY
    assert retention.purge(db.store, db.settings, now=later)["files"] == 2
    assert db.batches.get_file(idle, db.tenant_id) is None
    assert db.batches.get_file(legacy, db.tenant_id) is None
    assert db.batches.file_content(reads, db.tenant_id) == request_lines(1).decode()
    db.batches.update_batch(batch.id, status="cancelled")
    assert retention.purge(db.store, db.settings, now=later)["files"] == 1
    assert db.batches.get_file(reads, db.tenant_id) is None


# -- job text --------------------------------------------------------------------------


def ended_job(db: Db, text: str, key: str | None = None, callback_url: str | None = None,
              ) -> str:
    job_id = str(uuid.uuid4())
    db.store.jobs.create_job(job_id, db.tenant_id, "chat", "chat.vllm", 5, None, {}, 7,
                             idempotency_key=key, callback_url=callback_url)
    db.store.runs.claim_job(job_id, "chat-test@retention", "vllm")
    db.store.runs.end_job(job_id, JobStatus.DONE, finish_reason="stop", output_text=text,
                          completion_tokens=3)
    return job_id


def test_a_jobs_text_goes_after_its_retention_and_its_row_and_usage_stay(db: Db) -> None:
    job_id = ended_job(db, "the answer, kept a while")
    before = db.store.jobs.get_job(job_id)
    assert before is not None and before.output_text == "the answer, kept a while"
    retention.purge(db.store, db.settings, now=utcnow() + 29 * DAY)
    assert db.store.jobs.get_job(job_id).output_text == "the answer, kept a while"  # type: ignore[union-attr]
    removed = retention.purge(db.store, db.settings, now=utcnow() + 31 * DAY)
    assert removed["job_texts"] >= 1
    after = db.store.jobs.get_job(job_id)
    assert after is not None and after.output_text is None
    assert (after.status, after.prompt_tokens, after.completion_tokens, after.finish_reason) == (
        before.status, 7, 3, "stop")
    assert after.finished_at == before.finished_at and after.ttft_ms == before.ttft_ms


def test_a_jobs_text_waits_for_its_open_batch_and_its_webhook(db: Db) -> None:
    batches = db.batches
    batch = batches.create_batch(db.tenant_id, "/v1/chat/completions", DAY, "24h",
                                 uploaded(db, "open.jsonl"), 1, None)  # open: validating
    of_batch = ended_job(db, "a batch line's answer", key=f"{batch.id}:0")
    hooked = ended_job(db, "for the webhook", callback_url="http://127.0.0.1:9/hook")
    alone = ended_job(db, "nobody waits for this")
    retention.purge(db.store, db.settings, now=utcnow() + 31 * DAY)
    assert db.store.jobs.get_job(alone).output_text is None  # type: ignore[union-attr]
    assert db.store.jobs.get_job(of_batch).output_text == "a batch line's answer"  # type: ignore[union-attr]
    assert db.store.jobs.get_job(hooked).output_text == "for the webhook"  # type: ignore[union-attr]
    batches.update_batch(batch.id, status="cancelled")
    retention.purge(db.store, db.settings, now=utcnow() + 31 * DAY)
    assert db.store.jobs.get_job(of_batch).output_text is None  # type: ignore[union-attr]


# -- the beat ----------------------------------------------------------------------------


def test_the_scheduler_beat_runs_the_purge_once_a_period(db: Db) -> None:
    settings = db.settings.model_copy(update={"retention_purge_s": 3600.0,
                                               "job_text_retention_days": 0.0})
    entry = make_scheduler_app(settings).conf.beat_schedule["purge"]
    assert entry["schedule"] == 3600.0
    job_id = ended_job(db, "gone at the next purge")
    client = redis.Redis.from_url(settings.redis_url)
    first = purge_pass(client, db.store, settings)
    assert first["acted"] and first["job_texts"] >= 1
    assert db.store.jobs.get_job(job_id).output_text is None  # type: ignore[union-attr]
    assert purge_pass(client, db.store, settings) == {"acted": False}  # one per period
    actions = [json.loads(fields[b"a"]) for _, fields in
               client.xrange(keys.scheduler_actions(settings.namespace))]
    assert [a["action"] for a in actions].count("purge") == 1
