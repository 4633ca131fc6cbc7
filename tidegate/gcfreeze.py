"""The garbage collector after a process started.

What a process builds to start (modules, the app, a worker's engine and tokenizer) lives as
long as it does, and every full collection under load scanned all of it again: in the API,
pauses of about 40 ms at gen2, which land on the tail of token delivery (bench/README.md).
`after_start()` collects once, then moves what is left out of the collector's reach
(gc.freeze): later collections scan only what serving made.
"""

from __future__ import annotations

import gc


def after_start() -> None:
    gc.collect()
    gc.freeze()
