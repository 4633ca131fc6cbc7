"""The session free-block queue (workers/kvcache/freequeue.py): with one retention it is
vLLM's own LRU queue, checked step by step against vLLM's `FreeKVCacheBlockQueue`; with
retention classes it evicts the lowest class first, oldest first, and lapses classes."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from tidegate.lanes import KvPolicy
from workers.kvcache.freequeue import SessionFreeQueue
from workers.kvcache.policy import (
    EXPIRED_PRIORITY,
    UNIFORM,
    Retention,
    SessionMeta,
    retention,
)


class Clock:
    """A fake monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# --- equivalence with vLLM's queue under one retention -------------------------------


class Twin:
    """vLLM's queue and ours over blocks with the same ids, driven alike."""

    def __init__(self, n_blocks: int, clock: Callable[[], float]) -> None:
        self.ref_blocks = [KVCacheBlock(i) for i in range(n_blocks)]
        self.our_blocks = [KVCacheBlock(i) for i in range(n_blocks)]
        self.ref = FreeKVCacheBlockQueue(self.ref_blocks)
        self.ours = SessionFreeQueue(self.our_blocks, clock=clock)
        self.ours.tag(UNIFORM, "")
        self.held: list[int] = []  # popped or removed, not yet freed again

    def popleft(self, _: random.Random) -> None:
        if self.ref.num_free_blocks == 0:
            with pytest.raises(ValueError):
                self.ref.popleft()
            with pytest.raises(ValueError):
                self.ours.popleft()
            return
        ref, ours = self.ref.popleft(), self.ours.popleft()
        assert ref.block_id == ours.block_id
        self.held.append(ref.block_id)

    def popleft_n(self, rng: random.Random) -> None:
        n = rng.randint(0, min(8, self.ref.num_free_blocks))
        popped = ids(self.ref.popleft_n(n))
        assert ids(self.ours.popleft_n(n)) == popped
        self.held += popped

    def remove(self, rng: random.Random) -> None:
        free = ids(self.ref.get_all_free_blocks())
        if not free:
            return
        block_id = rng.choice(free)
        self.ours.tag(UNIFORM, rng.choice(["a", "b"]))  # a prefix hit, by either owner
        self.ours.note_use(self.our_blocks[block_id])
        self.ref.remove(self.ref_blocks[block_id])
        self.ours.remove(self.our_blocks[block_id])
        self.held.append(block_id)

    def _take_held(self, rng: random.Random) -> list[int]:
        rng.shuffle(self.held)
        k = rng.randint(0, min(6, len(self.held)))
        taken, self.held = self.held[:k], self.held[k:]
        return taken

    def append_n(self, rng: random.Random) -> None:
        taken = self._take_held(rng)
        self.ref.append_n([self.ref_blocks[i] for i in taken])
        self.ours.append_n([self.our_blocks[i] for i in taken])

    def append(self, rng: random.Random) -> None:
        if self.held:
            block_id = self.held.pop(rng.randrange(len(self.held)))
            self.ref.append(self.ref_blocks[block_id])
            self.ours.append(self.our_blocks[block_id])

    def prepend_n(self, rng: random.Random) -> None:
        taken = self._take_held(rng)
        self.ref.prepend_n([self.ref_blocks[i] for i in taken])
        self.ours.prepend_n([self.our_blocks[i] for i in taken])

    def assert_same(self, rng: random.Random) -> None:
        free = ids(self.ref.get_all_free_blocks())
        assert ids(self.ours.get_all_free_blocks()) == free
        assert self.ours.num_free_blocks == self.ref.num_free_blocks == len(free)
        if free:
            cursor = rng.choice(free)
            after = ids(list(self.ref.iter_blocks_after(self.ref_blocks[cursor])))
            assert ids(list(self.ours.iter_blocks_after(self.our_blocks[cursor]))) == after
        assert ids(list(self.ours.iter_blocks_after(None))) == free


OPS = ("popleft", "popleft_n", "remove", "append_n", "append", "prepend_n")


@pytest.mark.parametrize("seed", range(6))
def test_uniform_retention_is_exactly_vllms_lru(seed: int) -> None:
    rng, clock = random.Random(seed), Clock()
    twin = Twin(rng.choice([1, 7, 48]), clock)
    counts = dict.fromkeys(OPS, 0)
    for _ in range(600):
        # Time sometimes stands still (blocks freed in one step) and sometimes moves.
        clock.now += rng.choice([0.0, 0.0, 0.5, 200.0])
        op = rng.choice(OPS)
        getattr(twin, op)(rng)
        counts[op] += 1
        twin.assert_same(rng)
    assert all(counts.values())  # every operation was exercised


def test_uniform_retention_matches_vllm_with_the_real_clock() -> None:
    rng = random.Random(99)
    twin = Twin(32, time.monotonic)
    for _ in range(400):
        getattr(twin, rng.choice(OPS))(rng)
        twin.assert_same(rng)


# --- policy behaviour ------------------------------------------------------------------


def drained(n_blocks: int) -> tuple[SessionFreeQueue, list[KVCacheBlock], Clock]:
    """A queue whose blocks are all in use (allocated once), so every later free is a
    cached block."""
    clock = Clock()
    blocks = [KVCacheBlock(i) for i in range(n_blocks)]
    queue = SessionFreeQueue(blocks, clock=clock)
    queue.popleft_n(n_blocks)
    return queue, blocks, clock


def free(queue: SessionFreeQueue, blocks: list[KVCacheBlock], tag: Retention,
         owner: str = "r") -> None:
    """A request frees its blocks as vLLM does: tail first."""
    queue.tag(tag, owner)
    queue.append_n(list(reversed(blocks)))


def pop_all(queue: SessionFreeQueue) -> list[int]:
    order = ids(queue.get_all_free_blocks())
    popped = ids(queue.popleft_n(queue.num_free_blocks))
    assert popped == order  # the listing is the eviction order
    return popped


def test_lower_priority_is_evicted_first_whatever_its_age() -> None:
    queue, b, clock = drained(6)
    free(queue, b[0:2], Retention(80))
    clock.now = 1.0
    free(queue, b[2:4], Retention(10))
    clock.now = 2.0
    free(queue, b[4:6], Retention(50))
    assert pop_all(queue) == [3, 2, 5, 4, 1, 0]


def test_least_recently_freed_first_within_a_class() -> None:
    queue, b, clock = drained(6)
    free(queue, [b[0]], Retention(80), "a")
    clock.now = 1.0
    free(queue, [b[1]], Retention(80), "b")
    clock.now = 2.0
    free(queue, [b[2]], Retention(80), "c")
    clock.now = 3.0
    queue.remove(b[0])  # a prefix hit on the oldest: it is in use again
    clock.now = 4.0
    free(queue, [b[0]], Retention(80), "a")  # and freed last
    assert pop_all(queue) == [1, 2, 0]


def test_a_request_keeps_its_tail_first_order() -> None:
    queue, b, clock = drained(8)
    free(queue, b[0:4], Retention(80), "a")  # a chain 0 -> 1 -> 2 -> 3, freed at once
    free(queue, b[4:8], Retention(80), "b")  # another, freed in the same instant
    first_two = ids(queue.popleft_n(2))
    assert first_two == [3, 2]  # the chain is cut from its tail; its head stays matchable
    assert ids(queue.get_all_free_blocks()) == [1, 0, 7, 6, 5, 4]


def test_blocks_without_a_hash_are_reused_before_any_cached_block() -> None:
    queue, b, clock = drained(5)
    free(queue, b[0:2], Retention(10))
    clock.now = 1.0
    queue.prepend_n([b[2], b[3]])
    queue.prepend_n([b[4]])
    assert pop_all(queue) == [4, 2, 3, 1, 0]


@pytest.mark.parametrize(("now", "order"), [
    (89.9, [2, 3, 1, 0]),  # one-shot (10), the 50 class, then the live session (80)
    (90.0, [2, 1, 0, 3]),  # the session lapsed to 35: under the 50 class now
    (500.0, [2, 1, 0, 3]),  # and stays lapsed
])
def test_a_session_class_lapses_after_its_duration(now: float, order: list[int]) -> None:
    queue, b, clock = drained(4)
    free(queue, b[0:2], Retention(80, duration_s=90.0), "session")  # at t=0
    clock.now = 1.0
    free(queue, [b[2]], Retention(10), "one-shot")  # a one-shot class never lapses
    free(queue, [b[3]], Retention(50), "other")
    clock.now = now
    assert pop_all(queue) == order


def test_lapsed_blocks_compete_with_default_blocks_by_age() -> None:
    queue, b, clock = drained(3)
    free(queue, [b[0]], Retention(EXPIRED_PRIORITY), "plain")  # t=0
    clock.now = 5.0
    free(queue, [b[1]], Retention(80, duration_s=10.0), "session")  # lapses at t=15
    clock.now = 6.0
    free(queue, [b[2]], Retention(EXPIRED_PRIORITY), "plain")  # t=6
    clock.now = 14.0
    assert ids(queue.get_all_free_blocks()) == [0, 2, 1]  # the session still holds
    clock.now = 15.0
    assert pop_all(queue) == [0, 1, 2]  # lapsed: 35 like the others, freed at 5


def test_a_block_reused_by_another_owner_keeps_shared_priority() -> None:
    params = KvPolicy()
    session = retention(SessionMeta("s1", turn=1), params)  # 80
    one_shot = retention(SessionMeta(None), params)  # 10, shared 90
    clock = Clock()
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = SessionFreeQueue(blocks, clock=clock)
    queue.tag(session, "s1")
    prompt = queue.popleft_n(2)  # the session fills a system prompt (0, 1) ...
    own = queue.popleft_n(1)  # ... and its own message (2)
    queue.append_n(list(reversed(prompt + own)))
    clock.now = 1.0
    queue.tag(one_shot, "one-shot-1")
    for block in prompt:  # a one-shot request hits the system prompt (BlockPool.touch)
        queue.note_use(block)
        queue.remove(block)
    context = queue.popleft_n(2)  # and fills its own context (3, 4)
    queue.append_n(list(reversed(prompt + context)))
    # Its unique context goes first (10), then the session's message (80); the prompt it
    # shares with the session is kept longest (90), though a one-shot request freed it.
    assert pop_all(queue) == [4, 3, 2, 1, 0]


def test_reuse_by_the_same_owner_does_not_make_a_block_shared() -> None:
    clock = Clock()
    blocks = [KVCacheBlock(0), KVCacheBlock(1)]
    queue = SessionFreeQueue(blocks, clock=clock)
    one_shot = retention(SessionMeta(None), KvPolicy())
    queue.tag(one_shot, "one-shot-7")
    queue.popleft_n(2)
    queue.append(blocks[0])
    queue.note_use(blocks[0])  # the same request (a preempted one, resumed) hits it
    queue.remove(blocks[0])
    queue.append(blocks[0])
    clock.now = 1.0
    free(queue, [blocks[1]], Retention(50), "other")
    assert pop_all(queue) == [0, 1]  # still the one-shot class: 10


def test_an_evicted_block_forgets_it_was_shared() -> None:
    clock = Clock()
    blocks = [KVCacheBlock(0), KVCacheBlock(1)]
    queue = SessionFreeQueue(blocks, clock=clock)
    one_shot = retention(SessionMeta(None), KvPolicy())
    queue.tag(one_shot, "a")
    assert queue.popleft() is blocks[0]  # a fills block 0
    queue.append(blocks[0])
    queue.tag(one_shot, "b")
    queue.note_use(blocks[0])  # b hits it: shared
    queue.remove(blocks[0])
    queue.append(blocks[0])  # 90
    queue.tag(one_shot, "c")
    assert ids(queue.popleft_n(2)) == [1, 0]  # c evicts it and fills it anew
    queue.append(blocks[0])  # c's own block now: 10
    clock.now = 1.0
    free(queue, [blocks[1]], Retention(50), "d")
    assert pop_all(queue) == [0, 1]


def test_popleft_on_an_empty_queue_raises() -> None:
    queue, _, _ = drained(2)
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        SessionFreeQueue([]).popleft()


def test_popleft_n_beyond_the_free_blocks_raises_and_pops_nothing() -> None:
    queue, b, _ = drained(3)
    free(queue, b[0:2], Retention(80))
    with pytest.raises(ValueError, match="3"):
        queue.popleft_n(3)
    assert queue.num_free_blocks == 2
    assert ids(queue.get_all_free_blocks()) == [1, 0]


def test_remove_of_a_block_that_is_not_free_raises() -> None:
    queue, b, _ = drained(3)
    free(queue, [b[0]], Retention(80))
    with pytest.raises(RuntimeError, match="not free"):
        queue.remove(b[1])  # in use
    queue.remove(b[0])
    with pytest.raises(RuntimeError, match="not free"):
        queue.remove(b[0])  # removed already
    assert queue.num_free_blocks == 0
