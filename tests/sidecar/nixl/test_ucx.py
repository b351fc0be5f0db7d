"""``sidecar.nixl.ucx``: a UCP endpoint of our own, built from a real prefill emulator's handshake (its NIXL
agent's metadata), reads the emulator's pages over UCX on this host, byte for byte; where UCX cannot map the
memory (host memory without xpmem) ``ptr`` says why; a dead prefill fails a read instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from sidecar.nixl.ucx import UCS_ERR_UNREACHABLE, Ucp, UcpWorker, UcxError
from sidecar.standins.emulator_control import spawn_emulator
from sidecar.standins.emulator_pages import expected_page
from sidecar.wire import nixl_metadata
from sidecar.wire import prefill as wire
from sidecar.wire.formats import STANDARD, PageFormat

LAYERS, HEADS, HEAD, BS, SEED = 3, 2, 64, 16, 7
FMT = PageFormat(
    kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BS, head_size=HEAD
)


@pytest.fixture
def emu():
    e = spawn_emulator(
        [
            "--layers",
            str(LAYERS),
            "--heads",
            str(HEADS),
            "--head-size",
            str(HEAD),
            "--block-size",
            str(BS),
            "--seed",
            str(SEED),
            "--num-blocks",
            "64",
            "--no-progress-thread",
        ]
    )
    yield e
    if e.proc.poll() is None:
        e.stop(timeout_s=5)


def _handshake(emu):
    meta = wire.fetch_handshake(emu.ready.side_channel_host, emu.ready.side_channel_port)[(0, 0)].metadata
    agent = nixl_metadata.read_agent_metadata(meta.agent_metadata)
    _, region = agent.region_at(meta.kv_caches_base_addr[0], LAYERS * meta.num_blocks * FMT.page_bytes)
    return meta, agent, region


def test_the_bundled_ucx_loads_and_says_its_version():
    assert Ucp().version.count(".") == 2


def test_pages_read_through_our_own_endpoint_are_the_prefills(emu):
    meta, agent, region = _handshake(emu)
    req = emu.client.new_request(num_tokens=5 * BS, order="random")
    page = np.empty(FMT.page_bytes, dtype=np.uint8)
    with UcpWorker() as worker:
        ep = worker.connect(agent.connections["UCX"])
        key = ep.unpack(region.key)
        for layer in range(LAYERS):
            for block, gen in zip(req.kernel_block_ids, req.block_generations, strict=True):
                page[:] = 0
                ep.get(
                    key,
                    meta.kv_caches_base_addr[layer] + block * FMT.page_bytes,
                    page.ctypes.data,
                    page.nbytes,
                )
                assert np.array_equal(page, expected_page(SEED, layer, block, gen, FMT)), (layer, block)
        # A neighbour's page is not this one: the reads really went to each page's own address.
        ep.get(
            key,
            meta.kv_caches_base_addr[0] + req.kernel_block_ids[0] * FMT.page_bytes + FMT.page_bytes,
            page.ctypes.data,
            page.nbytes,
        )
        assert not np.array_equal(
            page, expected_page(SEED, 0, req.kernel_block_ids[0], req.block_generations[0], FMT)
        )


def test_host_memory_is_mapped_only_where_a_transport_can_and_ptr_says_why_not(emu):
    meta, agent, region = _handshake(emu)
    req = emu.client.new_request(num_tokens=BS, order="random")
    block, gen = req.kernel_block_ids[0], req.block_generations[0]
    with UcpWorker() as worker:
        key = worker.connect(agent.connections["UCX"]).unpack(region.key)
        addr = meta.kv_caches_base_addr[1] + block * FMT.page_bytes
        try:
            ptr = key.ptr(addr)
        except UcxError as exc:  # no xpmem on this host: cma reads, it does not map
            assert exc.status == UCS_ERR_UNREACHABLE and exc.call == "ucp_rkey_ptr"
            return
        mapped = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * FMT.page_bytes).from_address(ptr))
        assert np.array_equal(mapped, expected_page(SEED, 1, block, gen, FMT))


def test_a_read_from_a_dead_prefill_fails_instead_of_hanging(emu):
    meta, agent, region = _handshake(emu)
    page = np.empty(FMT.page_bytes, dtype=np.uint8)
    with UcpWorker() as worker:
        ep = worker.connect(agent.connections["UCX"])
        key = ep.unpack(region.key)
        ep.get(key, meta.kv_caches_base_addr[0], page.ctypes.data, page.nbytes)
        emu.kill()
        started = time.monotonic()
        with pytest.raises(UcxError):
            ep.get(key, meta.kv_caches_base_addr[0], page.ctypes.data, page.nbytes, timeout_s=10.0)
        assert time.monotonic() - started < 10.0
    # closing (force) after the peer died does not hang either: we are here


def test_a_read_from_a_stalled_prefill_ends_at_its_timeout_and_closes_the_endpoint(emu, monkeypatch):
    """Over tcp a read needs the prefill's own progress; a SIGSTOPped prefill makes none. At the timeout the
    endpoint is closed, which ends the read (it cannot write later into the buffer given up)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # our context only: reads go as active messages the peer serves
    meta, agent, region = _handshake(emu)
    page = np.empty(FMT.page_bytes, dtype=np.uint8)
    with UcpWorker() as worker:
        ep = worker.connect(agent.connections["UCX"])
        key = ep.unpack(region.key)
        ep.get(key, meta.kv_caches_base_addr[0], page.ctypes.data, page.nbytes)  # connected, peer alive
        os.kill(emu.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(UcxError, match="not complete after 0.5 s"):
                ep.get(key, meta.kv_caches_base_addr[0], page.ctypes.data, page.nbytes, timeout_s=0.5)
            assert time.monotonic() - started < 5.0
            with pytest.raises(UcxError, match="closed"):
                ep.get(key, meta.kv_caches_base_addr[0], page.ctypes.data, page.nbytes)
        finally:
            os.kill(emu.proc.pid, signal.SIGCONT)
