"""Closing a mapping on a GPU waits for the kernels that may read it (its fence), not for the whole device:
with a conversion held behind a closed gate (``conversion_gates``) a device-wide sync would wait for that
gate, which only the daemon's loop opens, and the loop may be the one closing (a peer removed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sidecar.nixl.mapping import MappedPages, MappingLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


class _Worker:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def _closed_behind_a_gate(fenced: bool) -> tuple[float, bool, int]:
    """Close a mapping, a kernel reading it on its own stream, while a gate holds work on another stream; a
    timer opens the gate after 2 s. ``fenced``: the mapping's fence records on the reader's stream (as the
    daemon's records on its conversion stream). (seconds the close took, whether it returned before the
    timer opened the gate, fences recorded)."""
    from sidecar.convert.gates import Gates

    pages = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")
    reader, held = torch.cuda.Stream(), torch.cuda.Stream()
    fences = []

    def fence():
        fences.append(torch.cuda.Event())
        fences[-1].record(reader)
        return fences[-1]

    mapping = MappedPages(_Worker(), pages, MappingLayout(1, 4, 1 << 20, 1 << 20, 0), 0,
                          fence if fenced else None)
    with torch.cuda.stream(reader):
        pages.add_(1)  # a kernel that reads the mapping
    gates = Gates(1)
    slot = gates.take()
    gates.close_on(held, slot)
    with torch.cuda.stream(held):
        # work behind the gate: a kernel already loaded (the reader's), since a kernel's first launch behind
        # a closed gate makes every stream's later work wait for the gate (an H100, 2026-12-06)
        torch.zeros(16, dtype=torch.uint8, device="cuda:0").add_(1)
    timer = threading.Timer(2.0, gates.open, (slot,))
    timer.start()
    t0 = time.monotonic()
    try:
        mapping.close()
        took, early = time.monotonic() - t0, not gates.is_open(slot)
        assert fences == [] or fences[0].query()  # the reader's kernel had run
    finally:
        timer.join()
    torch.cuda.synchronize()
    gates.give_back(slot)
    assert mapping._worker.closed == 1 and bool((pages == 1).all())
    return took, early, len(fences)


def test_a_mapping_with_a_fence_closes_without_waiting_for_gated_work():
    took, early, fences = _closed_behind_a_gate(True)
    assert early and took < 1.0 and fences == 1, (took, early, fences)


def test_without_a_fence_closing_waits_for_the_whole_device_gated_work_included():
    """The hazard the fence removes (and the proof the test above can fail)."""
    took, early, fences = _closed_behind_a_gate(False)
    assert not early and took >= 1.9 and fences == 0, (took, early, fences)
