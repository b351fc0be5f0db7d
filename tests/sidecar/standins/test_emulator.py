"""The prefill emulator: pure page contents, then a real subprocess read over NIXL/UCX loopback by a reader.

The reader here is deliberately tiny and independent of sidecar.nixl.agent: handshake through
sidecar.wire.prefill, add_remote_agent, one READ of whole kernel pages per (layer, block) with the
notification attached.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import uuid

import msgspec
import numpy as np
import pytest
import torch
import zmq

from sidecar.standins import emulator
from sidecar.standins.emulator_control import ControlError, EmulatorProcess, ReadyInfo, spawn_emulator
from sidecar.standins.emulator_pages import (
    expected_page,
    expected_pages,
    expected_pages_torch,
    kernel_blocks,
    page_offset,
)
from sidecar.wire import prefill as vllm_wire
from sidecar.wire.formats import PageFormat

LAYERS, HEADS, HEAD, BLOCK, RATIO, SEED = 3, 2, 64, 16, 2, 7
FMT = PageFormat(
    kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BLOCK, head_size=HEAD
)
DEADLINE_S = 10.0
# Exit includes Python's final collection and NIXL/UCX teardown: ~0.3 s here, far longer on a busy 2-core CI
# VM.
SHUTDOWN_S = 30.0


# --- pure ---


def test_pages_are_deterministic_and_distinct() -> None:
    a = expected_page(SEED, 1, 5, 0, FMT)
    assert a.dtype == np.uint8 and a.shape == (FMT.page_bytes,)
    assert np.array_equal(a, expected_page(SEED, 1, 5, 0, FMT))
    others = [
        expected_page(SEED, 1, 5, 1, FMT),  # reused block
        expected_page(SEED, 1, 6, 0, FMT),
        expected_page(SEED, 2, 5, 0, FMT),
        expected_page(SEED + 1, 1, 5, 0, FMT),
        expected_page(SEED, 1, 5, 0, FMT, tp_rank=1),
    ]
    for b in others:
        assert (a != b).mean() > 0.9
    batch = expected_pages(SEED, 1, [5, 6], [0, 0], FMT)
    assert np.array_equal(batch[0], a) and np.array_equal(batch[1], others[1])


@pytest.mark.parametrize(
    "dtype, exp_mask",
    [
        ("bfloat16", 0x7F80),
        ("float16", 0x7C00),
        ("float32", 0x7F800000),
        ("float8_e4m3fn", 0x7F),
        ("int8", None),
    ],
)
def test_page_elements_are_finite(dtype: str, exp_mask: int | None) -> None:
    fmt = PageFormat(kind="standard", layout="LBHNC", dtype=dtype, num_heads=1, block_size=16, head_size=64)
    page = expected_pages(0, 0, np.arange(8), 3, fmt)
    assert page.shape == (8, fmt.page_bytes)
    if exp_mask is None:
        return
    lanes = page.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[fmt.elem_bytes])
    assert not ((lanes & exp_mask) == exp_mask).any()  # no NaN/Inf (e4m3fn: 0x7F is its only NaN)
    assert len(np.unique(lanes)) > 50


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8"])
def test_torch_pages_are_the_numpy_pages(dtype: str) -> None:
    """The GPU emulator's generator (torch, run here on the CPU) writes exactly the reference bytes."""
    fmt = PageFormat(kind="standard", layout="LBHNC", dtype=dtype, num_heads=3, block_size=16, head_size=64)
    blocks, gens = [5, 0, 77, 3, 1 << 40], [0, 3, 1, 2, 9]
    want = expected_pages(SEED, 2, blocks, gens, fmt, tp_rank=1)
    got = expected_pages_torch(SEED, 2, blocks, gens, fmt, tp_rank=1, chunk_words=1000)  # several chunks
    assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want)
    assert expected_pages_torch(SEED, 2, [], 0, fmt).shape == (0, fmt.page_bytes)
    with pytest.raises(ValueError):
        expected_pages_torch(SEED, 2, [-1], 0, fmt)


def test_block_mapping_and_offsets() -> None:
    assert kernel_blocks([3, 1], 2) == [6, 7, 2, 3]
    assert kernel_blocks([3, 1], 1) == [3, 1]
    assert page_offset(2, 5, 100, 4096) == (2 * 100 + 5) * 4096
    with pytest.raises(ValueError):
        expected_pages(0, 0, [-1], 0, FMT)


def test_lease_extension_is_vllms() -> None:
    assert emulator.lease_extension(30) == 20  # kv_lease_duration * 2 // 3
    assert emulator.lease_extension(1) == 0
    assert emulator.lease_extension(1.5) == pytest.approx(1.0)


def test_cli_arguments_map_to_config() -> None:
    parser = argparse.ArgumentParser()
    emulator.add_arguments(parser)
    cfg = emulator.config_from_args(
        parser.parse_args(["--connector-version", "14", "--tp", "2", "--lease", "3"])
    )
    assert (cfg.connector_version, cfg.tp, cfg.lease_s, cfg.port) == (14, 2, 3.0, 0)
    assert cfg.compat_factors()["vllm_version"] == "0.32.0"
    assert cfg.fmt.page_bytes == 2 * 2 * 16 * 128 * 2
    assert (
        cfg.progress_thread
        and not emulator.config_from_args(parser.parse_args(["--no-progress-thread"])).progress_thread
    )
    assert emulator.config_from_args(parser.parse_args(["--device", "cuda:1"])).gpu == 1
    assert cfg.device == "cpu" and cfg.gpu is None
    bad_configs = (
        dict(layers=0),
        dict(num_blocks=1),
        dict(lease_s=0),
        dict(connector_version=13),
        dict(tp=0),
        dict(device="gpu0"),
        dict(device="cuda:"),
    )
    for bad in bad_configs:
        with pytest.raises(ValueError):
            emulator.EmulatorConfig(**bad)


# --- a real emulator subprocess and a real NIXL reader ---


class Reader:
    """A foreign NIXL puller: whole-page READs into one registered DRAM buffer."""

    def __init__(self, capacity: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # No progress thread: it spins a whole core, and read() drives its transfer by polling anyway.
        conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl_agent(f"test-reader-{uuid.uuid4()}", conf)
        self.buf = np.zeros(capacity, dtype=np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, capacity, 0, "")], "DRAM")
        self.peers: dict[bytes, bytes] = {}

    def connect(self, meta: vllm_wire.NixlAgentMetadata) -> bytes:
        if meta.agent_metadata not in self.peers:
            self.peers[meta.agent_metadata] = self.agent.add_remote_agent(meta.agent_metadata)
        return self.peers[meta.agent_metadata]

    def read(self, meta: vllm_wire.NixlAgentMetadata, kblocks: list[int], notif: bytes = b"") -> np.ndarray:
        """Pages [layer, i, page_bytes] of ``kblocks`` (kernel ids), every layer, in one READ."""
        peer = self.connect(meta)
        n, page = len(kblocks), meta.block_lens[0]
        remote = [
            (
                meta.kv_caches_base_addr[layer] + kb * meta.block_strides[layer],
                meta.block_lens[layer],
                meta.device_id,
            )
            for layer in range(meta.num_regions)
            for kb in kblocks
        ]
        base = self.buf.ctypes.data
        local = [(base + i * page, page, 0) for i in range(len(remote))]
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(np.array(local, dtype=np.uint64), "DRAM"),
            self.agent.get_xfer_descs(np.array(remote, dtype=np.uint64), meta.region_mem_types[0]),
            peer,
            notif,
        )
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + DEADLINE_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        assert state == "DONE", state
        return self.buf[: len(remote) * page].reshape(meta.num_regions, n, page).copy()

    def notify(self, meta: vllm_wire.NixlAgentMetadata, msg: bytes) -> None:
        self.agent.send_notif(self.connect(meta), msg)


EMU_ARGS = [
    *("--layers", str(LAYERS), "--heads", str(HEADS), "--head-size", str(HEAD), "--block-size", str(BLOCK)),
    *("--blocks-per-logical", str(RATIO), "--num-blocks", "48", "--seed", str(SEED)),
    "--no-progress-thread",  # a spinning thread would take one of CI's two cores for the whole module
]


@pytest.fixture(scope="module")
def emu():
    with spawn_emulator(EMU_ARGS) as proc:
        yield proc
    assert proc.proc.returncode == 0


@pytest.fixture(scope="module")
def reader() -> Reader:
    return Reader(4 << 20)


@pytest.fixture(scope="module")
def meta(emu: EmulatorProcess) -> vllm_wire.NixlAgentMetadata:
    r = emu.ready
    out = vllm_wire.fetch_handshake(r.side_channel_host, r.side_channel_port, expected_engine_id=r.engine_id)
    return out[(0, 0)].metadata


def test_keep_bytes_hands_out_blocks_without_rewriting_them() -> None:
    """--keep-bytes: the next request on the same blocks gets the same generation and the same bytes;
    without it the blocks are rewritten at a new generation."""
    from sidecar.standins.emulator_control import NewRequest

    for keep in (True, False):
        cfg = emulator.EmulatorConfig(layers=2, heads=HEADS, head_size=HEAD, num_blocks=3, keep_bytes=keep,
                                      progress_thread=False, control=f"ipc:///tmp/kvs-keep-{uuid.uuid4().hex}")
        emu = emulator.PrefillEmulator(cfg)
        try:
            first = emu._handle(NewRequest(num_blocks=2, order="contiguous"))
            before = [emu.ranks[0].pages[layer][first.kernel_block_ids].copy() for layer in range(2)]
            emu._on_notif(0, f"{first.kv_transfer_params['remote_request_id']}:1".encode())
            again = emu._handle(NewRequest(num_blocks=2, order="contiguous"))
            assert again.kernel_block_ids == first.kernel_block_ids
            after = [emu.ranks[0].pages[layer][again.kernel_block_ids] for layer in range(2)]
            same = all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))
            assert same is keep
            assert again.block_generations == ([g + (0 if keep else 1) for g in first.block_generations])
            for layer in range(2):
                want = expected_pages(0, layer, again.kernel_block_ids, again.block_generations, cfg.fmt)
                assert np.array_equal(after[layer], want)
        finally:
            emu.close()


def _expected(reply, gens: list[int] | None = None, tp_rank: int = 0) -> np.ndarray:
    gens = reply.block_generations if gens is None else gens
    return np.stack(
        [expected_pages(SEED, layer, reply.kernel_block_ids, gens, FMT, tp_rank) for layer in range(LAYERS)]
    )


def test_handshake_metadata_is_a_vllm_prefills(
    emu: EmulatorProcess, meta: vllm_wire.NixlAgentMetadata
) -> None:
    r = emu.ready
    assert r.compatibility_hash == vllm_wire.compatibility_hash(r.compat_factors)
    assert r.compat_factors["nixl_connector_version"] == 15
    assert meta.engine_id == r.engine_id
    assert meta.num_regions == LAYERS and meta.kv_cache_layout == "LBHNC"
    assert meta.block_lens == [FMT.page_bytes] * LAYERS == meta.block_strides
    assert meta.num_blocks == 48 * RATIO and meta.region_num_blocks == [48 * RATIO] * LAYERS
    assert meta.block_size == BLOCK and meta.physical_blocks_per_logical_kv_block == RATIO
    assert meta.region_mem_types == ["DRAM"] * LAYERS and meta.device_id == 0
    addrs = meta.kv_caches_base_addr  # one allocation: layer regions back to back
    assert all(b - a == 48 * RATIO * FMT.page_bytes for a, b in zip(addrs, addrs[1:], strict=False))
    assert (meta.region_members, meta.packed_member_layouts, meta.dcp_size) == ([], {}, 1)


def test_read_checks_every_byte_and_notification_frees(emu: EmulatorProcess, reader: Reader, meta) -> None:
    reply = emu.client.new_request(num_tokens=5 * BLOCK * RATIO - 3)
    params = vllm_wire.parse_kv_transfer_params(reply.kv_transfer_params)
    assert params.remote_registration_generation == 1 and params.tp_size == 1
    assert params.remote_port == emu.ready.side_channel_port and params.remote_engine_id == meta.engine_id
    assert len(params.remote_block_ids[0]) == 5 and 0 not in params.remote_block_ids[0]
    assert reply.kernel_block_ids == kernel_blocks(params.remote_block_ids[0], RATIO)
    rid = params.remote_request_id
    assert rid.rsplit("-", 1)[1].isalnum() and len(rid.rsplit("-", 1)[1]) == 8
    got = reader.read(meta, reply.kernel_block_ids, vllm_wire.encode_notification(rid, 1))
    assert np.array_equal(got, _expected(reply))
    st = emu.client.wait_state(rid, "freed_by_notif", DEADLINE_S)
    assert st.notif_counts == [1] and st.expected_n == [1] and st.late_notifications == 0
    assert emu.client.stats().malformed_notifications == 0


def test_block_choice_is_scattered_and_unsorted_sometimes(emu: EmulatorProcess, reader: Reader, meta) -> None:
    replies = [emu.client.new_request(num_blocks=4) for _ in range(4)]
    ids = [r.kv_transfer_params["remote_block_ids"][0] for r in replies]
    assert any(b != sorted(b) for b in ids)
    asc = emu.client.new_request(num_blocks=3, order="ascending")
    assert asc.kv_transfer_params["remote_block_ids"][0] == sorted(
        asc.kv_transfer_params["remote_block_ids"][0]
    )
    # a fresh vLLM free queue: the lowest free ids in order, so the next request's come after them all
    runs = [emu.client.new_request(num_blocks=3, order="contiguous") for _ in range(2)]
    first, second = (r.kv_transfer_params["remote_block_ids"][0] for r in runs)
    assert first == sorted(first) and second == sorted(second) and max(first) < min(second)
    # half-dense: ascending with gaps; churn: vLLM's free queue after a busy engine, free blocks only
    held = {b for r in [*replies, asc, *runs] for b in r.kv_transfer_params["remote_block_ids"][0]}
    sparse = emu.client.new_request(num_blocks=4, order="contiguous", density=0.5)
    ids = sparse.kv_transfer_params["remote_block_ids"][0]
    assert ids == sorted(ids) and len(set(ids)) == 4 and not held & set(ids)  # density: test_block_orders.py
    churn = emu.client.new_request(num_blocks=6, order="churn")
    churn_ids = churn.kv_transfer_params["remote_block_ids"][0]
    assert len(set(churn_ids)) == 6 and not (held | set(ids)) & set(churn_ids)
    for r in [*replies, asc, *runs, sparse, churn]:
        reader.notify(meta, vllm_wire.encode_notification(r.kv_transfer_params["remote_request_id"], 1))
    for r in [*replies, asc, *runs, sparse, churn]:
        emu.client.wait_state(r.kv_transfer_params["remote_request_id"], "freed_by_notif", DEADLINE_S)


def test_n_readers_need_n_notifications(emu: EmulatorProcess, reader: Reader, meta) -> None:
    reply = emu.client.new_request(num_blocks=2)
    rid = reply.kv_transfer_params["remote_request_id"]
    half = reply.kernel_block_ids[:RATIO]
    reader.read(meta, half, vllm_wire.encode_notification(rid, 2))
    deadline = time.monotonic() + DEADLINE_S
    while emu.client.status(rid).notif_counts != [1]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert emu.client.status(rid).state == "pending"
    reader.notify(meta, vllm_wire.encode_notification(rid, 2))
    st = emu.client.wait_state(rid, "freed_by_notif", DEADLINE_S)
    assert st.notif_counts == [2] and st.expected_n == [2]


def test_expired_lease_reuses_blocks_and_flags_late_reader(
    emu: EmulatorProcess, reader: Reader, meta
) -> None:
    reply = emu.client.new_request(num_blocks=3, lease_s=0.3)
    rid = reply.kv_transfer_params["remote_request_id"]
    emu.client.wait_state(rid, "expired_and_reused", DEADLINE_S)
    late = reader.read(meta, reply.kernel_block_ids, vllm_wire.encode_notification(rid, 1))
    stale = _expected(reply)
    assert (late != stale).mean() > 0.9  # a late READ "succeeds" but returns other bytes
    assert np.array_equal(late, _expected(reply, [g + 1 for g in reply.block_generations]))
    deadline = time.monotonic() + DEADLINE_S
    while emu.client.status(rid).late_notifications != 1:
        assert time.monotonic() < deadline, "late notification never counted"
        time.sleep(0.01)
    assert emu.client.stats().requests_expired >= 1


def test_heartbeats_keep_the_lease(emu: EmulatorProcess, reader: Reader, meta) -> None:
    lease = 3.0  # each heartbeat extends to now + 2 s; without them it expires at 3 s
    reply = emu.client.new_request(num_blocks=2, lease_s=lease)
    rid = reply.kv_transfer_params["remote_request_id"]
    t_end = time.monotonic() + 1.5 * lease
    sent = 0
    while time.monotonic() < t_end:
        reader.notify(meta, vllm_wire.encode_heartbeat([rid]))
        sent += 1
        # Wait until the emulator has counted it: on a loaded 2-core CI box delivery can lag by a second, and
        # the claim under test is "a heartbeat that arrives extends the lease", not UCX's latency.
        st = emu.client.status(rid)
        while st.heartbeats < sent and st.state == "pending":
            assert time.monotonic() < t_end + DEADLINE_S, f"heartbeat {sent} never arrived: {st}"
            time.sleep(0.01)
            st = emu.client.status(rid)
        assert st.state == "pending", st
        time.sleep(0.2)
    st = emu.client.status(rid)
    assert st.state == "pending", st
    assert st.heartbeats == sent and st.lease_deadlines_s[0] > 0
    got = reader.read(meta, reply.kernel_block_ids, vllm_wire.encode_notification(rid, 1))
    assert np.array_equal(got, _expected(reply))
    emu.client.wait_state(rid, "freed_by_notif", DEADLINE_S)


def test_malformed_notifications_are_counted_not_fatal(emu: EmulatorProcess, reader: Reader, meta) -> None:
    before = emu.client.stats().malformed_notifications
    bad = [b"\xff\xfe:1", b"no-colon", b"id:x", b"id:0", b"HB:"]
    for msg in bad:
        reader.notify(meta, msg)
    deadline = time.monotonic() + DEADLINE_S
    while (stats := emu.client.stats()).malformed_notifications < before + len(bad):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert any("no-colon" in s for s in stats.malformed_samples)
    reply = emu.client.new_request(num_blocks=1)  # still serving
    rid = reply.kv_transfer_params["remote_request_id"]
    reader.read(meta, reply.kernel_block_ids, vllm_wire.encode_notification(rid, 1))
    emu.client.wait_state(rid, "freed_by_notif", DEADLINE_S)


def _raw_side_channel(ready: ReadyInfo, kind: int, frames: list[bytes]) -> None:
    sock = zmq.Context.instance().socket(kind)
    sock.connect(f"tcp://{ready.side_channel_host}:{ready.side_channel_port}")
    sock.send_multipart(frames)
    sock.close(linger=5000)  # fire and forget: the I/O thread still delivers it


def test_malformed_handshakes_do_not_kill_the_listener(emu: EmulatorProcess) -> None:
    r = emu.ready
    before = emu.client.stats()
    _raw_side_channel(r, zmq.DEALER, [vllm_wire.encode_handshake_request(0, 0)])  # no empty delimiter
    _raw_side_channel(r, zmq.REQ, [b"\xc1garbage"])
    _raw_side_channel(r, zmq.REQ, [msgspec.msgpack.encode([b"get_meta_msg", 0, 0, 0])])
    _raw_side_channel(r, zmq.REQ, [vllm_wire.encode_handshake_request(0, 0), b"extra"])
    with pytest.raises(vllm_wire.HandshakeTimeout):  # tp rank 1 does not exist: stock P dies on KeyError
        vllm_wire.fetch_handshake(r.side_channel_host, r.side_channel_port, [(0, 1)], timeout_s=0.3)
    deadline = time.monotonic() + DEADLINE_S
    while (stats := emu.client.stats()).malformed_handshakes < before.malformed_handshakes + 5:
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    # A str tag only makes a stock prefill warn; it still replies.
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://{r.side_channel_host}:{r.side_channel_port}")
    sock.send(msgspec.msgpack.encode(("get_meta_msg", 0, 0)))
    assert len(sock.recv_multipart()) == 2
    sock.close(linger=0)
    out = vllm_wire.fetch_handshake(r.side_channel_host, r.side_channel_port, timeout_s=2)
    assert out[(0, 0)].metadata.engine_id == r.engine_id
    after = emu.client.stats()
    assert after.handshake_wrong_tag == before.handshake_wrong_tag + 1
    assert after.handshakes_served == before.handshakes_served + 2


def test_control_refusals(emu: EmulatorProcess) -> None:
    for kwargs, field in (
        (dict(), "num_tokens"),
        (dict(num_tokens=1, num_blocks=1), "num_tokens"),
        (dict(num_tokens=0), "num_tokens"),
        (dict(num_blocks=10_000), "num_blocks"),
        (dict(num_blocks=1, lease_s=-1.0), "lease_s"),
    ):
        with pytest.raises(ControlError) as err:
            emu.client.new_request(**kwargs)
        assert err.value.field == field
    with pytest.raises(ControlError) as err:
        emu.client.status("no-such-request")
    assert err.value.field == "request_id"
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(emu.ready.control)
    sock.send(msgspec.msgpack.encode({"type": "format_disk"}))
    assert b"error" in sock.recv()
    sock.close(linger=0)


def test_stopping_an_emulator_that_does_not_answer_takes_its_timeout_not_the_clients() -> None:
    """A SIGSTOPped emulator answers no shutdown request: ``stop(timeout_s)`` gives up on the request after
    ``timeout_s`` (not the control client's 10 s), then signals the process (SIGKILL ends even a stopped
    one)."""
    stalled = spawn_emulator(EMU_ARGS)
    os.kill(stalled.proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    stalled.stop(timeout_s=0.5)  # request, SIGTERM, SIGKILL: 0.5 s each at most
    assert time.monotonic() - started < 0.5 * 3 + 1.0
    assert stalled.proc.returncode == -signal.SIGKILL


@pytest.mark.e2e
def test_v14_two_ranks_ready_file_and_sigterm(tmp_path, reader: Reader) -> None:
    """Connector v14 (vLLM 0.32) with TP=2: each rank its own agent and pages; both must be notified.

    Also runs without NIXL's progress thread (the emulator's loop drives progress), the low-CPU mode.
    """
    ready_file = tmp_path / "ready.json"
    args = ["--connector-version", "14", "--tp", "2", "--layers", "2", "--heads", "1", "--head-size", "64"]
    args += ["--block-size", "32", "--num-blocks", "8", "--seed", "3", "--ready-file", str(ready_file)]
    args += ["--no-progress-thread"]
    proc = spawn_emulator(args)
    try:
        ready = proc.ready
        assert msgspec.json.decode(ready_file.read_bytes(), type=ReadyInfo) == ready
        assert ready.compat_factors["vllm_version"] == "0.32.0" and ready.tp_size == 2
        reply = proc.client.new_request(num_tokens=40)
        assert "remote_registration_generation" not in reply.kv_transfer_params
        params = vllm_wire.parse_kv_transfer_params(reply.kv_transfer_params)
        assert params.tp_size == 2 and params.remote_registration_generation == 0
        hs = vllm_wire.fetch_handshake(ready.side_channel_host, ready.side_channel_port, [(0, 0), (0, 1)])
        fmt = PageFormat(
            kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=1, block_size=32, head_size=64
        )
        notif = vllm_wire.encode_notification(params.remote_request_id, 1)
        for tp in (0, 1):
            meta = hs[(0, tp)].metadata
            got = reader.read(meta, reply.kernel_block_ids, notif)
            want = np.stack(
                [
                    expected_pages(3, layer, reply.kernel_block_ids, reply.block_generations, fmt, tp)
                    for layer in (0, 1)
                ]
            )
            assert np.array_equal(got, want)
            if tp == 0:
                deadline = time.monotonic() + DEADLINE_S
                while not (st := proc.client.status(params.remote_request_id)).ranks_done[0]:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert st.state == "pending" and st.ranks_done == [True, False]
        proc.client.wait_state(params.remote_request_id, "freed_by_notif", DEADLINE_S)
        ipc = ready.control.removeprefix("ipc://")
        assert os.path.exists(ipc)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(SHUTDOWN_S) == 0
        assert not os.path.exists(ipc)
    finally:
        proc.stop()
