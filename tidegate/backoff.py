"""The waits of a loop that retries until it gets through: a listener resubscribing after
Redis went away (workers/worker.py `CancelListener`; api/auth.py and api/fleet.py may use
it too). Calls that give up after a budget use tenacity instead (workers/retry.py)."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Twice the last wait each time, from `first_s` up to `max_s`, each a random half to
    whole of it, so the processes that lost one Redis together do not all come back at one
    instant; `reset()` once through."""

    def __init__(self, first_s: float = 0.5, max_s: float = 8.0,
                 rand: Callable[[], float] = random.random) -> None:
        self.first_s, self.max_s, self._rand = first_s, max_s, rand
        self._next_s = first_s

    def next_s(self) -> float:
        """The wait before the next try."""
        full = self._next_s
        self._next_s = min(self.max_s, full * 2)
        return full / 2 + self._rand() * full / 2

    def reset(self) -> None:
        self._next_s = self.first_s
