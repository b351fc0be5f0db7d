#!/usr/bin/env python3
"""Drop packages nothing here imports from the wheels in ``.whl``, so tree + ``.whl`` fit the device tool's
64 MiB carry limit.

``../shared/tools/gpu-wheels.sh`` fetches nixl-cu13 1.5.1, 56 MiB of which 27 MiB is ``nixl_ep_cu13`` (NIXL's
expert-parallel library; kv-sidecar never imports it). With it the carry was refused twice (2026-12-04); a
wheel rewritten without it installs and every GPU test passed. The wheel's RECORD loses the dropped files'
lines, so pip's hash check still covers every file left.

    python3 scripts/slim-wheels.py            # rewrites .whl/*.whl in place; prints what it saved
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

DROP = ("nixl_ep_cu13/",)  # top-level folders of a wheel that nothing in this repository imports


def slim(wheel: Path, drop: tuple[str, ...] = DROP) -> int:
    """Rewrite ``wheel`` without entries under ``drop`` and their RECORD lines; bytes saved (0: untouched)."""
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        dropped = [i for i in infos if i.filename.startswith(drop)]
        if not dropped:
            return 0
        tmp = wheel.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if info.filename.startswith(drop):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    kept = [ln for ln in data.decode().splitlines() if not ln.startswith(drop)]
                    data = ("\n".join(kept) + "\n").encode()
                out.writestr(info, data)
    before = wheel.stat().st_size
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default=".whl", type=Path)
    args = ap.parse_args(argv)
    wheels = sorted(args.folder.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {args.folder} (run ../shared/tools/gpu-wheels.sh first)", file=sys.stderr)
        return 1
    for wheel in wheels:
        saved = slim(wheel)
        if saved:
            print(f"{wheel.name}: {saved / 2**20:.1f} MiB of {', '.join(DROP)} dropped")
    total = sum(w.stat().st_size for w in wheels)
    print(f"{args.folder}: {total / 2**20:.1f} MiB in {len(wheels)} wheels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
