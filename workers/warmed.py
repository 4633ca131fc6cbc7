"""The prompts a worker's engine has warmed and still holds, so that an activation does not
warm them again (workers/warming.py, the `tidegate_warm` command).

A warmed prompt stays in the prefix cache until a cached block is evicted or the cache is
reset: while the engine's eviction count (EngineStats.kv_evictions) has not moved since
the prompts were warmed, they are all still there. Once it moved, which prompts lost
blocks is unknown, so every one is warmed again. Only engines that count their
evictions are trusted; on any other every prompt is warmed each time, as before.
"""

from __future__ import annotations

import threading

from tidegate.records import EngineStats

COUNTING_ENGINES = ("vllm", "sim")  # their stats count evicted cached blocks


class Warmed:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: set[str] = set()
        self._evictions: int | None = None  # the count when they were warmed

    def missing(self, texts: list[str], engine: str, stats: EngineStats | None) -> list[str]:
        """The texts to warm now: those not warmed since the last eviction."""
        with self._lock:
            if engine not in COUNTING_ENGINES or stats is None:
                return list(texts)
            self._since(stats.kv_evictions)
            return [t for t in dict.fromkeys(texts) if t not in self._texts]

    def add(self, texts: list[str], engine: str, stats: EngineStats | None) -> None:
        """`texts` were just warmed (`missing` was asked first); `stats` read after."""
        with self._lock:
            if engine not in COUNTING_ENGINES or stats is None:
                return
            if self._since(stats.kv_evictions):  # the warm itself evicted: trust none
                self._texts.update(texts)

    def _since(self, evictions: int) -> bool:
        """True when nothing was evicted since the count was last seen; else forgets."""
        if evictions == self._evictions:
            return True
        self._texts.clear()
        self._evictions = evictions
        return False

    def forget(self) -> None:
        """The prefix cache was reset."""
        with self._lock:
            self._texts.clear()
