"""tidegate's vLLM plugin for the wake-up that vLLM's processes can lose.

vLLM's engine core and its worker process pass every step through shared-memory rings
(vllm/distributed/device_communicators/shm_broadcast.py). A reader idle for more than a
second parks until the writer pings it over ZeroMQ. The ping can be lost, and vLLM then
rereads the ring only every SHM_READER_RECHECK_INTERVAL_MS: 5 s, "bounds lost-notify
recovery latency to ~5s" in its own words. An engine that idles between bursts, as a
sensitive lane's does under another lane's peak, met it as first tokens 3 to 11 s late,
every request of the burst at once, with the engine itself ready (bench/lanes.py).

tidegate's engines reread every TIDEGATE_VLLM_SHM_RECHECK_MS instead (the adapter sets
it, RECHECK_MS): a lost ping then costs at most that, for a few dozen flag reads a second
while the engine is idle. Loaded through the `vllm.general_plugins` entry point in each of
vLLM's processes; without the variable (a peer vLLM sharing the environment) it does
nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tidegate.vllm")

RECHECK_ENV = "TIDEGATE_VLLM_SHM_RECHECK_MS"
RECHECK_MS = 20


def register() -> None:
    raw = os.environ.get(RECHECK_ENV, "")
    if not raw:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        log.warning("this vLLM has no SHM_READER_RECHECK_INTERVAL_MS: %s is ignored",
                    RECHECK_ENV)
        return
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(raw)
