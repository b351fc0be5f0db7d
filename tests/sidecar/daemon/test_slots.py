"""The staging pool's slot allocator: first-fit runs, merged when given back."""

from __future__ import annotations

import pytest

from sidecar.daemon.slots import SlotAllocator


def test_slot_allocator_first_fit_and_merge():
    a = SlotAllocator(10)
    assert a.take(4) == 0 and a.take(4) == 4 and a.take(4) is None
    a.give(0, 4)
    assert a.take(3) == 0 and a.free == 3
    a.give(4, 4)
    a.give(0, 3)
    assert a.free == 10 and a.take(10) == 0
    a.give(0, 10)
    with pytest.raises(ValueError, match="given back twice"):
        a.give(2, 2)
