"""Cache allocation latency, from vLLM's engine core process to the worker that hosts it.

The scheduler runs in vLLM's engine core process, the heartbeat in the worker process.
The plugin times `KVCacheManager.allocate_slots` there and writes the figures into a small
shared file (one fixed record, memory-mapped); the adapter reads it in `stats()`. A
sequence number, odd while a write is under way, keeps a reader from mixing two writes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

_RECORD = struct.Struct("<Qqdddq")  # seq, steps, total ms, recent ms, last step ms, evictions
EWMA_ALPHA = 0.1  # the recent average follows about the last 10-20 steps


@dataclass(frozen=True)
class AllocStats:
    steps: int = 0  # scheduler steps that allocated KV cache
    total_ms: float = 0.0  # time spent allocating, over those steps
    recent_ms: float = 0.0  # moving average per step: what health checks watch
    last_step_ms: float = 0.0
    evictions: int = 0  # cached blocks reused for new contents

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.steps if self.steps else 0.0


def create(path: Path) -> None:
    """An empty record, made by the adapter before vLLM starts its engine core."""
    path.write_bytes(_RECORD.pack(0, 0, 0.0, 0.0, 0.0, 0))


def read(path: Path) -> AllocStats | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    for _ in range(10):
        seq, steps, total, recent, last, evictions = _RECORD.unpack_from(raw)
        if seq % 2 == 0:
            return AllocStats(steps, total, recent, last, evictions)
        raw = path.read_bytes()
    return None


class AllocStatsWriter:
    """Kept by the plugin in the engine core process; one `step()` per scheduler step."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), _RECORD.size)
        self._seq = 0
        self.stats = AllocStats()

    def step(self, alloc_ms: float, evictions: int) -> None:
        s = self.stats
        recent = alloc_ms if s.steps == 0 else s.recent_ms + EWMA_ALPHA * (alloc_ms - s.recent_ms)
        self.stats = AllocStats(s.steps + 1, s.total_ms + alloc_ms, recent, alloc_ms,
                                s.evictions + evictions)
        self._write()

    def _write(self) -> None:
        s = self.stats
        self._seq += 1  # odd: a write is under way
        self._map[:8] = struct.pack("<Q", self._seq)
        self._seq += 1
        self._map[:] = _RECORD.pack(self._seq, s.steps, s.total_ms, s.recent_ms,
                                    s.last_step_ms, s.evictions)
