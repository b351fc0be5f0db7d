"""What held the daemon while a Pull waited: ``bench e2e``'s timelines laid over ``loop_pieces``' slow calls.

``bench e2e`` keeps, per cell, the batches with the longest accept (``timelines``: each request's hops from
the batch's start, and that start on CLOCK_MONOTONIC); a daemon run with ``loop_pieces`` keeps each call of
``loop_pieces_slow_us`` (0.5 ms by default) or more with its start on the same clock (``<pieces>.slow.json``,
written when the daemon exits). For each kept batch this prints the
Pull that waited longest, from its receipt to its first step, and every slow call (of any thread) that
overlapped that wait. Run both on one host: the clock is the host's.

    python -m sidecar.bench.overlay E2E.json PIECES.slow.json [--batches N]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import msgspec


class SlowCall(msgspec.Struct, frozen=True):
    """One slow call, in ms from its batch's start."""

    piece: str
    thread: str
    began_ms: float
    ended_ms: float
    cpu_ms: float | None


class Wait(msgspec.Struct, frozen=True):
    """A batch's longest accept, in ms from the batch's start, and the slow calls that overlapped it."""

    cell: str
    accept_ms: float
    received_ms: float
    started_ms: float
    overlapping: list[SlowCall]


def waits(e2e: dict[str, Any], slow: Sequence[dict[str, Any]], batches: int = 3) -> list[Wait]:
    """The longest wait of each of a cell's first ``batches`` kept timelines, with what overlapped it."""
    out = []
    for cell in e2e.get("cells", []):
        name = f"{cell.get('mode')}/{cell.get('order')} {cell.get('context')} x {cell.get('concurrency')}"
        for batch in cell.get("timelines", [])[:batches]:
            if "start_s" not in batch or not batch["requests"]:
                continue  # a file from before the timelines carried their start
            late = max(batch["requests"], key=lambda r: r.get("accept", 0.0))
            received = late.get("sent_at", 0.0) + late.get("delivery", 0.0)
            started = received + late.get("accept", 0.0)
            calls = []
            for s in slow:
                began = (s["began_s"] - batch["start_s"]) * 1e3
                ended = began + s["wall_us"] / 1e3
                if ended > received and began < started:
                    cpu = None if s.get("cpu_us") is None else s["cpu_us"] / 1e3
                    thread = s.get("thread", "?")
                    calls.append(SlowCall(s["piece"], thread, round(began, 3), round(ended, 3), cpu))
            out.append(Wait(name, late.get("accept", 0.0), round(received, 3), round(started, 3), calls))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sidecar.bench.overlay", description=__doc__.split("\n")[0])
    ap.add_argument("e2e", help="a bench e2e JSON (its cells' timelines)")
    ap.add_argument("slow", help="the daemon's <pieces>.slow.json of the same run")
    ap.add_argument("--batches", type=int, default=3, help="kept batches per cell to show")
    args = ap.parse_args(argv)
    with open(args.e2e) as f:
        e2e = json.load(f)
    with open(args.slow) as f:
        slow = json.load(f)
    for w in waits(e2e, slow, args.batches):
        print(f"{w.cell}: accept {w.accept_ms:.2f} ms, received at +{w.received_ms:.2f}, first step at "
              f"+{w.started_ms:.2f} ms; {len(w.overlapping)} slow calls overlapped")
        for c in w.overlapping:
            cpu = "" if c.cpu_ms is None else f", cpu {c.cpu_ms:.2f}"
            print(f"  {c.thread:>22} {c.piece:<16} +{c.began_ms:.2f} .. +{c.ended_ms:.2f} ms{cpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
