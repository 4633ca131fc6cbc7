"""The engine host: one engine per worker process, driven from one asyncio loop thread.

Celery task threads call `run()`, which submits the generation to the loop and hands
the deltas back through a thread-safe queue, so a slow Redis write in a task thread never
stalls the loop that feeds every other request in the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar

from workers.engine import ChoiceDelta, Delta, Engine, EngineRequest

_END = object()
T = TypeVar("T")
_REMEMBER_CANCELLED = 10_000  # ids cancelled before their run started (broadcast cancels)
# The loop thread's name, in Python and for the OS (/proc/<pid>/task/<tid>/comm, at most
# 15 bytes): profilers and bench/frontdoor.py tell the engine's CPU from the worker's by it.
# Threads the loop starts (its default executor's, a tokenizer's) inherit the OS name.
ENGINE_THREAD = "tidegate-engine"


class Cancelled(Exception):
    """The job was cancelled: the engine request was aborted."""


class DeadlineExceeded(Exception):
    """The job ran past its deadline: the engine request was aborted."""


class Sink(Protocol):
    """Where a running request's output goes, called on the engine's loop thread: it must
    not block (workers/streamer.py, or a queue for `run`)."""

    def put(self, delta: Delta) -> None: ...

    def close(self, end: BaseException | None) -> None: ...


class _QueueSink:
    def __init__(self, out: queue.Queue[Any]) -> None:
        self.out = out

    def put(self, delta: Delta) -> None:
        self.out.put(delta)

    def close(self, end: BaseException | None) -> None:
        if end is not None:
            self.out.put(end)
        self.out.put(_END)


class EngineHost:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=ENGINE_THREAD, daemon=True)
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    def _run_loop(self) -> None:
        name_os_thread(ENGINE_THREAD)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def start(self, warm_prompts: list[str] | None = None) -> None:
        self._thread.start()
        self._call(self.engine.start()).result()
        if warm_prompts:
            self._call(self.engine.warm(warm_prompts)).result()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self._call(self.engine.shutdown()).result(timeout=timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def warm(self, prompts: list[str]) -> None:
        self._call(self.engine.warm(prompts)).result()

    def reset_prefix_cache(self) -> bool:
        return bool(self._call(self.engine.reset_prefix_cache()).result())

    def running_ids(self) -> list[str]:
        return list(self._tasks)

    def run(self, request: EngineRequest, timeout_s: float | None = None) -> Iterator[Delta]:
        """Deltas of one request, in order. Raises Cancelled or DeadlineExceeded."""
        out: queue.Queue[Any] = queue.Queue()
        self.start_request(request, _QueueSink(out), timeout_s)
        while True:
            items = _waiting(out)
            deltas = [item for item in items if isinstance(item, Delta)]
            if deltas:
                yield merge(deltas)
            if len(deltas) < len(items):  # the run's end (or its error) came last
                end = items[-1]
                if isinstance(end, BaseException):
                    raise end
                return

    def start_request(self, request: EngineRequest, sink: Sink,
                      timeout_s: float | None = None) -> None:
        """Run a request; its deltas go to `sink.put` on the loop thread as the engine makes
        them, and its end to `sink.close`: None, or the exception that ended it
        (Cancelled, DeadlineExceeded, the engine's)."""
        self._call(self._pump(request, sink, timeout_s))

    async def _pump(self, request: EngineRequest, sink: Sink, timeout_s: float | None) -> None:
        rid = request.request_id
        task = asyncio.current_task()
        assert task is not None
        self._tasks[rid] = task
        end: BaseException | None = None
        try:
            if rid in self._cancelled:
                raise asyncio.CancelledError
            async with asyncio.timeout(timeout_s):
                async for delta in self.engine.generate(request):
                    sink.put(delta)
        except asyncio.CancelledError:
            await self.engine.abort(rid)
            end = Cancelled(rid)
        except TimeoutError:
            await self.engine.abort(rid)
            end = DeadlineExceeded(rid)
        except Exception as exc:  # handed to the task thread, which reports it on the job
            end = exc
        finally:
            # An abandoned attempt can end after the same job's next attempt started here
            # (a requeued job): remove only this run's own entry.
            if self._tasks.get(rid) is task:
                del self._tasks[rid]
            sink.close(end)

    def cancel(self, request_id: str) -> None:
        """Abort a request, whether it is running now or starts later on this worker."""
        self.loop.call_soon_threadsafe(self._cancel, request_id)

    def abandon(self, request_id: str) -> None:
        """Abort a running request, remembering nothing: its job may come back to this
        worker (an attempt that lost its lease), and must then run."""
        self.loop.call_soon_threadsafe(self._abandon, request_id)

    def _abandon(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def _cancel(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        while len(self._cancelled) > _REMEMBER_CANCELLED:
            self._cancelled.popitem(last=False)
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()


def _waiting(out: queue.Queue[Any]) -> list[Any]:
    """The next item, and every other one already waiting, up to and including the end.
    A task thread that fell behind its engine (a busy host) then writes one event for
    all the tokens that queued up meanwhile, not one per engine step: a token costs the
    worker its share of one Redis write, whatever the load. Nothing waits for more."""
    items = [out.get()]
    while not (items[-1] is _END or isinstance(items[-1], BaseException)):
        try:
            items.append(out.get_nowait())
        except queue.Empty:
            break
    return items


def merge(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(text="".join(d.text for d in deltas),
                 token_ids=tuple(i for d in deltas for i in d.token_ids),
                 finished=last.finished,
                 finish_reason=next((d.finish_reason for d in reversed(deltas)
                                     if d.finish_reason), None),
                 prompt_tokens=next((d.prompt_tokens for d in deltas
                                     if d.prompt_tokens is not None), None),
                 cached_tokens=next((d.cached_tokens for d in deltas
                                     if d.cached_tokens is not None), None),
                 logprobs=_joined_logprobs([d.logprobs for d in deltas]),
                 choices=_merged_choices([c for d in deltas for c in d.choices]),
                 tool_calls=tuple(call for d in deltas for call in d.tool_calls))


def _joined_logprobs(parts: list[tuple[Any, ...] | None]) -> tuple[Any, ...] | None:
    if all(p is None for p in parts):
        return None
    return tuple(lp for p in parts for lp in p or ())


def _merged_choices(choices: list[ChoiceDelta]) -> tuple[ChoiceDelta, ...]:
    """Consecutive steps' output of each choice (n > 1) as one per choice, by index."""
    by_index: dict[int, list[ChoiceDelta]] = {}
    for c in choices:
        by_index.setdefault(c.index, []).append(c)
    return tuple(
        ChoiceDelta(index=index, text="".join(c.text for c in run),
                    token_ids=tuple(i for c in run for i in c.token_ids),
                    finish_reason=next((c.finish_reason for c in reversed(run)
                                        if c.finish_reason), None),
                    logprobs=_joined_logprobs([c.logprobs for c in run]))
        for index, run in sorted(by_index.items()))


def name_os_thread(name: str) -> None:
    """The calling thread's OS name (Python before 3.14 leaves every thread with the
    process's); Linux only, and nothing breaks without it."""
    with contextlib.suppress(OSError):
        Path("/proc/thread-self/comm").write_text(name[:15])
