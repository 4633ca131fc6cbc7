"""tidegate's vLLM patch: session-priority KV cache eviction and allocation timing.

Loaded through the `vllm.general_plugins` entry point, which vLLM runs in each of its
processes (the engine core included, where the scheduler and the block pool live). It
does nothing unless the tidegate adapter asked for it in the environment, so a vLLM that
merely shares the virtual environment (the benchmarks' peer server) runs untouched:

* TIDEGATE_VLLM_KV_POLICY=session: every BlockPool built from then on gets a SessionFreeQueue
  in place of vLLM's free-block queue, and the hooks below tell the queue whose blocks are
  freed or hit. =lru (or unset): vLLM's own queue, untouched.
* TIDEGATE_VLLM_KV_STATS=FILE: the scheduler's time in `allocate_slots` per step is
  written to FILE (workers/kvcache/stats.py) for the worker's heartbeat.
* TIDEGATE_VLLM_KV_ALLOC_DELAY_MS=MS (fault injection for tests and drills): each
  `allocate_slots` call waits MS before it runs, inside the timed region, as a starved
  allocator would: the health check's whole path (timing, heartbeat, scheduler) runs on a
  real measurement (tests/stack/test_health_measured.py).

The seams are vLLM internals (vllm/v1/core): `BlockPool.free_block_queue`,
`BlockPool.touch`, `KVCacheManager.allocate_slots` / `free`, `Scheduler.schedule`. They
are written for one vLLM version (PINNED_VLLM, workers/vllm_patches/__init__.py); on any
other the session policy refuses to start and the timing is skipped with a warning.

Where the request comes from: the adapter puts the request's retention (from
workers/kvcache/policy.py) in `SamplingParams.extra_args["tidegate"]`, not in `priority`
(which reorders scheduling) nor `cache_salt` (which splits the cache).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine import KV_POLICIES
from workers.kvcache.freequeue import SessionFreeQueue
from workers.kvcache.policy import DEFAULT_RETENTION, Retention
from workers.kvcache.stats import AllocStatsWriter
from workers.vllm_patches import PINNED_VLLM, PatchRefused, check_version

if TYPE_CHECKING:  # vLLM's internals this patch wraps (PINNED_VLLM's)
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

log = logging.getLogger("tidegate.kvcache")

# A wrapped method: vLLM's original, which each hook calls with the method's own arguments.
Original = Callable[..., Any]

# Set by the adapter for vLLM's processes; not settings (TIDEGATE_KV_POLICY is the setting),
# so an engine started inside a test process cannot leak its choice into later workers.
POLICY_ENV = "TIDEGATE_VLLM_KV_POLICY"
STATS_ENV = "TIDEGATE_VLLM_KV_STATS"
ALLOC_DELAY_ENV = "TIDEGATE_VLLM_KV_ALLOC_DELAY_MS"


def register() -> None:
    """The entry point vLLM calls in each process."""
    policy, stats_path = os.environ.get(POLICY_ENV, ""), os.environ.get(STATS_ENV, "")
    if not policy and not stats_path:
        return
    if policy and policy not in KV_POLICIES:
        raise PatchRefused(f"{POLICY_ENV}={policy!r}: must be one of {', '.join(KV_POLICIES)}")
    import vllm

    try:
        check_version(vllm.__version__)
    except PatchRefused:
        if policy == "session":
            raise
        log.warning("vLLM %s is not %s: KV allocation timing is off", vllm.__version__,
                    PINNED_VLLM)
        return
    _install()


_installed = False


def _install() -> None:
    """Wraps the seams once per process; each wrapper reads the environment when an engine
    is built, so two engines made one after the other in a process can differ."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    _wrap(BlockPool, "__init__", _pool_init)
    _wrap(BlockPool, "touch", _touch)
    _wrap(BlockPool, "_maybe_evict_cached_block", _count_eviction)
    _wrap(KVCacheManager, "allocate_slots", _allocate_slots)
    _wrap(KVCacheManager, "free", _free)
    _wrap(Scheduler, "__init__", _scheduler_init)
    _wrap(Scheduler, "schedule", _schedule)


def _wrap(cls: type, name: str, hook: Callable[..., object]) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        return hook(original, self, *args, **kwargs)

    setattr(cls, name, wrapper)


# --- the eviction policy -----------------------------------------------------------


def _pool_init(original: Original, pool: BlockPool, *args: object, **kwargs: object) -> None:
    original(pool, *args, **kwargs)
    if os.environ.get(POLICY_ENV) == "session" and pool.enable_caching:
        # The null block (popped by BlockPool.__init__) stays out, as in vLLM's queue.
        # Duck-typed: vLLM's FreeKVCacheBlockQueue interface, the KV plugin's order.
        pool.free_block_queue = SessionFreeQueue(  # type: ignore[assignment]
            [b for b in pool.blocks if b is not pool.null_block])
        log.info("session-priority KV eviction on a pool of %d blocks", pool.num_gpu_blocks)


def _touch(original: Original, pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
    queue = pool.free_block_queue
    if isinstance(queue, SessionFreeQueue):
        for block in blocks:
            if not block.is_null:
                queue.note_use(block)
    original(pool, blocks)


def _retention(request: Request) -> tuple[Retention, str]:
    """The request's retention and owner, parsed once: allocate_slots runs for every
    running request at every scheduler step."""
    cached: tuple[Retention, str] | None = getattr(request, "_tidegate_kv", None)
    if cached is None:
        cached = _parse_retention(request)
        setattr(request, "_tidegate_kv", cached)  # noqa: B010 - an attribute of ours
    return cached


def _parse_retention(request: Request) -> tuple[Retention, str]:
    """As the adapter put them in SamplingParams.extra_args."""
    params = getattr(request, "sampling_params", None)
    meta = ((params.extra_args or {}) if params is not None else {}).get("tidegate") or {}
    kv = meta.get("kv")
    retention = Retention.from_dict(kv) if isinstance(kv, dict) else DEFAULT_RETENTION
    return retention, str(meta.get("owner") or request.request_id)


def _tagged(manager: KVCacheManager,
            request: Request) -> SessionFreeQueue[KVCacheBlock] | None:
    queue = manager.block_pool.free_block_queue
    if not isinstance(queue, SessionFreeQueue):
        return None
    queue.tag(*_retention(request))
    return queue


def _free(original: Original, manager: KVCacheManager, request: Request) -> None:
    queue = _tagged(manager, request)
    try:
        original(manager, request)
    finally:
        if queue is not None:
            queue.tag(DEFAULT_RETENTION, "")


# --- allocation timing ---------------------------------------------------------------

_step = {"alloc_s": 0.0, "evictions": 0}  # this process's scheduler step, as it runs
_fault = {"delay_s": 0.0}  # ALLOC_DELAY_ENV, read when the scheduler is built


def _allocate_slots(original: Original, manager: KVCacheManager, request: Request,
                    *args: object, **kwargs: object) -> KVCacheBlocks | None:
    queue = _tagged(manager, request)  # prefix hits (touch) and new blocks are this request's
    started = time.perf_counter()
    try:
        if _fault["delay_s"]:  # unarmed: one lookup on this per-request, per-step path
            time.sleep(_fault["delay_s"])
        return original(manager, request, *args, **kwargs)
    finally:
        _step["alloc_s"] += time.perf_counter() - started
        if queue is not None:
            queue.tag(DEFAULT_RETENTION, "")


def _count_eviction(original: Original, pool: BlockPool, block: KVCacheBlock) -> bool:
    evicted = bool(original(pool, block))
    _step["evictions"] += evicted
    return evicted


def _scheduler_init(original: Original, scheduler: Scheduler, *args: object,
                    **kwargs: object) -> None:
    original(scheduler, *args, **kwargs)
    path = os.environ.get(STATS_ENV)
    writer = AllocStatsWriter(Path(path)) if path else None
    setattr(scheduler, "_tidegate_stats", writer)  # noqa: B010 - an attribute of ours
    _fault["delay_s"] = float(os.environ.get(ALLOC_DELAY_ENV) or 0) / 1000


def _schedule(original: Original, scheduler: Scheduler, *args: object,
              **kwargs: object) -> SchedulerOutput:
    _step["alloc_s"], _step["evictions"] = 0.0, 0
    output = original(scheduler, *args, **kwargs)
    writer: AllocStatsWriter | None = getattr(scheduler, "_tidegate_stats", None)
    if writer is not None and (_step["alloc_s"] or _step["evictions"]):
        writer.step(_step["alloc_s"] * 1000, int(_step["evictions"]))
    return output
