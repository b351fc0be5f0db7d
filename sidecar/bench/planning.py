"""The CPU cost of planning one read: the loop's pairing and the poster's descriptors, from the ids or from
the loop's pairs.

The daemon pairs a request's block ids once on its event loop (``PairGeometry.blocks``); the poster thread
then builds the descriptors (``NixlReads.table``) from those pairs instead of pairing the ids again, and
holds the GIL for that while the loop waits. This times both paths of the same geometry (a CPU twin's, no
NIXL agent) per request, interleaved call by call so load on the host hits both alike, and checks that they
give the same descriptors. ``--orders`` picks the request's ids: ``contiguous`` (a fresh engine) or
``churned`` (vLLM's free queue after a busy while, ``block_orders.churned``); staging slots are laid out as
the daemon lays them out: in remote-address order (before 2026-12-02's third session in request order, which
left churned descriptors unmerged and overstated their cost), and compact, a ``SpanSlots`` (from the fourth).
``--against`` another tree's ``geometry.py`` (e.g. main's, before the poster took the pairs) times its pairing
and its poster path (from the ids) in the same loop: a before/after on one host at one time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from sidecar.bench.block_orders import churned
from sidecar.nixl.geometry import (
    LocalRegions,
    PairGeometry,
    RemoteRegions,
    StagingPool,
)
from sidecar.nixl.reads import NixlReads
from sidecar.nixl.runs import Descs
from sidecar.nixl.spans import SpanSlots, plan_span
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat, negotiate


def geometries(layers: int, heads: int, head_size: int, block_size: int, num_blocks: int, slots: int
               ) -> tuple[PairGeometry, PairGeometry, StagingPool]:
    """Direct and staged geometries of a standard-page prefill and an AITER-shuffled decoder (made-up
    addresses: nothing is read)."""
    shape = dict(dtype="bfloat16", num_heads=heads, block_size=block_size, head_size=head_size)
    remote_fmt = PageFormat(kind=STANDARD, layout="LBHNC", **shape)
    local_fmt = PageFormat(kind=AITER_SHUFFLED, layout="LHBNC", **shape)
    plan = negotiate(remote_fmt, local_fmt)
    page = remote_fmt.page_bytes
    meta = SimpleNamespace(
        kv_caches_base_addr=[(1 << 30) + i * num_blocks * page for i in range(layers)],
        block_lens=[page] * layers, block_strides=[page] * layers, physical_blocks_per_logical_kv_block=1,
        num_blocks=num_blocks, device_id=0, block_size=block_size, kv_cache_layout="LBHNC",
        region_mem_types=["DRAM"] * layers,
    )
    remote = RemoteRegions.from_metadata(meta)
    half = page // 2
    bases = [(1 << 40) + i * num_blocks * half for i in range(2 * layers)]
    local = LocalRegions.planes(bases[0::2], bases[1::2], half, num_blocks)
    pool = StagingPool(1 << 46, page, slots)
    direct = PairGeometry(plan, remote, local, "direct")
    return direct, PairGeometry(plan, remote, local, "staged", pool=pool), pool


def request_ids(order: str, n: int, num_blocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The (local, remote) ids of one request, read-only as the daemon's ``Job.id_arrays``."""
    if order == "contiguous":
        local, remote = list(range(1, n + 1)), list(range(n + 7, 2 * n + 7))
    elif order == "churned":
        local = churned(num_blocks, random.Random(seed)).take(n)
        remote = churned(num_blocks, random.Random(seed + 1)).take(n)
    else:
        raise ValueError(f"unknown order {order!r}")
    arrays = np.asarray(local), np.asarray(remote)
    for a in arrays:
        a.flags.writeable = False
    return arrays


def load_geometry(path: str) -> Any:
    """Another tree's ``geometry.py`` as its own module (it imports nothing else of the package but
    ``sidecar.wire.formats`` and, from 2026-12-02 on, ``sidecar.nixl.pairing``, which this tree's serves)."""
    spec = importlib.util.spec_from_file_location("planning_other_geometry", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def rebuilt(other: Any, geo: PairGeometry) -> Any:
    """``geo`` made by the other tree's geometry module."""
    pool = None if geo.pool is None else other.StagingPool(**vars(geo.pool))
    return other.PairGeometry(geo.plan, other.RemoteRegions(**vars(geo.remote)),
                              other.LocalRegions(**vars(geo.local)), geo.mode, pool=pool)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Descs):
        return all(np.array_equal(x, y) for x, y in
                   ((a.local, b.local), (a.remote, b.remote), (a.layer_rows, b.layer_rows)))
    return np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)


def measure(args: argparse.Namespace, order: str) -> dict[str, Any]:
    n, tokens = args.blocks, args.blocks * args.block_size
    direct, staged, pool = geometries(args.layers, args.heads, args.head_size, args.block_size,
                                      args.num_blocks, args.layers * n)
    lids, rids = request_ids(order, n, args.num_blocks, args.seed)
    pairs = direct.blocks(lids, rids, tokens)  # what the loop hands the post
    # the daemon's staging slots: a compact span in remote-address order (Staging.take_span, no gaps)
    slots = SpanSlots(0, args.layers, n, plan_span(pairs.remote, pool.slot_bytes, None, 0).pos)

    def table(geo: PairGeometry, mode: str, with_pairs: bool) -> Callable[[], Any]:
        kw = {"pairs": pairs} if with_pairs else {}
        return lambda: NixlReads.table(geo, mode, lids, rids, tokens, pool, slots, **kw)

    calls = {
        "loop_pairing": lambda: direct.blocks(lids, rids, tokens),
        "poster_staged_from_ids": table(staged, "staged", False),
        "poster_staged_from_pairs": table(staged, "staged", True),
        "poster_direct_from_ids": table(direct, "direct", False),
        "poster_direct_from_pairs": table(direct, "direct", True),
    }
    if args.against:
        other = load_geometry(args.against)
        o_direct, o_staged = rebuilt(other, direct), rebuilt(other, staged)
        calls["against_loop_pairing"] = lambda: o_direct.blocks(lids, rids, tokens)
        calls["against_poster_staged_from_ids"] = lambda: o_staged.staged_descs(
            rids, np.asarray(slots), local_block_ids=lids, remote_num_tokens=tokens)
        calls["against_poster_direct_from_ids"] = lambda: o_direct.indices(lids, rids, tokens)
    for mode, geo in (("staged", staged), ("direct", direct)):
        want = table(geo, mode, False)()
        got = [table(geo, mode, True)()]
        if args.against:
            got.append(calls[f"against_poster_{mode}_from_ids"]())
        if not all(_same(want, g) for g in got):
            raise AssertionError(f"{mode}: the paths gave different descriptors")
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.warmup):
        for fn in calls.values():
            fn()
    for _ in range(args.reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {"order": order, "median_us": {k: round(statistics.median(v), 2) for k, v in times.items()},
            "p90_us": {k: round(float(np.percentile(v, 90)), 2) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kv-sidecar bench planning", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--layers", type=int, default=36)
    a("--heads", type=int, default=8)
    a("--head-size", type=int, default=128)
    a("--block-size", type=int, default=16)
    a("--blocks", type=int, default=256, help="kernel blocks per request (4096 tokens of 16)")
    a("--num-blocks", type=int, default=8192, help="blocks per layer in the caches the ids come from")
    a("--orders", default="contiguous,churned", help="comma-separated: contiguous, churned")
    a("--reps", type=int, default=3000)
    a("--warmup", type=int, default=50)
    a("--seed", type=int, default=0)
    a("--against", default=None, help="another tree's sidecar/nixl/geometry.py, timed alongside (before)")
    args = p.parse_args(argv)
    out = {"bench": "planning", "args": vars(args),
           "runs": [measure(args, o) for o in args.orders.split(",")]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
