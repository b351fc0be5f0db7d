"""Which block ids a request gets: as vLLM's allocator hands them out after churn, or at a chosen density.

vLLM v1 keeps free KV blocks in one queue (``FreeKVCacheBlockQueue``, ``vllm/v1/core/block_pool.py``): a new
request takes blocks from the front (``popleft_n``), and a finished request's blocks go back at the end in
reverse order, tail block first (``SingleTypeKVCacheManager.free``: "free blocks in reverse order so that the
tail blocks are evicted first"). A fresh engine's queue is 1..N-1 in order (block 0 is the null block), so
its first requests get contiguous ids; after requests of mixed lengths have come and gone, a new request's
ids are runs of various lengths in an order no sort recovers. ``FreeQueue`` replays exactly that; ``churned``
runs a workload through it. ``spread`` picks ids filling a chosen fraction of their span, for density sweeps.
Pure: no I/O, numbers from a seeded ``random.Random``.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable


class FreeQueue:
    """vLLM's free-block queue, as far as which ids come out in which order."""

    def __init__(self, num_blocks: int, *, first: int = 1) -> None:
        self._queue: deque[int] = deque(range(first, num_blocks))
        self._free = set(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def take(self, n: int) -> list[int]:
        """A new request's ``n`` blocks, from the front."""
        if n > len(self._queue):
            raise ValueError(f"{n} blocks asked, {len(self._queue)} free")
        out = [self._queue.popleft() for _ in range(n)]
        self._free.difference_update(out)
        return out

    def remove(self, blocks: Iterable[int]) -> None:
        """Blocks taken by other means (another order, in the emulator): no longer free."""
        for b in blocks:
            if b in self._free:
                self._queue.remove(b)
                self._free.discard(b)

    def give(self, blocks: Iterable[int]) -> None:
        """A finished request's blocks (in its order), returned tail first at the end of the queue."""
        back = list(blocks)[::-1]
        if self._free.intersection(back):
            raise ValueError("a block was given back twice")
        self._queue.extend(back)
        self._free.update(back)

    def peek(self, n: int) -> list[int]:
        """The ids the next ``take(n)`` would return."""
        return [self._queue[i] for i in range(min(n, len(self._queue)))]


def churned(
    num_blocks: int,
    rng: random.Random,
    *,
    rounds: int = 2_000,
    lengths: tuple[int, int] = (1, 64),
    live: float = 0.6,
) -> FreeQueue:
    """A queue after ``rounds`` arrivals of requests of ``lengths`` blocks (uniform, inclusive), finishing in
    random order while at most a ``live`` share of the pool is held: the state of a busy engine."""
    queue = FreeQueue(num_blocks)
    held: list[list[int]] = []
    budget = int(live * (num_blocks - 1))
    in_use = 0
    for _ in range(rounds):
        n = rng.randint(*lengths)
        while held and (in_use + n > budget or len(queue) < n):
            done = held.pop(rng.randrange(len(held)))
            queue.give(done)
            in_use -= len(done)
        if len(queue) < n:
            continue
        held.append(queue.take(n))
        in_use += n
    for blocks in held:
        queue.give(blocks)
    return queue


def spread(free: Iterable[int], n: int, density: float, rng: random.Random) -> list[int]:
    """``n`` ids in ascending order filling ``density`` of their span of the sorted free ids (1.0: a run)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    pool = sorted(free)
    span = min(len(pool), max(n, math.ceil(n / density)))
    if n > span:
        raise ValueError(f"{n} blocks asked, {len(pool)} free")
    start = rng.randrange(len(pool) - span + 1)
    window = pool[start : start + span]
    return sorted(rng.sample(window, n)) if span > n else window


def runs(ids: list[int]) -> int:
    """How many runs of consecutive ids, in the given order (what NIXL can merge into one descriptor)."""
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)
