"""The interference bench's daemon source on a GPU, small: the Qwen3-8B decode step over 4 running requests,
the real daemon on ``cuda:0`` converting pulled 4k and 16k requests, without and with an MPS cap.

Checks that it runs as the lead's full command will (CUDA IPC registration, NIXL reads of VRAM, conversion on
the daemon's stream, MPS started as a user process) and that every phase's first request is bit-exact. The
JSON and PNG go to ``$KV_SIDECAR_BENCH_OUT/interference-daemon-smoke`` when that variable is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from sidecar.bench import interference
from sidecar.convert.gpu_share import mps_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_daemon_source_on_gpu(tmp_path) -> None:
    out = tmp_path
    if os.environ.get("KV_SIDECAR_BENCH_OUT"):
        out = Path(os.environ["KV_SIDECAR_BENCH_OUT"]) / "interference-daemon-smoke"
    rc = interference.main(["--device", "cuda:0", "--batch", "4", "--context-min", "1024", "--context-max",
                            "2048", "--cells", "4096:20 16384:10", "--settings", "none,mps-cap", "--phase-s",
                            "1.5", "--alone-reps", "3", "--out", str(out)])
    r = json.loads((out / "interference.json").read_text())
    assert rc == 0, [g.get("error") for g in r["groups"]]
    none, cap = r["groups"]
    assert none["daemon_mode_line"].startswith("conversions: GPU 0") and "no MPS" in none["daemon_mode_line"]
    assert none["attention_rel_err"] < 2e-2
    groups = [none]
    if mps_available() and torch.version.hip is None:
        assert "active thread percentage 20%" in cap["daemon_mode_line"]
        groups.append(cap)
    else:
        assert "MPS" in cap["skipped"]
    for g in groups:
        assert all(a["ok"] == 3 for a in g["alone"].values())
        assert [(p["context"], p["rate"]) for p in g["phases"]] == [(4096, 20.0), (16384, 10.0)]
        for p in g["phases"]:
            assert p["pulls"]["ok"] >= 1 and p["pulls"]["ok"] == p["pulls"]["answered"]
            assert p["verified"]["requests"] == 1 and p["verified"]["mismatches"] == 0
            assert p["step"]["n"] > 10
