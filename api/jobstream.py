"""One reader of a job's event stream, for every route that streams or waits on a job: the
jobs API's SSE (api/job_sse.py) and the OpenAI routes (api/openai_stream.py).

A reader keeps its place in the job's Redis stream (the entry id it has read up to) and
waits for what comes after it through the process's one XREAD (api/streamhub.py). When
the stream is quiet a route looks further, through the same reader: at the stream's last
entry (has the end been written?) and at the job's row in the store (has the job ended
without its events?). What a route makes of that (an `error` event, an answer from the
row) is the route's own.
"""

from __future__ import annotations

import asyncio

from api.deps import Deps
from api.streamhub import Entry
from store import JobRecord
from tidegate import keys
from tidegate.events import Event


class JobStream:
    """A place in one job's events: the stream entry read up to, and its event's seq."""

    def __init__(self, deps: Deps, job_id: str, after: int = -1) -> None:
        self.deps, self.job_id = deps, job_id
        self.key = keys.job_events(deps.settings.namespace, job_id)
        self.cursor: str | bytes = keys.stream_id(after) if after >= 0 else "0-0"
        self.seq = after  # the last event read (or the client had): -1 before the first

    async def entries(self, wait_s: float) -> list[Entry]:
        """The entries after the cursor, waiting up to `wait_s` for one ([] if none came);
        the cursor moves past them."""
        entries = await self.deps.stream_hub.read(self.key, self.cursor, wait_s)
        if entries:
            self.cursor = entries[-1][0]
            self.seq = keys.seq_of(self.cursor)
        return entries

    async def events(self, wait_s: float) -> list[Event]:
        """`entries`, parsed."""
        return [Event.from_json(fields[b"e"]) for _, fields in await self.entries(wait_s)]

    async def last_entry(self) -> Entry | None:
        """The stream's last entry, wherever the cursor is (None: an empty or no stream)."""
        last: list[Entry] = await self.deps.stream_redis.xrevrange(self.key, count=1)
        return last[0] if last else None

    async def row(self) -> JobRecord | None:
        """The job's row, read on a thread (a store call blocks)."""
        return await asyncio.to_thread(self.deps.store.jobs.get_job, self.job_id)

    async def ended_row(self) -> JobRecord | None:
        """The job's row once it has ended (else None)."""
        job = await self.row()
        return job if job is not None and job.terminal else None
