"""``Staged.source_index``: the converter gets a source index only where block i is not staging row i."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sidecar.daemon.staging import Staged
from sidecar.nixl.spans import SpanSlots, plan_span


def _staged(width: int, pos: list[int]) -> Staged:
    p = np.asarray(pos, dtype=np.int64)
    return Staged(pool=None, slots=SpanSlots(0, 1, width, p), run=(0, width), gaps=None)


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_identity_layout_needs_no_index(n):
    assert _staged(n, list(range(n))).source_index is None


@pytest.mark.parametrize("perm", [p for p in itertools.permutations(range(4)) if list(p) != [0, 1, 2, 3]])
def test_every_other_order_keeps_its_index(perm):
    got = _staged(4, list(perm)).source_index
    assert got is not None and got.tolist() == list(perm)


def test_a_span_with_gap_rows_keeps_its_index_even_when_ascending():
    # rows 0, 2, 3 of a 4-row span: ascending, yet row 1 is a gap block
    assert _staged(4, [0, 2, 3]).source_index.tolist() == [0, 2, 3]


@pytest.mark.parametrize("seed", range(20))
def test_planned_spans_convert_the_same_rows_with_or_without_the_shortcut(seed):
    """For spans as the daemon plans them (remote order, no gaps), the index it drops is the identity."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(200, size=int(rng.integers(1, 30)), replace=False)
    span = plan_span(ids, 4096, None, 0)
    staged = _staged(span.width, span.pos.tolist())
    rows = staged.source_index if staged.source_index is not None else np.arange(ids.size)
    assert rows.tolist() == span.pos.tolist()
    assert (staged.source_index is None) == bool((np.diff(ids) > 0).all())
