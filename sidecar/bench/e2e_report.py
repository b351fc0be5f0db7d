"""What ``bench e2e`` reports: the must-show comparisons, each cell's JSON and printed line, the timelines of
its batches with the longest accept, the read cost fitted to the bare reads, and the run's devices and command
line."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sidecar.bench.e2e_common import parse_device

if TYPE_CHECKING:
    from sidecar.bench.e2e import Cell

PEER_FLOOR = 0.8  # must show: bare NIXL bandwidth >= 0.8 x the peer copy's
SIDECAR_FACTOR = 1.05  # must show: kv-sidecar <= 1.05 x bare + 0.2 ms per request
SIDECAR_PER_REQUEST_S = 0.2e-3


def must_show(cell: Cell, peer_gbps: float) -> dict[str, Any]:
    """The two must-show comparisons for one measured cell (medians)."""
    bare = statistics.median(cell.bare_s)
    side = statistics.median(cell.sidecar_s)
    bare_gbps = cell.nbytes / bare / 1e9
    limit = SIDECAR_FACTOR * bare + SIDECAR_PER_REQUEST_S * cell.concurrency
    return {
        "nixl_over_peer": bare_gbps / peer_gbps if peer_gbps else None,
        "nixl_at_least_0.8_peer": bool(peer_gbps) and bare_gbps >= PEER_FLOOR * peer_gbps,
        "sidecar_over_bare": side / bare,
        "sidecar_limit_s": limit,
        "sidecar_within_limit": side <= limit,
    }


def failures(c: dict[str, Any]) -> list[str]:
    ms, out = c["must_show"], []
    if ms["nixl_over_peer"] is None:
        out.append("no peer copy measured to compare the bare NIXL read with")
    elif not ms["nixl_at_least_0.8_peer"]:
        out.append(f"bare NIXL at {ms['nixl_over_peer']:.3f} of the peer copy (< {PEER_FLOOR})")
    if not ms["sidecar_within_limit"]:
        out.append(
            f"kv-sidecar {c['sidecar']['median_s'] * 1e3:.3f} ms > 1.05 x bare + 0.2 ms x "
            f"{c['concurrency']} = {ms['sidecar_limit_s'] * 1e3:.3f} ms"
        )
    if c["verified"].get("mismatches"):
        out.append(f"{c['verified']['mismatches']} converted plane-blocks differ from the reference")
    if not c["verified"].get("requests"):
        out.append(f"the converted bytes were not checked ({c['verified'].get('error', 'no check ran')})")
    if not c["notified"]:
        out.append("the prefill did not free every request by notification")
    return out


def skipped_lines(cells: Sequence[dict[str, Any]]) -> list[str]:
    """One line per cell of a result that was not measured, with why (memory, --max-batch-tokens, the time
    budget, an earlier error): the cells printed as they ran never name them."""
    return [
        f"{c['mode']}/{c['order']} {c['context']} tokens x {c['concurrency']}: skipped: {c['skipped']}"
        for c in cells
        if "skipped" in c
    ]


def quantiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {
        "p50": statistics.median(s) * scale,
        "p99": s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))] * scale,
        "max": s[-1] * scale,
        "n": len(s),
    }


TIMELINES = 3  # batches kept per cell, those whose slowest accept was longest
TIMELINE_HOPS = ("delivery", "accept", "queue", "post", "read", "convert", "return")


def timeline_row(timings: dict[str, float], done_s: float, round_trip_s: float | None) -> dict[str, float]:
    """One request of a batch in ms: when the shim sent its Pull and got its Done (from the batch's start),
    and the hops between (the Done's timings)."""
    row = {k: round(timings[k] * 1e3, 3) for k in TIMELINE_HOPS if k in timings}
    row["done_at"] = round(done_s * 1e3, 3)
    if round_trip_s is not None:
        row["sent_at"] = round((done_s - round_trip_s) * 1e3, 3)
    return row


def keep_timeline(kept: list[dict[str, Any]], rows: list[dict[str, float]], start_s: float) -> None:
    """Keep this batch if its slowest accept is among the ``TIMELINES`` longest so far (``kept`` in order).
    ``start_s``: the batch's start on CLOCK_MONOTONIC (``time.monotonic``), the clock of the daemon's slow
    calls (``loop_pieces``)."""
    worst = max((r.get("accept", 0.0) for r in rows), default=0.0)
    requests = sorted(rows, key=lambda r: r.get("sent_at", 0.0))
    kept.append({"max_accept_ms": worst, "start_s": round(start_s, 6), "requests": requests})
    kept.sort(key=lambda b: -b["max_accept_ms"])
    del kept[TIMELINES:]


def cell_json(c: Cell, peer: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "context": c.context,
        "concurrency": c.concurrency,
        "mode": c.mode,
        "order": c.order,
        "blocks_per_request": c.blocks,
        "bytes": c.nbytes,
    }
    if c.skipped is not None or not c.sidecar_s:
        out["skipped"] = c.skipped or "not run"
        return out
    peer_gbps = peer["GBps"] if peer else 0.0
    bare, side = statistics.median(c.bare_s), statistics.median(c.sidecar_s)
    out.update(
        {
            "peer_copy": {
                "GBps": peer_gbps,
                "s_for_these_bytes": c.nbytes / peer_gbps / 1e9 if peer_gbps else None,
            },
            "bare": {
                "median_s": bare,
                "all_s": c.bare_s,
                "GBps": c.nbytes / bare / 1e9,
                "post_ms": quantiles(c.bare_post_s),
                "descriptors_per_request": c.bare_descriptors,
                "descriptors_per_request_in_request_order": c.bare_descriptors_request_order,
                "gap_bytes": c.bare_gap_bytes,
            },
            "sidecar": {
                "median_s": side,
                "all_s": c.sidecar_s,
                "GBps": c.nbytes / side / 1e9,
                "per_request_end_to_end_ms": quantiles(c.end_to_end_s),
                "shim_round_trip_ms": quantiles(c.round_trip_s),
                "stages_ms": {k: quantiles(v) for k, v in sorted(c.stages_s.items())},
                # the daemon's CPU while its batches ran (user + system seconds / wall seconds)
                "daemon_cpu_cores": sum(c.daemon_cpu_s) / sum(c.sidecar_s) if c.daemon_cpu_s else None,
            },
            "verified": c.verified,
            "notified": c.notified,
            "timelines": c.timelines,
            "must_show": must_show(c, peer_gbps),
        }
    )
    return out


def print_cell(c: Cell, peer_gbps: float) -> None:
    bare, side = statistics.median(c.bare_s), statistics.median(c.sidecar_s)
    bare_post = statistics.median(c.bare_post_s or [0.0])
    ms = must_show(c, peer_gbps)
    ok = "ok" if ms["nixl_at_least_0.8_peer"] and ms["sidecar_within_limit"] else "MISS"
    v = c.verified.get("mismatches")
    check = " bit-exact" if v == 0 else f" MISMATCH {v}" if v else " UNVERIFIED"
    print(
        f"{c.mode:>6} {c.order:>10} {c.context:>6} tok x{c.concurrency:<3} {c.nbytes / 2**20:9.1f} MiB | "
        f"peer {peer_gbps:8.1f} GB/s | bare {c.nbytes / bare / 1e9:7.2f} GB/s {bare * 1e3:9.2f} ms "
        f"(post {bare_post * 1e3:.2f} ms, {c.bare_descriptors} descs/req, "
        f"{c.bare_descriptors_request_order} in request order, "
        f"gaps {c.bare_gap_bytes / 2**20:.1f} MiB) | kv-sidecar {c.nbytes / side / 1e9:7.2f} GB/s "
        f"{side * 1e3:9.2f} ms "
        f"(x{side / bare:.3f}) | {ok}{check}",
        flush=True,
    )


def read_cost_fit(cells: Sequence[Any]) -> dict[str, Any]:
    """``read_descriptor_us`` / ``read_gbps`` fitted to the bare reads' medians (descriptors, bytes
    including gap blocks, seconds): what to set for this host's daemon."""
    from sidecar.nixl.spans import fit_read_cost

    rows = [
        (c.bare_descriptors * c.concurrency, c.nbytes + c.bare_gap_bytes, statistics.median(c.bare_s))
        for c in cells
        if c.bare_s and c.skipped is None
    ]
    if len({r[0] for r in rows}) < 2:
        return {"error": "needs bare reads with at least two different descriptor counts"}
    try:
        cost = fit_read_cost(*(np.array(col, dtype=float) for col in zip(*rows, strict=True)))
    except ValueError as exc:
        return {"error": str(exc), "points": len(rows)}
    return {"read_descriptor_us": cost.descriptor_us, "read_gbps": cost.gbps, "points": len(rows)}


def device_names(devices: set[str]) -> dict[str, str]:
    out = {}
    for d in sorted(devices):
        if d == "cpu":
            model = ""
            with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
                model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
            out[d] = f"CPU {model or platform.processor()} x{os.cpu_count()}"
        else:
            import torch

            out[d] = torch.cuda.get_device_name(parse_device(d))
    return out


def command_line() -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if prog == "kv-sidecar":
        return shlex.join(["kv-sidecar", *sys.argv[1:]])
    if prog in ("e2e.py", "__main__.py"):
        return shlex.join(["python", "-m", "sidecar.bench.e2e", *sys.argv[1:]])
    return shlex.join(sys.argv)


def markdown_rows(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """README rows from committed ``bench e2e`` files, one per cell: the medians of the bare read and of
    kv-sidecar, kv-sidecar's rate, the queue and post stages (– where a mapped pull posted no read), and the
    bit-exact check.

        python -m sidecar.bench.e2e_report bench/results/e2e-h200-c8-c32-compact-2026-12-02.json ..."""
    rows = [
        "| file | request × in flight | mode / order | bare ms | kv-sidecar ms (÷ bare) | kv-sidecar GB/s "
        "| queue p50 / p99 ms | post p50 ms | checked |",
        "|" + "---|" * 9,
    ]
    for name, result in results:
        for c in result["cells"]:
            if c.get("skipped"):
                continue
            bare, sc = c["bare"]["median_s"] * 1e3, c["sidecar"]["median_s"] * 1e3
            st = c["sidecar"]["stages_ms"]
            v = c.get("verified", {}).get("mismatches")
            check = "bit-exact" if v == 0 else f"{v} mismatches" if v else "unverified"
            post = f"{st['post']['p50']:.2f}" if "post" in st else "–"  # a mapped pull posts no read
            rows.append(
                f"| {name} | {c['context'] // 1024}k × {c['concurrency']} | {c['mode']} / {c['order']} "
                f"| {bare:.2f} | {sc:.2f} ({sc / bare:.2f}) | {c['sidecar']['GBps']:.0f} "
                f"| {st['queue']['p50']:.2f} / {st['queue']['p99']:.2f} | {post} | {check} |"
            )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m sidecar.bench.e2e_report FILE...``: README's table rows for ``bench e2e`` result files."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m sidecar.bench.e2e_report", description="README's table rows for bench e2e results"
    )
    parser.add_argument("files", nargs="+", type=Path, help="bench e2e JSON results (bench/results/e2e-*)")
    args = parser.parse_args(argv)
    print(markdown_rows([(f.name, json.loads(f.read_text())) for f in args.files]))


if __name__ == "__main__":
    main()
