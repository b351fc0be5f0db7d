"""``kv-sidecar bench e2e``: its pure parts (options, cells, sizing), then a small CPU run."""

import argparse
import json
import subprocess
import sys
import time

import pytest

from sidecar.bench import e2e


def test_cells_smallest_first_and_over_size_skipped() -> None:
    pairs = [("direct", "random"), ("staged", "random")]
    cells = e2e.plan_cells([4096, 16384], [1, 8, 32], pairs, 16, 65536, 36, 131072)
    sizes = [c.concurrency * c.blocks for c in cells]
    assert sizes == sorted(sizes) and len(cells) == 12
    skipped = {(c.context, c.concurrency) for c in cells if c.skipped}
    assert skipped == {(16384, 32)}
    c = next(c for c in cells if (c.context, c.concurrency) == (4096, 8))
    assert c.blocks == 256 and c.nbytes == 8 * 256 * 36 * 65536
    assert e2e.plan_cells([40], [3], [("staged", "contiguous")], 16, 4096, 2, 0)[0].blocks == 3


def test_sizing_caps_the_staging_pool_but_fits_one_request() -> None:
    cells = e2e.plan_cells([4096], [1, 8], [("direct", "random"), ("staged", "random")], 16, 65536, 36, 0)
    request = 256 * 36 * 65536  # one 4k request: 0.6 GB
    assert e2e.sizing(cells, 36, 65536, staging_gb=1.0) == (8 * 256, 2**30)  # the cap
    assert e2e.sizing(cells, 36, 65536, staging_gb=100.0) == (8 * 256, 8 * request)  # the largest batch
    assert e2e.sizing(cells, 36, 65536, staging_gb=0.1) == (8 * 256, request)  # raised to one request
    direct = e2e.plan_cells([4096], [8], [("direct", "random")], 16, 65536, 36, 0)
    assert e2e.sizing(direct, 36, 65536, 16.0) == (2048, 0)


def test_memory_check_skips_the_largest_batches_that_do_not_fit() -> None:
    cells = e2e.plan_cells([4096], [1, 8, 32], [("staged", "contiguous")], 16, 65536, 36, 0)
    request = 256 * 36 * 65536  # one 4k request: 0.6 GB
    # On the CPU both sides draw on one host: the prefill's pool, the decoder's, two staging pools (each
    # capped at 1 GiB here). Room for the batches of 8 (with the 10 % slack), not for 32.
    need_8 = 2 * (8 * 256 + 1) * 36 * 65536 + 2 * 2**30
    asked: list[str] = []

    def free(device: str) -> int:
        asked.append(device)
        return int(need_8 * 1.1) + 1

    e2e.memory_check(cells, "cpu", "cpu", 36, 65536, staging_gb=1.0, free=free)
    assert [(c.concurrency, c.skipped is None) for c in cells] == [(1, True), (8, True), (32, False)]
    assert "GiB on cpu, more than is free" in str(cells[2].skipped)
    assert set(asked) == {"cpu"}
    # Two GPUs: each side on its own device; the decoder's side (planes and staging) is the one short.
    cells = e2e.plan_cells([4096], [1], [("staged", "contiguous")], 16, 65536, 36, 0)
    e2e.memory_check(cells, "cuda:0", "cuda:1", 36, 65536, 16.0,
                     free=lambda d: 10 * request if d == "cuda:0" else request)
    assert "on cuda:1" in str(cells[0].skipped)


def test_free_bytes_of_the_host_is_positive() -> None:
    assert e2e.free_bytes("cpu") > 0


def test_options_are_checked() -> None:
    assert e2e.resolve_devices("cpu", "cpu") == ("cpu", "cpu")
    with pytest.raises(e2e.BenchError, match="both sides"):
        e2e.resolve_devices("cpu", "cuda:0")
    with pytest.raises(e2e.BenchError, match="--contexts"):
        e2e.int_list("4k", "contexts")
    with pytest.raises(e2e.BenchError, match="--modes"):
        e2e.choice_list("direct,plain", "modes", ("direct", "staged"))
    ns = argparse.Namespace(pairs="", modes="direct,staged", orders="random,contiguous")
    assert e2e.mode_order_pairs(ns) == [
        ("direct", "random"),
        ("staged", "random"),
        ("direct", "contiguous"),
        ("staged", "contiguous"),
    ]
    ns.pairs = "direct/random, staged/contiguous"
    assert e2e.mode_order_pairs(ns) == [("direct", "random"), ("staged", "contiguous")]
    ns.pairs = "plain/random"
    with pytest.raises(e2e.BenchError, match="--pairs"):
        e2e.mode_order_pairs(ns)
    ns.pairs, ns.orders = "", "churn,density-0.25"
    assert e2e.mode_order_pairs(ns)[-1] == ("staged", "density-0.25")
    assert e2e.block_order("density-0.25") == {"order": "contiguous", "density": 0.25}
    assert e2e.block_order("churn") == {"order": "churn"}
    for bad in ("density-0", "density-2", "density-x", "sorted"):
        with pytest.raises(e2e.BenchError, match="block order"):
            e2e.block_order(bad)


@pytest.mark.e2e
def test_cpu_run_end_to_end(tmp_path) -> None:
    """The CPU twin: emulator, two daemons (direct, staged) and the decoder; every cell measured, bit-exact,
    the prefill freed by notification, and UCX's own logs name the transport that carried the reads."""
    out, logs = tmp_path / "e2e.json", tmp_path / "logs"
    args = [
        *("--prefill-device", "cpu", "--decoder-device", "cpu", "--layers", "2", "--heads", "2"),
        *("--head-size", "64", "--block-size", "16", "--contexts", "40,200", "--concurrency", "3"),
        *("--reps", "1", "--warmup", "0", "--verify-requests", "3", "--verify-layers", "2"),
        *("--out", str(out), "--logs", str(logs), "--check"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.bench.e2e", *args], capture_output=True, text=True, timeout=240
    )
    # the CPU twin cannot meet the GPU must-show (ZMQ + a CPU conversion against a sub-ms memcpy): --check
    # turns that into exit 1, everything else ran
    assert proc.returncode == 1 and "must-show not met" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["devices"]["prefill"] == r["devices"]["decoder"] == "cpu"
    cells = r["cells"]
    assert len(cells) == 8 and not [c for c in cells if "skipped" in c]
    for c in cells:
        assert c["verified"]["mismatches"] == 0 and c["verified"]["requests"] == 3, c
        assert c["verified"]["layers"] == [0, 1] and c["notified"]
        assert c["bare"]["GBps"] > 0 and c["sidecar"]["GBps"] > 0 and c["peer_copy"]["GBps"] > 0
        # the bare post is timed on its own, and is part of the bare read's time
        assert 0 < c["bare"]["post_ms"]["p50"] <= c["bare"]["median_s"] * 1e3 * 1.0001
        assert c["sidecar"]["per_request_end_to_end_ms"]["n"] == 3
        assert {"queue", "handshake", "transfer", "convert", "end_to_end"} <= set(c["sidecar"]["stages_ms"])
        assert c["must_show"]["sidecar_over_bare"] > 0
        (batch,) = c["timelines"]  # one timed batch: kept, each request's hops from the batch's start
        assert len(batch["requests"]) == 3 and 0 < batch["start_s"] < time.monotonic()
        assert batch["max_accept_ms"] == max(req["accept"] for req in batch["requests"])
        for req in batch["requests"]:
            assert 0 <= req["sent_at"] <= req["done_at"] and req["delivery"] + req["accept"] <= req["done_at"]
    by = {(c["mode"], c["order"], c["context"]): c for c in cells}
    # direct: two half-page descriptors per block and layer; staged: whole pages, merged when adjacent
    assert by[("direct", "random", 200)]["bare"]["descriptors_per_request"] == 2 * 2 * 13
    assert by[("staged", "contiguous", 200)]["bare"]["descriptors_per_request"] == 2  # one run per layer
    assert by[("staged", "random", 200)]["bare"]["descriptors_per_request"] > 2
    for c in cells:  # the bare reads read the daemon's spans: remote order and gaps never add descriptors
        assert c["bare"]["descriptors_per_request"] <= c["bare"]["descriptors_per_request_in_request_order"]
        assert c["bare"]["gap_bytes"] >= 0
    assert set(r["read_cost_fit"]) & {"read_descriptor_us", "error"}, r["read_cost_fit"]
    assert r["settings"]["gaps"]["gap_pool_share"] == 0.25
    t = r["transports"]
    for role in ("daemon-direct", "daemon-staged", "bare"):
        assert t[role]["read_transports"] and set(t[role]["read_transports"]) <= {
            "cma",
            "tcp",
            "sysv",
            "posix",
        }
        assert all(r["scope"] == "intra-node" for r in t[role]["reads"])
    assert sorted(p.name for p in logs.glob("daemon-*.toml")) == ["daemon-direct.toml", "daemon-staged.toml"]
    assert r["must_show_failures"]


def test_idle_cpu_pct_measures_a_process_by_pid():
    """A sleeping child uses ~0 % of a core, a spinning one ~100 % (at least a clear share on a busy host)."""
    import subprocess
    import sys

    # each says "up" once its interpreter has started, so the start-up's CPU is not in the window
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    spinner = subprocess.Popen(
        [sys.executable, "-c", "print('up', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sleeper.stdout.readline().strip() == "up" and spinner.stdout.readline().strip() == "up"
        got = e2e.idle_cpu_pct({"sleeper": sleeper.pid, "spinner": spinner.pid}, 0.5)
    finally:
        sleeper.kill()
        spinner.kill()
        sleeper.wait()
        spinner.wait()
    assert got["sleeper"] < 5.0
    assert got["spinner"] > 10.0
