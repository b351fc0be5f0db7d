"""``kv-sidecar bench map`` on the CPU: a real emulator, its metadata read, pages read through our own UCP
endpoint and checked, and the mapping's answer (host memory is not mapped without xpmem) in the JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from sidecar.bench import remote_map
from sidecar.standins.emulator_pages import expected_pages

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


@pytest.mark.parametrize("corrupt", [False, True])
def test_given_a_mapping_every_page_is_checked_and_every_way_timed(tmp_path, monkeypatch, corrupt):
    """What a GPU run does once UCX maps the region, here with a stand-in mapping (a host buffer holding the
    prefill's bytes at the requested pages): a unit test of the check and the timings, including the bare
    NIXL READ from the real emulator. The real mapping is tests/gpu/test_gpu_remote_map.py. One flipped
    byte turns the verdict to MISMATCH and the exit code to 1."""
    real_map, kept, seen = remote_map._map, [], {}

    def with_stand_in_mapping(rkey, region, meta, fmt, requests, gpu, prefill_gpu, args):
        buf = np.zeros(region.length, dtype=np.uint8)
        for req in requests.values():
            for layer in range(args.layers):
                pages = expected_pages(args.seed, layer, req.kernel_block_ids, req.block_generations, fmt)
                for page, block in zip(pages, req.kernel_block_ids, strict=True):
                    at = meta.kv_caches_base_addr[layer] - region.addr + block * fmt.page_bytes
                    buf[at : at + fmt.page_bytes] = page
        first = seen["first"] = next(iter(requests.values())).kernel_block_ids[0]
        if corrupt:
            buf[meta.kv_caches_base_addr[0] - region.addr + first * fmt.page_bytes] ^= 1
        kept.append(buf)
        mapping = SimpleNamespace(ptr=lambda addr: buf.ctypes.data + addr - region.addr)
        return real_map(mapping, region, meta, fmt, requests, gpu, prefill_gpu, args)

    monkeypatch.setattr(remote_map, "_map", with_stand_in_mapping)
    out = tmp_path / "map.json"
    assert remote_map.main([*TINY, "--out", str(out)]) == (1 if corrupt else 0)
    mapping = json.loads(out.read_text())["mapping"]
    assert mapping["mapped"] and mapping["checked"] == ("MISMATCH" if corrupt else "bit-exact")
    assert mapping["wrong"] == ([[0, seen["first"]]] if corrupt else [])
    for order in ("contiguous", "random"):
        ways = mapping["orders"][order]
        assert set(ways) == {"gather_mapped", "gather_local", "copy_local", "nixl_read"}
        assert all(w["ms"] > 0 for w in ways.values()) and ways["copy_local"]["over_copy"] == 1.0
