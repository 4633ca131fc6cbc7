"""The free-block queue that evicts by retention class, then least recently freed.

It has the interface of vLLM's `FreeKVCacheBlockQueue` (vllm/v1/core/kv_cache_utils.py,
vLLM 0.32.0): `num_free_blocks`, `popleft`, `popleft_n`, `remove`, `append`, `append_n`,
`prepend_n`, `get_all_free_blocks`, `iter_blocks_after`. The vLLM plugin puts it in
place of vLLM's queue in every `BlockPool`; the trace simulator drives the same class.
Blocks are any objects with an integer `block_id`.

vLLM's order is one list: blocks without a hash (never matchable) are prepended and
reused first; cached blocks are appended when freed and evicted from the front (LRU); a
prefix hit pulls a block out of the middle. Here the front part is the same (`_front`),
and the rest is one list per (priority, duration) class, each in free order, so the front
of each class is its least recently freed block and the first to lapse. Eviction takes
the lowest effective priority among the fronts of the classes, oldest first on a tie. A
request's blocks arrive tail first (vLLM frees them reversed) and keep that order inside
their class, so a prefix chain is cut from its tail, never its head.

With one retention for every block, the order is exactly vLLM's LRU
(tests/test_kv_freequeue.py checks it against vLLM's own queue).

The caller says whose blocks are being freed or hit with `tag(...)`: the vLLM plugin
around `KVCacheManager.free` / `allocate_slots`, the simulator around each request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from workers.kvcache.policy import DEFAULT_RETENTION, EXPIRED_PRIORITY, Retention

_FRONT = (-1, None)  # the class of blocks without a hash: reused before any cached block
ClassKey = tuple[int, float | None]


class Block(Protocol):
    block_id: int


B = TypeVar("B", bound=Block)  # vLLM's KVCacheBlock, or the sim engine's (workers/sim_kv.py)


class SessionFreeQueue(Generic[B]):
    def __init__(self, blocks: list[B], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.num_free_blocks = len(blocks)
        self._front: OrderedDict[int, B] = OrderedDict((b.block_id, b) for b in blocks)
        # class -> block id -> (block, freed at); each in free order
        self._classes: dict[ClassKey, OrderedDict[int, tuple[B, float]]] = {}
        self._class_of: dict[int, ClassKey] = {b.block_id: _FRONT for b in blocks}
        self._owner: dict[int, str] = {}  # block id -> who first filled it
        self._shared: set[int] = set()  # blocks reused by a second owner
        self.retention: Retention = DEFAULT_RETENTION  # of the blocks freed now
        self.owner = ""  # of the request freeing or hitting blocks now

    # --- tidegate's hooks ---------------------------------------------------------

    def tag(self, retention: Retention, owner: str) -> None:
        """Whose blocks the next frees and hits are (until the next tag)."""
        self.retention, self.owner = retention, owner

    def note_use(self, block: B) -> None:
        """A prefix hit: a block reused by another owner becomes a shared prefix."""
        first = self._owner.setdefault(block.block_id, self.owner)
        if first != self.owner:
            self._shared.add(block.block_id)

    # --- vLLM's FreeKVCacheBlockQueue interface -------------------------------------

    def popleft(self) -> B:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        if self._front:
            block_id, block = self._front.popitem(last=False)
        else:
            key = self._victim_class()
            block_id, (block, _) = self._classes[key].popitem(last=False)
            if not self._classes[key]:
                del self._classes[key]
        self._forget(block_id)
        self._owner[block_id] = self.owner  # allocated to the request being served now
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[B]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: B) -> None:
        key = self._class_of.pop(block.block_id, None)
        if key is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        bucket = self._front if key == _FRONT else self._classes[key]
        del bucket[block.block_id]
        if key != _FRONT and not bucket:
            del self._classes[key]
        self.num_free_blocks -= 1

    def append(self, block: B) -> None:
        self.append_n([block])

    def append_n(self, blocks: Iterable[B]) -> None:
        """Freed cached blocks, in eviction order (a request's tail first)."""
        now = self.clock()
        r = self.retention
        for block in blocks:
            self._owner.setdefault(block.block_id, self.owner)
            priority = r.priority
            if block.block_id in self._shared:
                priority = max(priority, r.shared_priority)
            key = (priority, r.duration_s)
            self._classes.setdefault(key, OrderedDict())[block.block_id] = (block, now)
            self._class_of[block.block_id] = key
            self.num_free_blocks += 1

    def prepend_n(self, blocks: Iterable[B]) -> None:
        """Freed blocks without a hash: reused first, the first of `blocks` first."""
        for block in reversed(list(blocks)):
            self._front[block.block_id] = block
            self._front.move_to_end(block.block_id, last=False)
            self._class_of[block.block_id] = _FRONT
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[B]:
        """Every free block in eviction order, as things stand now."""
        return list(self._in_eviction_order())

    def iter_blocks_after(self, cursor: B | None) -> Iterator[B]:
        blocks = self._in_eviction_order()
        if cursor is not None:
            for block in blocks:
                if block is cursor:
                    break
        yield from blocks

    # --- internals ------------------------------------------------------------------

    def _effective(self, key: ClassKey, freed_at: float, now: float) -> tuple[int, float]:
        priority, duration = key
        if duration is not None and now - freed_at >= duration:
            priority = EXPIRED_PRIORITY
        return priority, freed_at

    def _victim_class(self) -> ClassKey:
        """The class whose front block goes next: lowest effective priority, then oldest.
        Inside a class blocks lapse in free order, so only fronts need comparing."""
        now = self.clock()
        return min(self._classes, key=lambda k: self._effective(
            k, next(iter(self._classes[k].values()))[1], now))

    def _forget(self, block_id: int) -> None:
        """The block's contents are evicted: it starts over with its next owner."""
        self._class_of.pop(block_id, None)
        self._owner.pop(block_id, None)
        self._shared.discard(block_id)

    def _in_eviction_order(self) -> Iterator[B]:
        yield from self._front.values()
        now = self.clock()
        ranked = [(self._effective(key, freed_at, now), block)
                  for key, bucket in self._classes.items() for block, freed_at in bucket.values()]
        # A stable sort keeps each class's own order among blocks freed at the same instant.
        ranked.sort(key=lambda item: item[0])
        yield from (block for _, block in ranked)
