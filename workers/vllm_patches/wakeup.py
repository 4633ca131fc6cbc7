"""tidegate's vLLM patch for the wake-up that vLLM's processes can lose.

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

The one vLLM internal it touches is the module constant
`vllm.distributed.device_communicators.shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS`,
read by vLLM 0.32.0 at each recheck. On any other vLLM (PINNED_VLLM,
workers/vllm_patches/__init__.py) it logs a warning and leaves vLLM as it is: the
constant's name and meaning are not vLLM's promise, and a lost ping costing 5 s is better
than a patch that breaks a peer vLLM.
"""

from __future__ import annotations

import os

from workers.vllm_patches import on_pinned_vllm

RECHECK_ENV = "TIDEGATE_VLLM_SHM_RECHECK_MS"
RECHECK_MS = 20


def register() -> None:
    """The entry point vLLM calls in each process."""
    raw = os.environ.get(RECHECK_ENV, "")
    if not raw:
        return
    import vllm

    if not on_pinned_vllm(vllm.__version__, RECHECK_ENV, "vLLM's own shared-memory recheck"):
        return
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = int(raw)
