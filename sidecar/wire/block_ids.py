"""Block id checks shared by the Pull's decode, the pairing, the staged-read planning and the converter
(pure numpy, no I/O).

They only answer; each caller words its own refusal, naming its own field.
"""

from __future__ import annotations

import numpy as np


def increasing(ids: np.ndarray) -> bool:
    """Strictly increasing (contiguous ids and slots are): then unique, and bounded by the first and last."""
    return ids.size < 2 or bool((ids[1:] > ids[:-1]).all())  # slices: a third of np.diff's cost


def consecutive(ids: np.ndarray) -> bool:
    """``ids[0], ids[0] + 1, ...`` (a fresh prefill's blocks, an in-order span's slots): a first-last test,
    then ``increasing``. Empty ids are not."""
    return ids.size > 0 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and increasing(ids)


def repeat_in_sorted(ordered: np.ndarray) -> int | None:
    """The smallest id that appears twice in ``ordered`` (sorted ascending), or None."""
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    return int(dup[0]) if dup.size else None


def read_only(ids: np.ndarray) -> np.ndarray:
    """``ids`` as an array nobody can write into: itself when it and every array it views are read-only
    already (the daemon's id arrays), else a read-only copy."""
    a = ids
    while isinstance(a, np.ndarray) and not a.flags.writeable:
        a = a.base
    if a is None:
        return ids
    out = ids.copy()
    out.flags.writeable = False
    return out


def within(ids: np.ndarray, limit: int) -> bool:
    """Every id in [0, limit). int64 ids take one pass: read as uint64, a negative id is above any limit."""
    if not ids.size:
        return True
    if ids.dtype == np.int64:
        return int(ids.view(np.uint64).max()) < limit
    return int(ids.min()) >= 0 and int(ids.max()) < limit
