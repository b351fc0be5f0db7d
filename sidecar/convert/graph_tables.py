"""Size buckets and table layout of the graph-replayed conversion launch (pure logic; ``graphs`` runs it).

A captured launch has a fixed grid and a fixed ``M``, so a request of ``m`` blocks replays the graph of the
smallest bucket ``b >= m`` (``bucket``). Its table holds ``b`` block ids, ``b`` source rows and the meta table
of its layers. Out of place, rows ``m..b`` repeat row 0 (``fill``), so the extra programs convert block
``ids[0]`` from source row ``rows[0]`` again: the same bytes to the same place, never a block outside the
request. In place that would convert a block twice (scrambling it), so there the extra ids are ``PAD_ID``,
which the in-place kernel skips.
"""

from __future__ import annotations

import numpy as np

from sidecar.convert.tables import ALIGN, META_COLUMNS, layout

EXACT_UP_TO = 16  # requests up to this many blocks get a bucket of their own size
STEPS_PER_OCTAVE = 8  # above it, buckets every 1/8 octave: at most 1/8 (12.5 %) of the work is padding
PAD_ID = -1  # an in-place table's padding id: no block (``in_place_split_kernel`` writes nothing for it)


def bucket(m: int) -> int:
    """The smallest bucket holding ``m`` blocks: ``m`` itself up to ``EXACT_UP_TO``, then a multiple of
    2**(floor(log2 m) - 3), so ``bucket(m) - m < m / STEPS_PER_OCTAVE``."""
    if m < 1:
        raise ValueError(f"a bucket holds at least one block, not {m}")
    if m <= EXACT_UP_TO:
        return m
    step = 1 << (m.bit_length() - 1 - STEPS_PER_OCTAVE.bit_length() + 1)
    return -(-m // step) * step


def table_layout(b: int, layers: int) -> tuple[int, int, int]:
    """Where the ids (at 0), source rows and meta table start in a bucket's int64 table, and its length.
    The source rows follow the ids directly: the kernel reads row ``i`` at ``ids + M + i``."""
    starts, total = layout([2 * b, layers * META_COLUMNS])
    return b, starts[1], max(total, ALIGN)


def fill(
    table: np.ndarray, b: int, ids: np.ndarray, rows: np.ndarray | None, meta: np.ndarray | None
) -> None:
    """Write one request into a bucket-``b`` table: ``ids`` and ``rows`` (``m <= b`` each) padded with row 0,
    then ``meta`` [L, 6] (``tables.meta_table``); None leaves the meta the table holds (the caller wrote the
    same one last time). ``rows`` None: an in-place launch, its ids padded with ``PAD_ID`` (source rows
    left as they are: the in-place kernel reads none)."""
    m = ids.size
    if not 0 < m <= b or (rows is not None and rows.size != m):
        got = "no" if rows is None else rows.size
        raise ValueError(f"{m} ids and {got} source rows do not fit a bucket of {b}")
    if meta is not None:
        _, meta_at, total = table_layout(b, len(meta))
        if table.shape != (total,) or meta.shape[1:] != (META_COLUMNS,):
            raise ValueError(f"the table has shape {table.shape}, a bucket of {b} needs ({total},)")
        table[meta_at : meta_at + meta.size] = meta.ravel()
    elif table.shape[0] < 2 * b:
        raise ValueError(f"the table has shape {table.shape}, a bucket of {b} needs at least ({2 * b},)")
    table[:m] = ids
    if rows is None:
        table[m:b] = PAD_ID
        return
    table[b : b + m] = rows
    if m < b:
        table[m:b] = ids[0]
        table[b + m : 2 * b] = rows[0]
