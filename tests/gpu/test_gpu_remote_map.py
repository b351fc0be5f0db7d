"""The converting read's first question on a GPU: does UCX map a prefill's VRAM into this process from its
NIXL metadata alone (``ucp_rkey_ptr`` through cuda_ipc), and are the pages read through the mapping the
prefill's, byte for byte? ``kv-sidecar bench map`` against the prefill emulator on the same GPU, with the
timings of a gather through the mapping, from local memory, a device copy and a bare NIXL READ beside it."""

from __future__ import annotations

import json

import pytest
import torch

from sidecar.bench import remote_map

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


def test_a_prefills_vram_is_mapped_and_read_bit_exact_through_the_mapping(tmp_path):
    out = tmp_path / "map.json"
    args = [
        "--device",
        "cuda:0",
        "--prefill-device",
        "cuda:0",
        "--layers",
        "4",
        "--context",
        "1024",
        "--reps",
        "3",
        "--out",
        str(out),
    ]
    rc = remote_map.main(args)
    r = json.loads(out.read_text())
    assert r["prefill"]["mem_type"] == "VRAM" and r["prefill"]["key_mem_type"] in ("cuda", "rocm")
    assert r["mapping"]["mapped"], r["mapping"]
    assert rc == 0 and r["mapping"]["checked"] == "bit-exact", r["mapping"]
    for order in ("contiguous", "random"):
        ways = r["mapping"]["orders"][order]
        assert set(ways) == {"gather_mapped", "gather_local", "copy_local", "nixl_read"}
        assert all(w["ms"] > 0 for w in ways.values())
