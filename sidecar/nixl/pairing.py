"""Which local kernel block receives which remote one: vLLM's tail pairing, the padding trim, the id checks,
and ``BlockPairs``, a request's checked pairing that the loop makes once and the poster reads.

Pure numpy, no I/O. ``geometry.py`` turns the pairs into NIXL descriptors; both raise ``GeometryError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.wire.block_ids import increasing, read_only, repeat_in_sorted, within

_I64 = np.int64
_I64_DTYPE = np.dtype(np.int64)  # as_ids' fast path: the daemon's unpacked ids
# A prefill's physical_blocks_per_logical_kv_block past this is refused at admission: vLLM's is its manager
# block size over its attention kernel's (16 or 32 tokens), a few at most; each Pull expands its ids by it.
MAX_BLOCKS_PER_LOGICAL = 256


class GeometryError(ValueError):
    """Sizes, counts, ids or layouts disagree with the negotiated formats; ``field`` names the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def as_ids(values: Sequence[int] | np.ndarray, field: str) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype is _I64_DTYPE and values.ndim == 1:
        return values  # the daemon's unpacked ids: nothing to convert or check
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise GeometryError(field, f"must be a flat list of integers, got {arr.dtype} shape {arr.shape}")
    return arr.astype(_I64, copy=False)


@dataclass(frozen=True)
class PairRule:
    """What a pairing depends on besides the ids: each side's kernel blocks per logical block, the remote's
    kernel block size (padding trim) and the block counts the ids were range-checked against."""

    local_ratio: int
    remote_ratio: int
    remote_block_size: int
    local_limit: int
    remote_limit: int


def _frozen(values: np.ndarray, field: str) -> np.ndarray:
    """``values`` as a flat int64 array nobody can write into (``read_only``; a copy when not int64)."""
    if values.dtype == _I64 and values.ndim == 1:
        return read_only(values)
    out = np.array(values, dtype=_I64)
    if out.ndim != 1:
        raise GeometryError(field, f"must be flat, got shape {out.shape}")
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class BlockPairs:
    """One request's checked kernel block pairs (``PairGeometry.blocks``): local block ``local[i]`` receives
    remote block ``remote[i]``. Read-only (copied unless already), so the loop and the poster thread share
    them; ``rule`` is what they were checked under, so a geometry refuses pairs made for another one."""

    local: np.ndarray  # int64, read-only
    remote: np.ndarray  # int64, read-only
    rule: PairRule

    def __post_init__(self) -> None:
        local, remote = _frozen(self.local, "pairs.local"), _frozen(self.remote, "pairs.remote")
        if local.size != remote.size:
            raise GeometryError("pairs", f"{local.size} local blocks for {remote.size} remote blocks")
        object.__setattr__(self, "local", local)
        object.__setattr__(self, "remote", remote)

    @property
    def count(self) -> int:
        return int(self.local.size)


def single_group(block_ids: Sequence[Any], field: str) -> list[int]:
    """Unwrap vLLM's per-group id lists (``[[...]]``); several groups (HMA) are out of scope."""
    if block_ids and isinstance(block_ids[0], (list, tuple, np.ndarray)):
        if len(block_ids) != 1:
            raise GeometryError(field, f"{len(block_ids)} KV-cache groups; only one (no HMA) is supported")
        return list(block_ids[0])
    return list(block_ids)


def kernel_block_ids(
    logical_ids: Sequence[int] | np.ndarray, ratio: int, field: str, limit: int | None = None
) -> np.ndarray:
    """Logical (manager) block ids to kernel block ids: L -> L*ratio + j, j in [0, ratio). With ``limit``
    (the cache's kernel blocks), a logical id past ``limit // ratio`` is refused before any expansion."""
    ids = as_ids(logical_ids, field)
    if ratio == 1:
        return ids
    if limit is not None:
        _check_logical(ids, ratio, limit, field)
    top = int(ids.max()) if ids.size else 0
    if top >= np.iinfo(_I64).max // ratio:  # would wrap to an in-range kernel id
        raise GeometryError(field, f"block id {top} is past any cache ({ratio} kernel blocks each)")
    return (ids[:, None] * ratio + np.arange(ratio, dtype=_I64)[None, :]).ravel()


def _check_logical(ids: np.ndarray, ratio: int, limit: int, field: str) -> None:
    """Every logical id's kernel blocks within ``limit``: a bad id costs no ``ratio``-fold expansion."""
    logical = limit // ratio
    if ids.size and not within(ids, logical):
        bad = int(ids[(ids < 0) | (ids >= logical)][0])
        raise GeometryError(
            field, f"logical block id {bad} outside [0, {logical}) ({limit} kernel blocks, {ratio} a block)"
        )


def pair_blocks(local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair local kernel blocks with the TAIL of the remote list (vLLM's ``prefill[-len(decode):]``)."""
    n, m = local_ids.size, remote_ids.size
    if n > m:
        raise GeometryError(
            "local_block_ids", f"the decoder asks for {n} kernel blocks but the prefill supplied only {m}"
        )
    return local_ids, remote_ids[m - n :]


def trim_padding(
    local_ids: np.ndarray, remote_ids: np.ndarray, num_tokens: int, block_size: int, local_ratio: int
) -> tuple[np.ndarray, np.ndarray]:
    """Drop the kernel blocks past token ``num_tokens`` at the end of both lists: the remote keeps the first
    ceil(T/N); the local loses the empty tail of its last logical block (it was allocated for T tokens)."""
    if num_tokens < 0:
        raise GeometryError("remote_num_tokens", f"must be >= 0, got {num_tokens}")
    used = -(-num_tokens // block_size)
    if remote_ids.size < used:
        raise GeometryError(
            "remote_block_ids",
            f"{remote_ids.size} kernel blocks cannot hold {num_tokens} tokens of {block_size}",
        )
    pad = local_ratio * -(-num_tokens // (local_ratio * block_size)) - used
    if pad and local_ids.size:
        if local_ids.size < pad:
            raise GeometryError(
                "local_block_ids",
                f"{local_ids.size} kernel blocks, fewer than the {pad} "
                "padding blocks of the last logical block",
            )
        local_ids = local_ids[: local_ids.size - pad]
    return local_ids, remote_ids[:used]


def check_range(ids: np.ndarray, limit: int, field: str, ordered: bool = False) -> None:
    """Every id in [0, limit); ``ordered``: the ids are strictly increasing (only the ends are looked at)."""
    if not ids.size:
        return
    inside = (int(ids[0]) >= 0 and int(ids[-1]) < limit) if ordered else within(ids, limit)
    if not inside:
        bad = ids[(ids < 0) | (ids >= limit)]
        raise GeometryError(field, f"block id {int(bad[0])} outside [0, {limit})")


def check_unique(ids: np.ndarray, field: str, ordered: bool | None = None) -> None:
    """No id twice; ``ordered``: whether the ids are strictly increasing, when the caller knows."""
    if increasing(ids) if ordered is None else ordered:
        return
    dup = repeat_in_sorted(np.sort(ids))
    if dup is not None:
        raise GeometryError(field, f"block id {dup} appears twice; two reads would land in one block")
