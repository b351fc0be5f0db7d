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


def test_daemon_set_takes_toml_values_as_every_bench_does():
    """``--daemon-set`` means the same in ``bench signal`` as in e2e, loop and interference: TOML values,
    turned into serve flags that the daemon's own flag parsing reads back as the same values."""
    from sidecar.bench.completion_signal import serve_flags
    from sidecar.bench.e2e_common import BenchError
    from sidecar.ops.config import parse_value

    flags = serve_flags(["poll_busy_s=0.0002", 'log_level="DEBUG"', "fast_completions=false"])
    assert flags == ["--poll-busy-s", "0.0002", "--log-level", "DEBUG", "--fast-completions", "false"]
    values = {flags[i][2:].replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    assert {k: parse_value(k, v, "flag") for k, v in values.items()} == {
        "poll_busy_s": 0.0002, "log_level": "DEBUG", "fast_completions": False,
    }
    with pytest.raises(BenchError, match="not a TOML value"):
        serve_flags(["log_level=DEBUG"])
