"""Explicit descriptors and how adjacent copies merge into them: pure numpy, no I/O, no NIXL.

``merge_runs`` merges, per layer, every run of unit copies that is contiguous on both sides; for staged
reads whose layers share one block geometry, ``layer_uniform_runs`` (from a slot matrix) and
``shifted_runs`` (from one row of slots and a shift per layer) compute the same descriptors once on the
ids instead of on every layer. ``geometry.py`` decides which bytes go where; this decides how few
descriptors carry them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sidecar.wire.block_ids import consecutive

_I64, _U64 = np.int64, np.uint64


def layer_group_bounds(layers: int, groups: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layers of each of ``groups`` READs (clamped to 1..``layers``), as even as whole
    layers allow: cut at ``layers * i // groups`` for ``i`` in ``0..groups``, in integers."""
    g = max(1, min(groups, layers))
    return [(layers * i // g, layers * (i + 1) // g) for i in range(g)]


@dataclass(frozen=True, eq=False)
class Descs:
    """Explicit per-request descriptors (Nx3 uint64), grouped by layer: layer l owns rows
    [layer_rows[l], layer_rows[l+1])."""

    local: np.ndarray
    remote: np.ndarray
    layer_rows: np.ndarray  # (layers + 1,) int64

    @property
    def count(self) -> int:
        return int(self.local.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum()) if self.count else 0

    def layer_slice(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.layer_rows[start]), int(self.layer_rows[stop])
        return self.local[a:b], self.remote[a:b]


def merge_runs(
    remote_addr: np.ndarray, local_addr: np.ndarray, unit: np.ndarray, remote_dev: int, local_dev: int
) -> Descs:
    """Explicit descriptors for (groups, n) unit copies of ``unit[g]`` bytes, merging each run that is
    contiguous on BOTH sides into one descriptor; runs never cross groups (layers)."""
    g, n = remote_addr.shape
    if n == 0:
        empty = np.empty((0, 3), _U64)
        return Descs(local=empty, remote=empty.copy(), layer_rows=np.zeros(g + 1, _I64))
    step = unit.astype(_U64)[:, None]
    cont = (remote_addr[:, 1:] == remote_addr[:, :-1] + step) & (
        local_addr[:, 1:] == local_addr[:, :-1] + step
    )
    start = np.ones((g, n), bool)
    start[:, 1:] = ~cont
    first = np.flatnonzero(start.ravel())
    runs = np.diff(np.append(first, g * n))
    lens = runs.astype(_U64) * unit.astype(_U64)[first // n]
    local, remote = np.empty((first.size, 3), _U64), np.empty((first.size, 3), _U64)
    local[:, 0], local[:, 1], local[:, 2] = local_addr.ravel()[first], lens, local_dev
    remote[:, 0], remote[:, 1], remote[:, 2] = remote_addr.ravel()[first], lens, remote_dev
    layer_rows = np.searchsorted(first, np.arange(g + 1, dtype=_I64) * n).astype(_I64)
    return Descs(local=local, remote=remote, layer_rows=layer_rows)


def layer_uniform_runs(
    remote_base: np.ndarray,
    stride: np.ndarray,
    unit: np.ndarray,
    remote_ids: np.ndarray,
    slots: np.ndarray,
    pool_base: int,
    slot_bytes: int,
    remote_dev: int,
    local_dev: int,
) -> Descs | None:
    """``merge_runs`` of a staged read (remote block ``remote_ids[i]`` of each layer into ``slots[l, i]``),
    computed once on the ids instead of on every layer, or None when that does not hold: every layer's
    slots must be the first layer's shifted (a staging span: layer ``l`` owns its own run of slots), and
    ``shifted_runs``' conditions."""
    g, n = slots.shape
    if n == 0 or g == 0:
        return None
    shift = slots[:, 0] - slots[0, 0]
    if not (slots == slots[0] + shift[:, None]).all():
        return None
    return shifted_runs(remote_base, stride, unit, remote_ids, slots[0], shift, pool_base, slot_bytes,
                        remote_dev, local_dev)


def shifted_runs(
    remote_base: np.ndarray,
    stride: np.ndarray,
    unit: np.ndarray,
    remote_ids: np.ndarray,
    row: np.ndarray,
    shift: np.ndarray,
    pool_base: int,
    slot_bytes: int,
    remote_dev: int,
    local_dev: int,
) -> Descs | None:
    """``merge_runs`` of a staged read whose layer ``l`` puts remote block ``remote_ids[i]`` into slot
    ``row[i] + shift[l]``, from the ids and one row (no per-layer matrix), or None unless every layer's
    region has one block stride and length. Then runs start at the same ``i`` in every layer, and a
    layer's descriptors are the first one's moved by the layer's bases."""
    g, n = shift.size, row.size
    if n == 0 or g == 0:
        return None
    st, u = int(stride[0]), int(unit[0])
    if (stride != st).any() or (unit != u).any():
        return None
    ids = remote_ids.astype(_I64, copy=False)
    if st == u == slot_bytes and consecutive(ids) and consecutive(row):
        return _one_run_a_layer(remote_base, ids, row, shift, u, pool_base, remote_dev, local_dev)
    start = np.ones(n, bool)  # slices, not np.diff: a third of its cost on a request's few hundred ids
    start[1:] = ((ids[1:] - ids[:-1]) * st != u) | ((row[1:] - row[:-1]) * slot_bytes != u)
    first = np.flatnonzero(start)
    ends = np.empty(first.size, _I64)
    ends[:-1], ends[-1] = first[1:], n
    lens = (ends - first).astype(_U64) * np.uint64(u)
    runs = first.size
    remote = np.empty((g, runs, 3), _U64)
    remote[:, :, 0] = remote_base.astype(_U64)[:, None] + (ids[first] * st).astype(_U64)[None, :]
    remote[:, :, 1], remote[:, :, 2] = lens, remote_dev
    local = np.empty((g, runs, 3), _U64)
    at = row[first].astype(_I64)[None, :] + shift.astype(_I64)[:, None]
    local[:, :, 0] = np.uint64(pool_base) + at.astype(_U64) * np.uint64(slot_bytes)
    local[:, :, 1], local[:, :, 2] = lens, local_dev
    return Descs(local=local.reshape(-1, 3), remote=remote.reshape(-1, 3),
                 layer_rows=np.arange(g + 1, dtype=_I64) * runs)


def _one_run_a_layer(
    remote_base: np.ndarray,
    ids: np.ndarray,
    row: np.ndarray,
    shift: np.ndarray,
    unit: int,
    pool_base: int,
    remote_dev: int,
    local_dev: int,
) -> Descs:
    """``shifted_runs`` where the remote blocks and the slots are both back to back and pages are packed
    (stride = slot = page): one descriptor a layer, from the first id and slot alone. A fresh prefill's
    blocks read into an in-order span, the common case, without the search for run starts."""
    g, nbytes = shift.size, np.uint64(ids.size * unit)
    remote = np.empty((g, 3), _U64)
    remote[:, 0] = remote_base.astype(_U64) + np.uint64(int(ids[0]) * unit)
    remote[:, 1], remote[:, 2] = nbytes, remote_dev
    local = np.empty((g, 3), _U64)
    local[:, 0] = np.uint64(pool_base) + (int(row[0]) + shift.astype(_I64)).astype(_U64) * np.uint64(unit)
    local[:, 1], local[:, 2] = nbytes, local_dev
    return Descs(local=local, remote=remote, layer_rows=np.arange(g + 1, dtype=_I64))
