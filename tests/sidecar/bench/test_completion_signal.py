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
    assert result["channel"] == "completion_socket"
    assert set(result["channels"]) == {"completion_socket", "zmq"}
    for measured in result["channels"].values():
        (run,) = measured["runs"]
        assert measured["failed"] == run["failed"] == 0 and run["pulls"] == 40
        sig = run["signal_us"]
        assert measured["signal_us"] == sig  # the median of one run is that run
        assert 0 < sig["p50"] <= sig["p99"] <= sig["max"]
        # the signal is a part of the round trip the shim sees
        assert sig["p50"] < run["pull_round_trip_us"]["p50"]
    assert result["signal_us"] == result["channels"]["completion_socket"]["signal_us"]
    assert result["zmq_over_completion_socket"]["p50"] > 0
    assert result["client"].startswith("vllm_glue.client.SidecarClient")
