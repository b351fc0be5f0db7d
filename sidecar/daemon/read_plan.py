"""Per-request read choices from the config: layer groups ("auto") and the gap cost model."""

from __future__ import annotations

from typing import Any

import numpy as np

from sidecar.nixl.spans import ReadCost, count_runs
from sidecar.wire.block_ids import increasing

AUTO_GROUPS_MIN_BYTES = 1 << 30  # README (two H200s): 4 groups won for a 16k request (2.4 GB), lost at 4k
AUTO_GROUPS = 4


def layer_groups_for(setting: int, request_bytes: int) -> int:
    """``layer_groups`` as configured, or for 0 (auto): 4 for a request of at least 1 GiB, else 1."""
    if setting < 0:
        raise ValueError(f"layer_groups must be >= 0, got {setting}")
    if setting:
        return setting
    return AUTO_GROUPS if request_bytes >= AUTO_GROUPS_MIN_BYTES else 1


def gap_cost(cfg: Any, peer: Any) -> ReadCost | None:
    """The cost model to read gaps with, or None: coalescing off, or the prefill's blocks are not back to
    back in its regions (a stride larger than a page: a gap would never merge)."""
    if not cfg.gap_coalescing or cfg.gap_pool_share <= 0:
        return None
    regions = getattr(peer, "regions", None)
    if regions is not None and (regions.block_stride != regions.block_len).any():
        return None
    return ReadCost(cfg.read_descriptor_us, cfg.read_gbps)


def staged_descriptors(remote: np.ndarray, layers: int) -> int:
    """About how many descriptors a staged read of these remote kernel blocks posts: ``layers`` x the runs of
    consecutive ids (pages go into staging in remote-id order, so a run is one descriptor per layer; gaps
    read to merge runs only lower it, a prefill's K and V in separate regions doubles it). Ids already in
    order (a fresh prefill's) are not sorted: on the loop, sorting over ~500 ids would let go of the GIL."""
    return layers * count_runs(remote if increasing(remote) else np.sort(remote))
