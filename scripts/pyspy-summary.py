#!/usr/bin/env python3
"""Summarise a py-spy raw profile (``record --threads --format raw``, optionally gzipped) as JSON: samples per
thread, and per thread the functions that hold the most samples themselves (self) and below them (inclusive).

    python3 scripts/pyspy-summary.py daemon-4096-x8.txt.gz --top 25 > summary.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

_THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)(?::\s*(.*))?$")


def summarise(lines: list[str], top: int) -> dict:
    by_thread: collections.Counter[str] = collections.Counter()
    self_: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        m = _THREAD.match(frames[0])
        thread = (m.group(2) or m.group(1)) if m else "?"
        names = [f.split(" (", 1)[0] for f in (frames[1:] if m else frames)]
        n = int(count)
        by_thread[thread] += n
        if names:
            self_[thread][names[-1]] += n
        for name in set(names):
            incl[thread][name] += n
    return {
        "samples_by_thread": dict(by_thread.most_common()),
        "self_top": {t: dict(c.most_common(top)) for t, c in self_.items()},
        "inclusive_top": {t: dict(c.most_common(top)) for t, c in incl.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="py-spy raw output (.txt or .txt.gz)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    opener = gzip.open if args.profile.endswith(".gz") else open
    with opener(args.profile, "rt") as f:
        print(json.dumps(summarise(f.readlines(), args.top), indent=1))


if __name__ == "__main__":
    main()
