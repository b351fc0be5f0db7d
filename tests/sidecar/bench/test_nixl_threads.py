"""``bench nixl_threads`` on real NIXL (UCX over loopback, DRAM, a target process): it runs, reads every byte
right with two threads on one agent at STRICT, and its GIL meter tells a releasing call from a holding one."""

from __future__ import annotations

import json

from sidecar.bench import nixl_threads


def test_nixl_threads_measures_and_two_threads_read_every_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    out = tmp_path / "nt.json"
    assert nixl_threads.main(["--descs", "4000", "--sync-mode", "STRICT", "--threads-s", "0.5",
                              "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    gil, threads = result["gil"], result["threads"]
    for call in ("get_xfer_descs", "initialize_xfer", "transfer", "make_prepped_xfer", "transfer_prepped"):
        assert gil[call]["ms"] > 0 and "share" in gil[call]  # short calls here: their share is not judged
    # the meter itself: sleep releases the GIL, sorted() holds it
    assert gil["control_sleep"]["share"] > 0.3 > gil["control_sorted"]["share"]
    assert threads["errors"] == [] and threads["bad_bytes"] == 0
    assert threads["big_reads"] > 0 and threads["small_reads"] > 0
