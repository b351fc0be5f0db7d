"""``kv-sidecar bench pull`` end to end, small: both modes read, verified and timed against bare NIXL."""

import json
import subprocess
import sys

import pytest


@pytest.mark.e2e
def test_bench_pull_reports_ours_bare_and_release(tmp_path):
    out = tmp_path / "pull.json"
    args = ["bench", "pull", "--layers", "4", "--blocks", "8", "--reps", "2", "--warmup", "1",
            "--index-layers", "4", "--index-blocks", "8", "--index-reps", "20", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["index_build"]["direct_indices"]["descriptors"] == 4 * 8 * 2
    for mode in ("direct", "staged"):
        r = result["throughput"][mode]
        assert r["descriptors"]["ours"] == r["descriptors"]["bare"] > 0  # the very same descriptors
        assert all(v > 0 for v in r["GBps"].values())
        assert set(r["release_median_s"]) == {"ours", "bare"}
        assert r["ours_over_bare"] == pytest.approx(r["GBps"]["ours"] / r["GBps"]["bare"])
