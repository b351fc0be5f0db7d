"""``kv-sidecar bench map`` on the CPU: a real emulator, its metadata read, pages read through our own UCP
endpoint and checked, and the mapping's answer (host memory is not mapped without xpmem) in the JSON."""

from __future__ import annotations

import json

from sidecar.bench import remote_map

TINY = [
    "--device",
    "cpu",
    "--prefill-device",
    "cpu",
    "--layers",
    "3",
    "--heads",
    "2",
    "--head-size",
    "64",
    "--context",
    "64",
    "--reps",
    "2",
]


def test_the_probe_reads_and_checks_pages_and_says_whether_ucx_mapped_them(tmp_path):
    out = tmp_path / "map.json"
    assert remote_map.main([*TINY, "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "map" and r["ucx"]["version"].startswith("1.")
    assert (r["prefill"]["mem_type"], r["prefill"]["key_mem_type"]) == ("DRAM", "host")
    assert r["get"] == {"pages": 2, "checked": "bit-exact", "wrong": []}
    mapping = r["mapping"]
    assert mapping["mapped"] or ("unreachable" in mapping["reason"].lower() and mapping["status"] == -6)
    assert r["command"].startswith("kv-sidecar bench map --device cpu")
