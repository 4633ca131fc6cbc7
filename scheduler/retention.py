"""The retention purge: what tidegate keeps, and for how long (docs/operations.md, "What
is kept, and for how long"). The scheduler's beat runs it every TIDEGATE_RETENTION_PURGE_S, one
scheduler at a time (a period lock, as the tick's).

- A job's output text (and its prompt, already cleared when the job ends) goes
  TIDEGATE_JOB_TEXT_RETENTION_DAYS after its end; the row stays, with its status, usage
  and timings, for accounting.
- A file goes at its `expires_at`: an upload TIDEGATE_FILE_RETENTION_DAYS after it came
  (sooner if it asked), kept while a batch not ended reads it; a batch's output and error
  files after its `output_expires_after` (TIDEGATE_BATCH_OUTPUT_RETENTION_DAYS at most).
- Token streams in Redis need no purge: each job's stream expires TIDEGATE_STREAM_TTL_S
  after its terminal event (tidegate/keys.py), and every job gets one (the reconciler
  ends those whose worker died).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from store import Store, utcnow
from store.retention import Retention
from tidegate.settings import Settings

log = logging.getLogger("tidegate.scheduler")


def purge(store: Store, settings: Settings, now: datetime | None = None) -> dict[str, int]:
    """One purge pass at `now` (default: the clock's): what it removed, by kind."""
    now = now or utcnow()
    retention = Retention(store)
    texts = retention.purge_job_text(now - _days(settings.job_text_retention_days))
    files = retention.purge_files(now, now - _days(settings.file_retention_days),
                                  now - _days(settings.batch_output_retention_days))
    log.info("retention: cleared %d jobs' text, deleted %d files", texts, files)
    return {"job_texts": texts, "files": files}


def _days(days: float) -> timedelta:
    return timedelta(days=days)
