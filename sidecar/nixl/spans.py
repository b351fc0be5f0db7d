"""Staged read spans: which gaps between a request's remote blocks to read through, where each block lands.

Pure (numpy, no I/O). A staged read puts whole remote pages into staging slots; pages adjacent on both sides
merge into one descriptor. Slots are laid out in remote-address order, so neighbouring remote blocks merge
whatever order the request lists them in, and a small gap between two needed blocks can be read too (into
staging only, never decoder memory) when one more descriptor costs more than the gap's bytes. A gap's bytes
are another request's KV from the same prefill: they are read into staging and never converted or kept.

Per layer, bridging a gap of ``k`` blocks saves one descriptor and reads ``k`` more pages; both scale with the
layer count, so the choice is the same for every layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from sidecar.wire.block_ids import consecutive

_I64 = np.int64


@dataclass(frozen=True)
class ReadCost:
    """The read cost model: fixed CPU/NIXL time per descriptor plus bytes at a rate."""

    descriptor_us: float  # what one more descriptor costs (µs)
    gbps: float  # bytes per ns (GB/s) of a large read

    def __post_init__(self) -> None:
        if not self.descriptor_us >= 0 or not self.gbps > 0:
            raise ValueError(f"need descriptor_us >= 0 and gbps > 0, got {self.descriptor_us}, {self.gbps}")

    def bytes_us(self, nbytes: int) -> float:
        """Time to move ``nbytes`` at ``gbps`` (µs)."""
        return nbytes / (self.gbps * 1e3)

    def max_gap_blocks(self, page_bytes: int) -> int:
        """The longest gap (in pages) still cheaper to read than one more descriptor."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        per_page = self.bytes_us(page_bytes)
        # strictly cheaper: k * per_page < descriptor_us
        k = int(self.descriptor_us // per_page)
        return max(0, k - 1 if k * per_page >= self.descriptor_us else k)


@dataclass(frozen=True, eq=False)
class Span:
    """A request's staged layout: ``width`` slots per layer in remote order.

    ``pos[i]``: the slot (within a layer) of the request's block ``i``. The gaps read only to merge runs are
    kept as runs (``gap_starts``, ``gap_sizes``, ``gap_rows``: each gap's first remote id, length and first
    slot); ``gap_ids`` / ``gap_pos`` spell them out when first asked for, which is the poster thread when it
    builds the descriptors, not the loop that planned the span."""

    width: int
    pos: np.ndarray  # int64 (n,)
    gap_starts: np.ndarray  # int64 (runs,)
    gap_sizes: np.ndarray  # int64 (runs,)
    gap_rows: np.ndarray  # int64 (runs,)
    gap_blocks: int = 0  # gap_sizes' sum

    @property
    def gap_runs(self) -> int:
        """Gaps read: each merges two runs of needed blocks (two gaps are never adjacent)."""
        return int(self.gap_sizes.size)

    @functools.cached_property
    def gap_ids(self) -> np.ndarray:
        """int64 (gap_blocks,): the gap blocks' remote ids, ascending."""
        return _run_ids(self.gap_starts, self.gap_sizes)

    @functools.cached_property
    def gap_pos(self) -> np.ndarray:
        """int64 (gap_blocks,): their slots within a layer (each gap follows the block before it)."""
        return _run_ids(self.gap_rows, self.gap_sizes)


@dataclass(frozen=True, eq=False)
class GapRead:
    """Remote kernel ids read into staging only to merge runs, and their slots ``[layers, g]``."""

    remote_ids: np.ndarray  # int64 (g,)
    slots: np.ndarray | SpanSlots  # (layers, g)

    @property
    def size(self) -> int:
        """Pages read for the gaps (every layer)."""
        return int(self.slots.size)


@dataclass(frozen=True, eq=False)
class SpanGaps:
    """A span's gaps at its staging run (``first``), read like a ``GapRead``; their ids and slots are made
    when first read (``Span.gap_ids``)."""

    span: Span
    first: int
    layers: int

    @property
    def remote_ids(self) -> np.ndarray:
        return self.span.gap_ids

    @functools.cached_property
    def slots(self) -> SpanSlots:
        span = self.span
        return SpanSlots(self.first, self.layers, span.width, span.gap_pos)

    @property
    def size(self) -> int:
        """Pages read for the gaps (every layer)."""
        return self.layers * self.span.gap_blocks


_NONE = np.empty(0, _I64)  # "no gaps", shared (read-only)
_NONE.flags.writeable = False


def plan_gaps(needed: np.ndarray, page_bytes: int, cost: ReadCost | None, budget_blocks: int) -> np.ndarray:
    """Remote ids of the gaps worth reading between the sorted unique ``needed`` ids: each gap shorter than
    ``cost.max_gap_blocks``, shortest first (every gap saves the same one descriptor), at most
    ``budget_blocks`` gap ids in all. ``cost`` None: no gaps."""
    ids = np.asarray(needed, dtype=_I64)
    if ids.size >= 2 and (np.diff(ids) <= 0).any():
        raise ValueError("needed ids must be sorted and unique")
    after, sizes = _gap_runs(ids, page_bytes, cost, budget_blocks)
    return _run_ids(ids[after] + 1, sizes)


def _gap_runs(
    ids: np.ndarray, page_bytes: int, cost: ReadCost | None, budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """``plan_gaps``' choice as runs: the ascending indices ``j`` whose gap (``ids[j]+1 .. ids[j+1]-1``) is
    read, and each gap's length."""
    if cost is None or budget <= 0 or ids.size < 2:
        return _NONE, _NONE
    limit = cost.max_gap_blocks(page_bytes)
    if limit <= 0:
        return _NONE, _NONE
    lens = np.diff(ids) - 1
    cand = np.flatnonzero((lens > 0) & (lens <= limit))
    if int(lens[cand].sum()) > budget:  # not every candidate fits: the shortest first
        order = cand[np.argsort(lens[cand], kind="stable")]
        cand = np.sort(order[np.cumsum(lens[order]) <= budget])
    return cand, lens[cand]


def _run_ids(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Every id of the runs ``starts[j] .. starts[j] + sizes[j] - 1``, in order, vectorised."""
    offsets = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    return offsets + np.arange(int(sizes.sum()), dtype=_I64)


@functools.lru_cache(maxsize=64)
def identity_rows(n: int) -> np.ndarray:
    """``0 .. n-1`` (int64, read-only, shared): the rows of a span whose blocks are in remote order already.
    Made once per length: on the loop each numpy call of a pull costs microseconds when its code is cold."""
    rows = np.arange(n, dtype=_I64)
    rows.flags.writeable = False
    return rows


def plan_span(remote_ids: np.ndarray, page_bytes: int, cost: ReadCost | None, budget_blocks: int) -> Span:
    """Slots in remote-address order for a request's remote kernel ids (request order), with the gaps worth
    reading (``plan_gaps``). Repeated ids (never sent by a prefill) keep the request order and no gaps."""
    rk = np.asarray(remote_ids, dtype=_I64)
    n = rk.size
    # back to back already (a fresh prefill's blocks): no sort, which would let go of the GIL
    if consecutive(rk):
        return _no_gaps(n, identity_rows(n))
    order = np.argsort(rk, kind="stable")
    needed = rk[order]
    if n > 1 and (needed[1:] == needed[:-1]).any():
        return _no_gaps(n, identity_rows(n))
    after, sizes = _gap_runs(needed, page_bytes, cost, budget_blocks)
    rows = np.arange(n, dtype=_I64)  # sorted block i's slot: i, plus the gap blocks read before it
    if after.size:
        shift = np.zeros(n, _I64)
        shift[after + 1] = sizes
        rows += np.cumsum(shift)
    pos = np.empty(n, _I64)
    pos[order] = rows
    if after.size == 0:
        return _no_gaps(n, pos)
    gap_blocks = int(sizes.sum())
    # a gap's blocks follow the block before it, in the slots after that block's
    return Span(n + gap_blocks, pos, needed[after] + 1, sizes, rows[after] + 1, gap_blocks)


def _no_gaps(n: int, pos: np.ndarray) -> Span:
    return Span(n, pos, _NONE, _NONE, _NONE)


@dataclass(frozen=True, eq=False)
class SpanSlots:
    """A staging span's slots without their ``[layers, n]`` matrix: layer ``l``'s slot of row ``rows[i]`` is
    ``first + l * width + rows[i]``. Kept compact because every numpy operation over more than ~500
    elements lets go of the GIL, and getting it back while the other thread (the loop or the poster) runs
    Python costs up to a switch interval (0.5 ms in the daemon), for each such operation.
    ``np.asarray`` gives the matrix (``span_slots``)."""

    first: int
    layers: int
    width: int
    rows: np.ndarray  # int64 (n,)

    @property
    def shape(self) -> tuple[int, int]:
        return self.layers, int(self.rows.size)

    @property
    def size(self) -> int:
        return self.layers * int(self.rows.size)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        m = span_slots(self.first, self.layers, self.width, self.rows)
        return m if dtype is None else m.astype(dtype)


def span_slots(first_slot: int, layers: int, width: int, pos: np.ndarray) -> np.ndarray:
    """Slots ``[layers, len(pos)]`` of a run starting at ``first_slot``: layer ``l`` owns ``width`` slots."""
    p = np.asarray(pos, dtype=_I64)
    return first_slot + np.arange(layers, dtype=_I64)[:, None] * width + p[None, :]


def span_saving_us(span: Span, layers: int, page_bytes: int, cost: ReadCost) -> float:
    """What reading ``span``'s gaps saves over reading the request's blocks alone (µs, every layer): each
    gap merges two runs (one descriptor less a layer) and costs its pages' bytes."""
    return layers * (span.gap_runs * cost.descriptor_us - cost.bytes_us(span.gap_blocks * page_bytes))


def worth_waiting(saving_us: float, page_bytes: int, cost: ReadCost, missing_slots: int) -> bool:
    """Whether to wait for the slots a gap span needs rather than read without gaps now: the reads in
    flight free ``missing_slots`` pages at about ``cost.gbps``, and the gaps save ``saving_us``
    (``span_saving_us``, which the caller also bounds the wait by)."""
    return saving_us > cost.bytes_us(max(0, missing_slots) * page_bytes)


def count_runs(sorted_ids: np.ndarray) -> int:
    """Descriptors per layer of a read of these sorted unique remote ids into slots in the same order."""
    ids = np.asarray(sorted_ids, dtype=_I64)
    return 0 if ids.size == 0 else int(1 + (np.diff(ids) != 1).sum())


def fit_read_cost(descriptors: np.ndarray, nbytes: np.ndarray, seconds: np.ndarray) -> ReadCost:
    """Least squares ``seconds = descriptors * a + nbytes / b`` over measured reads (a ≥ 0, b > 0)."""
    d = np.asarray(descriptors, dtype=float)
    b = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if d.size < 2 or not (d.size == b.size == t.size):
        raise ValueError("need at least two measured reads of equal-length descriptors, bytes and times")
    (a, inv), *_ = np.linalg.lstsq(np.stack([d, b], axis=1), t, rcond=None)
    if inv <= 0:
        raise ValueError("the reads do not show a positive byte rate (need reads of different sizes)")
    # plain floats: bench e2e prints them as the values to set in a daemon's config
    return ReadCost(descriptor_us=max(0.0, float(a) * 1e6), gbps=float(1.0 / inv / 1e9))
