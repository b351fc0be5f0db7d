"""``kv-sidecar bench signal`` end to end, small: every Pull answered ok and every latency measured."""

import json
import subprocess
import sys

import pytest


@pytest.mark.e2e
def test_bench_signal_reports_latencies(tmp_path):
    out = tmp_path / "signal.json"
    args = ["bench", "signal", "--pulls", "40", "--warmup", "4", "--concurrency", "4", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", *args], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["pulls"] == 40
    sig = result["signal_us"]
    assert 0 < sig["p50"] <= sig["p99"] <= sig["max"]
    # the signal is a part of the round trip the shim sees
    assert sig["p50"] < result["pull_round_trip_us"]["p50"]
    assert result["client"].startswith("vllm_glue.client.SidecarClient")
