"""First-fit allocation of runs of adjacent slots in the staging pool (pure)."""

from __future__ import annotations


class SlotAllocator:
    """First-fit runs of adjacent slots in the staging pool (adjacent slots let NIXL merge descriptors)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[tuple[int, int]] = [(0, num_slots)] if num_slots else []  # (start, length), sorted

    @property
    def free(self) -> int:
        return sum(n for _, n in self._free)

    def take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def give(self, start: int, n: int) -> None:
        if n <= 0:
            return
        runs = sorted([*self._free, (start, n)])
        merged: list[tuple[int, int]] = []
        for s, length in runs:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            elif merged and merged[-1][0] + merged[-1][1] > s:
                raise ValueError(f"slots {s}..{s + length} given back twice")
            else:
                merged.append((s, length))
        self._free = merged
