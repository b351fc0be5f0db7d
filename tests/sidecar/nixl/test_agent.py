"""The NIXL transfer layer against the prefill emulator: real NIXL over UCX on loopback, real processes,
destination planes in POSIX shared memory, every byte checked against the emulator's deterministic pages."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from multiprocessing import shared_memory
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from sidecar.daemon.leases import LeaseTracker
from sidecar.nixl.admission import AdmissionRules, RemoteFormatRule, admit_remote
from sidecar.nixl.agent import NixlTransfer, TransferSettings
from sidecar.nixl.errors import (
    PeerConflict,
    RemoteDisconnected,
    RemoteRefused,
    RequestRefused,
    TransferError,
    TransferFailed,
    TransferTimeout,
    map_nixl_error,
)
from sidecar.nixl.geometry import BlockPairs, LocalRegions, StagingPool, contiguous_slots
from sidecar.nixl.reads import NixlReads
from sidecar.standins.emulator_control import spawn_emulator
from sidecar.standins.emulator_pages import expected_pages
from sidecar.wire import prefill as wire
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat

LAYERS, HEADS, HEAD, BS, SEED = 3, 2, 128, 16, 5
STD = PageFormat(
    kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BS, head_size=HEAD
)
SHUF = PageFormat(
    kind=AITER_SHUFFLED, layout="LHBNC", dtype="bfloat16", num_heads=HEADS, block_size=BS, head_size=HEAD
)
PAGE, HALF = STD.page_bytes, STD.page_bytes // 2
SETTINGS = TransferSettings()
RULES = AdmissionRules(remote_formats=(RemoteFormatRule(address="127.0.0.1:*", format=STD),))
NB_LOCAL = 48
SENTINEL = 0xAA


# -- fixtures --------------------------------------------------------------------------------------


def _spawn(*args: str, env: dict[str, str] | None = None):
    return spawn_emulator(
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
            # The prefill drives NIXL from its loop: ``tx`` already spins one of CI's two cores. The spinning
            # (vLLM-like) prefill is test_serve's module emulator.
            "--no-progress-thread",
            *args,
        ],
        env=env,
    )


def _stop(emu) -> None:
    if emu.proc.poll() is None:
        try:
            emu.stop(timeout_s=5)
        except Exception:  # noqa: BLE001 - teardown must not leave the process behind
            emu.proc.kill()
            emu.proc.wait()


@pytest.fixture(scope="module")
def emu():
    e = _spawn("--num-blocks", "128")
    yield e
    _stop(e)


@pytest.fixture(scope="module")
def tx():
    t = NixlTransfer(SETTINGS)
    yield t
    t.close()


class ShmPlanes:
    """Decoder K/V planes (LHBNC: per layer a K plane then a V plane) in a POSIX shared-memory segment."""

    def __init__(self, layers: int = LAYERS, nb: int = NB_LOCAL, block: int = HALF, per_layer: int = 2):
        self.layers, self.nb, self.block, self.per_layer = layers, nb, block, per_layer
        self.shm = shared_memory.SharedMemory(create=True, size=layers * per_layer * nb * block)
        self.arr = np.ndarray((layers, per_layer, nb, block), np.uint8, self.shm.buf)
        self.reset()

    @property
    def base(self) -> int:
        return self.arr.ctypes.data

    def region_bases(self) -> list[int]:
        return [
            self.base + (lay * self.per_layer + i) * self.nb * self.block
            for lay in range(self.layers)
            for i in range(self.per_layer)
        ]

    def planes(self) -> LocalRegions:
        b = self.region_bases()
        return LocalRegions.planes(b[0::2], b[1::2], self.block, self.nb)

    def reset(self) -> None:
        self.arr[:] = SENTINEL

    def reopened(self) -> tuple[shared_memory.SharedMemory, np.ndarray]:
        """A second mapping of the same segment, as the decoder process would have it."""
        other = shared_memory.SharedMemory(name=self.shm.name)
        return other, np.ndarray(self.arr.shape, np.uint8, other.buf)

    def close(self) -> None:
        del self.arr
        self.shm.close()
        self.shm.unlink()


@pytest.fixture(scope="module")
def planes(tx):
    p = ShmPlanes()
    reg = tx.register([(p.base, p.arr.nbytes, 0)], "DRAM")
    p.dest = tx.destination(reg, p.planes())
    yield p
    tx.deregister(reg)
    p.close()


def address(e) -> str:
    return f"{e.ready.side_channel_host}:{e.ready.side_channel_port}"


def local_factors(e, backend: str = "ROCM_AITER_FA") -> dict:
    """The decoder's hash factors: the prefill's, with another attention backend."""
    return {**e.ready.compat_factors, "attn_backend_name": backend}


def connect(t: NixlTransfer, e, rank: int = 0, local_format: PageFormat = SHUF, layers: int = LAYERS):
    reply = wire.fetch_handshake(
        e.ready.side_channel_host,
        e.ready.side_channel_port,
        [(0, rank)],
        expected_engine_id=e.ready.engine_id,
    )[(0, rank)]
    plan, regions = admit_remote(
        reply.metadata,
        address=address(e),
        local_format=local_format,
        layers=layers,
        rules=RULES,
        remote_hash=reply.compatibility_hash,
        local_factors=local_factors(e),
        expected_engine_id=e.ready.engine_id,
    )
    return t.add_peer(
        engine_id=reply.metadata.engine_id,
        tp_rank=rank,
        generation=1,
        address=address(e),
        agent_metadata=reply.metadata.agent_metadata,
        plan=plan,
        regions=regions,
    )


def wait_until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Poll a condition (another process's state) until it holds; fail after the timeout."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def new_request(e, blocks: int, **kw):
    reply = e.client.new_request(num_tokens=blocks * BS, **kw)
    return reply, wire.parse_kv_transfer_params(reply.kv_transfer_params)


def expected(reply, layer: int, rank: int = 0) -> np.ndarray:
    return expected_pages(SEED, layer, reply.kernel_block_ids, reply.block_generations, STD, rank)


def check_planes(arr: np.ndarray, reply, local: list[int], rank: int = 0) -> None:
    """Every byte: (K-plane block ‖ V-plane block) is the standard page; all other blocks untouched."""
    others = sorted(set(range(arr.shape[2])) - set(local))
    for layer in range(LAYERS):
        exp = expected(reply, layer, rank)[-len(local) :]
        np.testing.assert_array_equal(arr[layer, 0, local], exp[:, :HALF])
        np.testing.assert_array_equal(arr[layer, 1, local], exp[:, HALF:])
        assert (arr[layer, :, others] == SENTINEL).all()


# -- pure: format declaration, identity, admission, lease ------------------------------------------


def test_settings_decode_from_config():
    assert msgspec.convert({"backends": ["UCX"]}, TransferSettings).backends == ("UCX",)
    raw = {"remote_formats": [{"address": "10.0.0.*:5600", "format": msgspec.to_builtins(STD)}]}
    rules = msgspec.convert(raw, AdmissionRules)
    assert rules.remote_formats[0].format == STD
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(
            {"remote_formats": [{"address": "nohostport", "format": msgspec.to_builtins(STD)}]},
            AdmissionRules,
        )
    for cls in (TransferSettings, AdmissionRules):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"bogus": 1}, cls)


def test_nixl_errors_map_to_typed_errors():
    def err(name):
        return type(name, (Exception,), {})("boom")

    assert isinstance(map_nixl_error(err("nixlRemoteDisconnectError"), "x"), RemoteDisconnected)
    for name in ("nixlNotFoundError", "nixlInvalidParamError", "nixlBackendError", "RuntimeError"):
        mapped = map_nixl_error(err(name), "x")
        assert type(mapped) is TransferFailed and "x" in str(mapped)


def _admit(meta, **kw):
    return admit_remote(
        meta,
        **{
            "address": "127.0.0.1:5600",
            "local_format": SHUF,
            "layers": LAYERS,
            "rules": RULES,
            "check_identity": False,
            **kw,
        },
    )


# -- handshake and refusals, with a real prefill's metadata ----------------------------------------


@pytest.fixture(scope="module")
def reply(emu):
    return wire.fetch_handshake(emu.ready.side_channel_host, emu.ready.side_channel_port)[(0, 0)]


def test_admit_accepts_the_emulated_prefill(emu, reply):
    plan, regions = _admit(
        reply.metadata,
        address=address(emu),
        check_identity=True,
        remote_hash=reply.compatibility_hash,
        local_factors=local_factors(emu),
    )
    assert plan.convert and plan.remote == STD and plan.local == SHUF
    assert regions.num_regions == LAYERS and regions.block_len.tolist() == [PAGE] * LAYERS
    assert regions.mem_type == "DRAM" and regions.layout == "LBHNC"


BAD = [
    # (id, metadata change, admit kwargs, field)
    ("undeclared-format", {}, dict(rules=AdmissionRules()), "remote page format"),
    ("address-not-declared", {}, dict(address="10.1.1.1:5600"), "remote page format"),
    ("layout", dict(kv_cache_layout="LHBNC"), {}, "kv_cache_layout"),
    ("block-len-vs-page", dict(block_lens=[PAGE // 2] * LAYERS), {}, "block_lens"),
    ("region-count-vs-layers", {}, dict(layers=LAYERS + 1), "kv_caches_base_addr"),
    ("block-size", dict(block_size=32), {}, "block_size"),
    ("stride", dict(block_strides=[PAGE - 1] * LAYERS), {}, "block_strides"),
    ("ratio", dict(physical_blocks_per_logical_kv_block=3), {}, "num_blocks"),
    ("engine", {}, dict(expected_engine_id="someone-else"), "engine_id"),
    ("dcp", dict(dcp_size=2), {}, "dcp_size"),
    ("mamba", dict(ssm_sizes=(4, 8)), {}, "ssm_sizes"),
    ("members", dict(region_members=[["a"]] * LAYERS), {}, "region_members"),
    ("mla-packed", dict(packed_member_layouts={"a": (1, 2)}), {}, "packed_member_layouts"),
    ("no-hash", {}, dict(check_identity=True), "compatibility_hash"),
]


@pytest.mark.parametrize("change,kw,field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_metadata_is_refused_naming_the_field(reply, change, kw, field):
    meta = msgspec.structs.replace(reply.metadata, **change)
    with pytest.raises(RemoteRefused) as e:
        _admit(meta, **kw)
    assert e.value.field == field, e.value


def test_other_model_is_refused(emu, reply):
    with pytest.raises(RemoteRefused) as e:
        _admit(
            reply.metadata,
            check_identity=True,
            remote_hash=reply.compatibility_hash,
            local_factors={**local_factors(emu), "model": "another/model"},
        )
    assert e.value.field == "compatibility_hash"


def test_declared_format_that_negotiation_refuses(reply):
    fp16 = AdmissionRules(
        remote_formats=(RemoteFormatRule("*:*", msgspec.structs.replace(STD, dtype="float16")),)
    )
    with pytest.raises(RemoteRefused) as e:
        _admit(reply.metadata, rules=fp16)
    assert e.value.field == "dtype"


def test_an_older_connector_version_is_refused_naming_the_field(reply):
    """Connector v7 (an older vLLM) sent no block_strides and no region_* fields: decoding refuses by name."""
    old = msgspec.structs.asdict(reply.metadata)
    for name in (
        "block_strides",
        "region_num_blocks",
        "region_group_ids",
        "region_names",
        "region_mem_types",
        "dcp_size",
        "pcp_size",
        "ple_block_len",
        "region_members",
        "packed_member_layouts",
    ):
        old.pop(name)
    with pytest.raises(wire.WireError) as e:
        wire.decode_agent_metadata(msgspec.msgpack.encode(old))
    assert e.value.field in {"block_strides", "region_num_blocks", "region_mem_types"}


@pytest.mark.e2e
def test_connector_v14_prefill_is_accepted():
    """vLLM 0.32 (connector 14) publishes the same 21 fields; its prefill is read like a 0.33 one."""
    e = _spawn("--connector-version", "14", "--num-blocks", "8")
    try:
        r = wire.fetch_handshake(e.ready.side_channel_host, e.ready.side_channel_port)[(0, 0)]
        plan, _ = _admit(
            r.metadata,
            address=address(e),
            check_identity=True,
            remote_hash=r.compatibility_hash,
            local_factors=local_factors(e),
        )
        assert plan.convert
    finally:
        _stop(e)


# -- reads -----------------------------------------------------------------------------------------


def test_direct_pull_every_byte_and_one_notification(emu, tx, planes):
    peer = connect(tx, emu)
    free_before = emu.client.stats().free_blocks
    reply, params = new_request(emu, 20)
    local = [int(b) for b in np.random.default_rng(1).choice(NB_LOCAL, 20, replace=False)]
    planes.reset()
    pull = tx.pull(
        peer,
        planes.dest,
        "direct",
        local,
        params.remote_block_ids[0],
        params.remote_request_id,
        layer_groups=3,
        remote_num_tokens=params.remote_num_tokens,
        timeout_s=10,
    )
    tx.wait(pull)
    assert pull.error is None and pull.notify_error is None and pull.notified
    assert pull.descriptors == LAYERS * 2 * 20 and pull.nbytes == LAYERS * 20 * PAGE
    other, view = planes.reopened()  # the decoder's own mapping of the segment
    try:
        check_planes(view, reply, local)
    finally:
        del view
        other.close()
    st = emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    assert st.notif_counts == [1] and st.expected_n == [1] and st.late_notifications == 0
    stats = emu.client.stats()
    assert stats.malformed_notifications == 0 and stats.free_blocks == free_before
    assert tx.poll(pull)  # polling a finished pull is harmless and sends nothing more
    assert emu.client.status(params.remote_request_id).notif_counts == [1]


def test_layer_groups_land_and_stay_until_released_and_the_notification_does_not_wait(emu, tx, planes):
    peer = connect(tx, emu)
    reply, params = new_request(emu, 4)
    planes.reset()
    pull = tx.pull(peer, planes.dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0],
                   params.remote_request_id, layer_groups=2)
    tx.wait(pull, release=False)
    assert pull.notified and len(pull.handles) == 2  # DONE, notified, not yet released
    # each layer group is reported once as it lands, so its layers can be converted while others read
    half = LAYERS // 2
    assert pull.layer_ranges == [(0, half), (half, LAYERS)] and sorted(pull.landed) == pull.layer_ranges
    emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    check_planes(planes.arr, reply, [0, 1, 2, 3])
    assert tx.release(pull) and pull.handles == []
    assert tx.poll(pull)


def test_direct_pull_pairs_with_the_remote_tail(emu, tx, planes):
    """A decoder prefix hit: only its uncached blocks are read, from the tail of the prefill's list."""
    peer = connect(tx, emu)
    reply, params = new_request(emu, 12)
    local = [40, 3, 17, 9, 22]
    planes.reset()
    tx.wait(tx.pull(peer, planes.dest, "direct", local, params.remote_block_ids[0], params.remote_request_id))
    check_planes(planes.arr, reply, local)
    emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)


def test_a_pull_reads_the_pairs_it_is_given_and_refuses_pairs_of_another_rule(emu, tx, planes):
    """The daemon's post: the loop's pairing (``blocks`` on the direct geometry) is read as is; pairs made
    under another pairing rule are refused naming the field, and the prefill is told at once."""
    peer = connect(tx, emu)
    reply, params = new_request(emu, 12)
    local, remote = [40, 3, 17, 9, 22], params.remote_block_ids[0]
    pairs = tx.geometry(peer, planes.dest, "direct").blocks(local, remote)
    planes.reset()
    tx.wait(tx.pull(peer, planes.dest, "direct", local, remote, params.remote_request_id, pairs=pairs))
    check_planes(planes.arr, reply, local)
    emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    _, params = new_request(emu, 3)
    foreign = BlockPairs(pairs.local[:3], pairs.remote[:3], dataclasses.replace(pairs.rule, remote_ratio=2))
    planes.reset()
    with pytest.raises(RequestRefused) as e:
        tx.pull(peer, planes.dest, "direct", local[:3], params.remote_block_ids[0], params.remote_request_id,
                pairs=foreign)
    assert e.value.field == "pairs.remote_ratio"
    assert emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]
    assert (planes.arr == SENTINEL).all()  # nothing read


def test_staged_pull_every_byte(emu, tx, planes):
    peer = connect(tx, emu)
    slots_n = LAYERS * 16
    shm = shared_memory.SharedMemory(create=True, size=slots_n * PAGE)
    pool_arr = np.ndarray((slots_n, PAGE), np.uint8, shm.buf)
    pool_arr[:] = SENTINEL
    reg = tx.register([(pool_arr.ctypes.data, pool_arr.nbytes, 0)], "DRAM")
    try:
        pool = tx.staging(reg, StagingPool(pool_arr.ctypes.data, PAGE, slots_n))
        reply, params = new_request(emu, 12, order="ascending")
        slots = contiguous_slots(2, LAYERS, 12)
        pull = tx.pull(
            peer,
            planes.dest,
            "staged",
            list(range(12)),
            params.remote_block_ids[0],
            params.remote_request_id,
            pool=pool,
            slots=slots,
            layer_groups=2,
            timeout_s=10,
        )
        tx.wait(pull)
        geo = tx.geometry(peer, planes.dest, "staged", pool)
        runs = geo.staged_descs(params.remote_block_ids[0], slots, local_block_ids=list(range(12)))
        assert pull.descriptors == runs.count <= LAYERS * 12 and pull.nbytes == LAYERS * 12 * PAGE
        for layer in range(LAYERS):
            np.testing.assert_array_equal(pool_arr[slots[layer]], expected(reply, layer))
        used = set(slots.ravel().tolist())
        assert all((pool_arr[s] == SENTINEL).all() for s in range(slots_n) if s not in used)
        st = emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
        assert st.notif_counts == [1]
    finally:
        tx.deregister(reg)
        del pool_arr
        shm.close()
        shm.unlink()


def test_plain_pull_same_format_whole_blocks(emu):
    """A standard decoder (no conversion): one region per layer, whole pages."""
    t = NixlTransfer(SETTINGS)
    dst = ShmPlanes(nb=16, block=PAGE, per_layer=1)
    try:
        peer = connect(t, emu, local_format=STD)
        assert not peer.plan.convert
        reg = t.register([(dst.base, dst.arr.nbytes, 0)], "DRAM")
        dest = t.destination(reg, LocalRegions.blocks(dst.region_bases(), PAGE, 16))
        reply, params = new_request(emu, 6)
        local = [15, 0, 7, 8, 9, 2]
        pull = t.wait(
            t.pull(peer, dest, "plain", local, params.remote_block_ids[0], params.remote_request_id)
        )
        assert pull.descriptors == LAYERS * 6
        for layer in range(LAYERS):
            np.testing.assert_array_equal(dst.arr[layer, 0, local], expected(reply, layer))
        assert (np.delete(dst.arr, local, axis=2) == SENTINEL).all()
        emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    finally:
        t.close()
        dst.close()


def test_full_prefix_hit_only_notifies(emu, tx, planes):
    peer = connect(tx, emu)
    _, params = new_request(emu, 4)
    planes.reset()
    pull = tx.pull(peer, planes.dest, "direct", [], params.remote_block_ids[0], params.remote_request_id)
    assert pull.handles == [] and tx.poll(pull) and pull.descriptors == 0
    assert (planes.arr == SENTINEL).all()
    assert emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]


def test_notification_and_heartbeat_bytes_on_the_wire(tx, planes):
    """A second NIXL agent as the prefill, to see the exact bytes that arrive: one ``{id}:1`` per pull,
    only after its reads, and ``HB:a,b`` heartbeats."""
    from nixl._api import nixl_agent, nixl_agent_config

    target = nixl_agent("bench-prefill-" + os.urandom(4).hex(), nixl_agent_config(backends=["UCX"]))
    pages = np.random.default_rng(3).integers(0, 256, (LAYERS, 8, PAGE), dtype=np.uint8)
    reg = target.register_memory([(pages.ctypes.data, pages.nbytes, 0, "")], "DRAM")
    try:
        meta = wire.NixlAgentMetadata(
            engine_id="wire-test",
            agent_metadata=target.get_agent_metadata(),
            kv_caches_base_addr=[pages.ctypes.data + layer * 8 * PAGE for layer in range(LAYERS)],
            device_id=0,
            num_blocks=8,
            block_lens=[PAGE] * LAYERS,
            block_strides=[PAGE] * LAYERS,
            kv_cache_layout="LBHNC",
            block_size=BS,
            ssm_sizes=(0, 0),
            attn_backend_name="FLASH_ATTN",
            physical_blocks_per_logical_kv_block=1,
            region_num_blocks=[8] * LAYERS,
            region_mem_types=["DRAM"] * LAYERS,
        )
        plan, regions = _admit(meta, address="127.0.0.1:5999")
        peer = tx.add_peer(
            engine_id="wire-test",
            tp_rank=0,
            generation=1,
            address="127.0.0.1:5999",
            agent_metadata=meta.agent_metadata,
            plan=plan,
            regions=regions,
        )
        planes.reset()
        pull = tx.pull(peer, planes.dest, "direct", [4, 5, 6], [7, 2, 0], "req-A-1234abcd", layer_groups=3)
        assert not pull.notified and target.get_new_notifs() == {}  # nothing is owed before DONE is seen
        tx.wait(pull)
        assert pull.notified and pull.handles == [] and pull.descriptors == LAYERS * 2 * 3

        def arrived() -> list[bytes]:
            received.extend(target.get_new_notifs().get(tx.name, []))
            return received

        received: list[bytes] = []
        wait_until(arrived, "the completion notification")
        assert received == [b"req-A-1234abcd:1"]
        for layer in range(LAYERS):
            for lb, rb in zip([4, 5, 6], [7, 2, 0], strict=True):
                assert (
                    np.concatenate([planes.arr[layer, 0, lb], planes.arr[layer, 1, lb]]) == pages[layer, rb]
                ).all()
        tx.heartbeat(peer, ["req-A-1234abcd", "req-B-99"])
        received.clear()
        wait_until(arrived, "the heartbeat")
        assert received == [b"HB:req-A-1234abcd,req-B-99"]
        tx.remove_peer(peer)
    finally:
        target.deregister_memory(reg)


def test_bad_request_ids_are_refused_and_the_prefill_told(emu, tx, planes):
    peer = connect(tx, emu)
    _, params = new_request(emu, 3)
    with pytest.raises(RequestRefused) as e:
        tx.pull(peer, planes.dest, "direct", [1, 1, 2], params.remote_block_ids[0], params.remote_request_id)
    assert e.value.field == "local_block_ids"
    assert emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]
    _, params = new_request(emu, 3)
    with pytest.raises(RequestRefused) as e:
        tx.pull(
            peer, planes.dest, "direct", [1, 2, 3, 4], params.remote_block_ids[0], params.remote_request_id
        )
    assert e.value.field == "local_block_ids"
    emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)


def test_destination_outside_registered_memory_is_refused(tx, planes):
    reg = planes.dest.registration
    far = LocalRegions.planes(
        [planes.base + planes.arr.nbytes], [planes.base + planes.arr.nbytes + HALF * 4], HALF, 4
    )
    with pytest.raises(TransferFailed) as e:
        tx.destination(reg, far)
    assert e.value.field == "local.regions"
    with pytest.raises(TransferFailed) as e:
        tx.staging(reg, StagingPool(planes.base, PAGE, 10_000))
    assert e.value.field == "pool"


def test_peer_cache_by_engine_generation_and_address(emu, tx, planes):
    reply_ = wire.fetch_handshake(emu.ready.side_channel_host, emu.ready.side_channel_port)[(0, 0)]
    peer = connect(tx, emu)
    kw = dict(
        tp_rank=0,
        address=address(emu),
        agent_metadata=reply_.metadata.agent_metadata,
        plan=peer.plan,
        regions=peer.regions,
    )
    again = tx.add_peer(engine_id=emu.ready.engine_id, generation=1, **kw)  # re-admitted: a peer of its own
    assert again is not peer and again.agent_name == peer.agent_name
    assert tx.peer(emu.ready.engine_id, 0) is again
    tx.remove_peer(peer)
    peer = again
    tx.prepare(peer, planes.dest, "direct")
    assert "direct" in peer.remote_handles and peer.prep_seconds["direct"] >= 0
    newer = tx.add_peer(engine_id=emu.ready.engine_id, generation=2, **kw)
    assert newer is not peer and peer.remote_handles == {} and tx.peer(emu.ready.engine_id, 0) is newer
    with pytest.raises(PeerConflict) as e:
        tx.add_peer(engine_id=emu.ready.engine_id, generation=1, **kw)
    assert e.value.field == "remote_registration_generation"
    # a restarted prefill answers at the same address with a fresh engine id: the old entry goes
    restarted = tx.add_peer(engine_id="fresh-engine", generation=1, **kw)
    assert tx.peer(emu.ready.engine_id, 0) is None and tx.peer("fresh-engine", 0) is restarted
    reply, params = new_request(emu, 4)
    planes.reset()
    tx.wait(
        tx.pull(
            restarted,
            planes.dest,
            "direct",
            [0, 1, 2, 3],
            params.remote_block_ids[0],
            params.remote_request_id,
        )
    )
    check_planes(planes.arr, reply, [0, 1, 2, 3])
    tx.remove_peer(restarted)


def test_a_readmitted_peer_reads_on_after_the_one_it_replaced_is_removed(emu, tx, planes):
    """A reload re-admits a prefill while pulls still read through its old admission: the daemon retires the
    old peer and removes it once they let go. The same engine and generation loaded again is a peer of its
    own (its new plan) on NIXL's remote agent already loaded, and removing the old one leaves it reading."""
    old = connect(tx, emu)
    tx.prepare(old, planes.dest, "direct")
    new = connect(tx, emu)  # admitted again, as the daemon does after a reload
    assert new is not old and new.agent_name == old.agent_name and tx.peer(emu.ready.engine_id, 0) is new
    tx.remove_peer(old)
    assert old.remote_handles == {} and tx.peer(emu.ready.engine_id, 0) is new
    tx.remove_peer(old)  # a second removal is a no-op: it takes nothing from the peer that replaced it
    reply, params = new_request(emu, 4)
    planes.reset()
    rid = params.remote_request_id
    tx.wait(tx.pull(new, planes.dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0], rid))
    check_planes(planes.arr, reply, [0, 1, 2, 3])
    wait_until(lambda: emu.client.status(rid).notif_counts == [1], "the prefill's notification")
    tx.remove_peer(new)
    assert tx.peer(emu.ready.engine_id, 0) is None


class _Mapping:
    """Stands for a peer's ``MappedPages``: whether it was closed."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_newer_registration_unloads_the_old_peer_but_leaves_its_mapping_to_its_removal(emu, tx, planes):
    """A newer registration generation replaces the loaded peer at once: NIXL lets it go and a read through it
    is refused naming the field, nothing written (its old regions may lie in the newer registration). Its
    mapping, which a pull holding it may still convert through, stays open until the daemon removes it."""
    old = connect(tx, emu)
    old.mapping = mapping = _Mapping()
    kw = dict(tp_rank=0, address=address(emu), agent_metadata=old.agent_metadata, plan=old.plan,
              regions=old.regions)
    newer = tx.add_peer(engine_id=emu.ready.engine_id, generation=2, **kw)
    assert not mapping.closed and tx.peer(emu.ready.engine_id, 0) is newer and old.unloaded
    _, params = new_request(emu, 2)
    planes.reset()
    with pytest.raises(TransferFailed) as e:
        tx.pull(old, planes.dest, "direct", [0, 1], params.remote_block_ids[0], params.remote_request_id)
    assert e.value.field == "remote_registration_generation" and old.remote_handles == {}
    assert (planes.arr == SENTINEL).all()
    tx.remove_peer(old)
    assert mapping.closed and tx.peer(emu.ready.engine_id, 0) is newer
    reply, params = new_request(emu, 2)
    rid = params.remote_request_id
    tx.wait(tx.pull(newer, planes.dest, "direct", [0, 1], params.remote_block_ids[0], rid))
    check_planes(planes.arr, reply, [0, 1])
    tx.remove_peer(newer)


def test_a_newer_registration_after_a_reload_unloads_the_retired_peer_too(emu, tx, planes):
    """A reload re-admitted the prefill alike (the retired peer stays readable for a pull holding it), then
    the prefill registered again: a read through the retired peer is refused as through the replaced one,
    nothing written. Before, only the current peer was unloaded and the retired one read on."""
    retired = connect(tx, emu)
    alike = connect(tx, emu)
    kw = dict(tp_rank=0, address=address(emu), agent_metadata=alike.agent_metadata, plan=alike.plan,
              regions=alike.regions)
    newer = tx.add_peer(engine_id=emu.ready.engine_id, generation=2, **kw)
    assert retired.unloaded and alike.unloaded
    _, params = new_request(emu, 2)
    planes.reset()
    with pytest.raises(TransferFailed) as e:
        tx.pull(retired, planes.dest, "direct", [0, 1], params.remote_block_ids[0], params.remote_request_id)
    assert e.value.field == "remote_registration_generation"
    assert (planes.arr == SENTINEL).all()
    for peer in (retired, alike, newer):
        tx.remove_peer(peer)


def test_heartbeats_reach_the_prefill(emu, tx):
    peer = connect(tx, emu)
    _, params = new_request(emu, 2, lease_s=30.0)
    before = emu.client.status(params.remote_request_id)
    tx.heartbeat(peer, [params.remote_request_id])
    wait_until(lambda: emu.client.status(params.remote_request_id).heartbeats > 0, "the heartbeat")
    assert emu.client.status(params.remote_request_id).heartbeats == 1 and before.heartbeats == 0
    with pytest.raises(RequestRefused) as e:
        tx.heartbeat(peer, ["bad,id"])  # a ',' would split into two ids at a stock prefill
    assert e.value.field == "remote_request_id"
    with pytest.raises(RequestRefused) as e:
        tx.start(peer, "HB:sneaky")  # would read as a heartbeat, never as a completion
    assert e.value.field == "remote_request_id"
    tx.notify(peer, params.remote_request_id)
    emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    assert emu.client.stats().malformed_notifications == 0


# -- the lease: a read past the lease survives only with heartbeats --------------------------------

# Heartbeats extend it by 2 s (vLLM: int(lease) * 2 // 3); a loaded 2-core CI box may deliver one late.
# (The tracker below uses margin 0.4 s: our vouching must end before the prefill's own expiry.)
LEASE = 3.0


def _tracker() -> LeaseTracker:
    return LeaseTracker(LEASE, extension_s=LEASE * 2 / 3, margin_s=0.4, heartbeat_interval_s=0.3)


def test_read_held_past_the_lease_survives_with_heartbeats(emu, tx, planes):
    peer = connect(tx, emu)
    reply, params = new_request(emu, 6, lease_s=LEASE)
    rid = params.remote_request_id
    lt = _tracker()
    lt.seen(rid, time.monotonic())
    hold_until = time.monotonic() + 1.5 * LEASE  # e.g. waiting for decoder blocks
    rank = [peer.key]
    while (now := time.monotonic()) < hold_until:
        if lt.due(rid, peer.key, now):
            tx.heartbeat(peer, [rid])
            lt.heartbeat_sent([rid], now, peer.key)
        time.sleep(0.02)
    assert lt.check(rid, time.monotonic(), rank)
    assert emu.client.status(rid).state == "pending"  # the prefill kept the blocks
    planes.reset()
    pull = tx.wait(tx.pull(peer, planes.dest, "direct", list(range(6)), params.remote_block_ids[0], rid))
    assert lt.check(rid, pull.done_at, rank)  # vouched for until the read had landed
    check_planes(planes.arr, reply, list(range(6)))
    st = emu.client.wait_state(rid, "freed_by_notif", 10)
    assert st.heartbeats >= 5


def test_without_heartbeats_the_request_is_failed_not_read(emu, tx, planes):
    """We must never vouch for a request whose blocks the prefill has already reused: while the tracker says
    yes, the prefill must still hold them; once it reuses them, a read would return other bytes."""
    peer = connect(tx, emu)
    reply, params = new_request(emu, 4, lease_s=LEASE)
    rid = params.remote_request_id
    lt = _tracker()
    lt.seen(rid, time.monotonic())
    deadline = time.monotonic() + 10
    rank = [peer.key]
    while True:
        vouched = lt.check(rid, time.monotonic(), rank)
        state = emu.client.status(rid).state
        if vouched:
            assert state == "pending", "we vouched for a request whose blocks were already reused"
        if state == "expired_and_reused":
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not lt.check(rid, time.monotonic(), rank) and not lt.due(rid, peer.key, time.monotonic())
    # what the service must not do: a late read succeeds at the NIXL level but returns reused pages
    planes.reset()
    tx.wait(tx.pull(peer, planes.dest, "direct", list(range(4)), params.remote_block_ids[0], rid))
    stale = expected(reply, 0)
    assert not (planes.arr[0, 0, :4] == stale[:, :HALF]).all()
    wait_until(lambda: emu.client.status(rid).late_notifications == 1, "the late notification to arrive")


# -- several ranks, aborts, a dying prefill (own emulators) ----------------------------------------


@pytest.mark.e2e
def test_one_notification_per_rank_after_all_its_transfers():
    e = _spawn("--tp", "2", "--num-blocks", "32")
    t = NixlTransfer(SETTINGS)
    dsts = [ShmPlanes(nb=16), ShmPlanes(nb=16)]
    try:
        regs = [t.register([(d.base, d.arr.nbytes, 0)], "DRAM") for d in dsts]
        dests = [t.destination(r, d.planes()) for r, d in zip(regs, dsts, strict=True)]
        peers = [connect(t, e, rank) for rank in (0, 1)]
        reply, params = new_request(e, 9)
        pulls = [
            t.pull(
                p,
                d,
                "direct",
                list(range(9)),
                params.remote_block_ids[0],
                params.remote_request_id,
                layer_groups=3,
            )
            for p, d in zip(peers, dests, strict=True)
        ]
        assert all(len(p.handles) == 3 for p in pulls if not p.finished)
        for p in pulls:
            t.wait(p)
        for rank, d in enumerate(dsts):
            check_planes(d.arr, reply, list(range(9)), rank)
        st = e.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
        assert st.notif_counts == [1, 1] and st.expected_n == [1, 1] and st.late_notifications == 0
        stats = e.client.stats()
        assert (
            stats.notifications == 2 and stats.late_notifications == 0 and stats.malformed_notifications == 0
        )
    finally:
        t.close()
        for d in dsts:
            d.close()
        _stop(e)


@pytest.fixture
def tcp_emu():
    """A prefill on tcp only, so a SIGSTOPped prefill really stalls a read (cma would read without it)."""
    e = _spawn("--num-blocks", "32", env={"UCX_TLS": "tcp"})
    yield e
    if e.proc.poll() is None:
        os.kill(e.proc.pid, signal.SIGCONT)
    _stop(e)


def _stalled_pull(t, e, planes_, blocks=6, timeout_s=10.0):
    planes_.reset()  # the module shares the planes: painted here, so a late write shows
    peer = connect(t, e)
    _, params = new_request(e, blocks)
    os.kill(e.proc.pid, signal.SIGSTOP)
    pull = t.pull(
        peer,
        planes_.dest,
        "direct",
        list(range(blocks)),
        params.remote_block_ids[0],
        params.remote_request_id,
        timeout_s=timeout_s,
    )
    assert not t.poll(pull)
    return pull, params


@pytest.mark.e2e
def test_abort_releases_the_reads_and_frees_the_blocks(tcp_emu, tx, planes):
    pull, params = _stalled_pull(tx, tcp_emu, planes)
    # The prefill is stopped mid-read: the read is in progress, so the abort cannot call the planes safe.
    # (Releasing it anyway, as NIXL allows, let the prefill's late reply land in them after the abort.)
    assert tx.abort(pull) is False and pull.handles and pull.notified
    assert isinstance(pull.error, TransferError)
    os.kill(tcp_emu.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not tx.abort(pull):  # the read ends now; then nothing can write any more
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.01)
    answered = planes.arr.copy()
    assert pull.handles == []
    st = tcp_emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    assert st.notif_counts == [1]
    assert tx.abort(pull) is True and tcp_emu.client.status(params.remote_request_id).notif_counts == [1]
    with pytest.raises(TransferError):
        tx.poll(pull)
    time.sleep(0.2)
    assert np.array_equal(planes.arr, answered), "an aborted read wrote into the planes after it was safe"


@pytest.mark.e2e
def test_prefill_killed_mid_read_is_a_typed_error_within_the_deadline(tcp_emu, tx, planes):
    pull, _ = _stalled_pull(tx, tcp_emu, planes, timeout_s=5.0)
    tcp_emu.proc.kill()
    tcp_emu.proc.wait()
    t0 = time.monotonic()
    with pytest.raises((RemoteDisconnected, TransferFailed, TransferTimeout)):
        tx.wait(pull)
    assert time.monotonic() - t0 < 5.5
    assert pull.finished and pull.handles == []
    with pytest.raises(RemoteDisconnected):
        tx.heartbeat(pull.peer, ["anything"])
    tx.remove_peer(pull.peer)


@pytest.mark.e2e
def test_a_stalled_read_times_out(tcp_emu, tx, planes):
    pull, params = _stalled_pull(tx, tcp_emu, planes, timeout_s=0.3)
    with pytest.raises(TransferTimeout):
        tx.wait(pull)
    assert pull.finished and pull.notified and pull.handles  # still in flight: not released
    os.kill(tcp_emu.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not tx.release(pull):
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.01)
    answered = planes.arr.copy()
    tcp_emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    time.sleep(0.2)
    assert np.array_equal(planes.arr, answered), "a timed-out read wrote into the planes after it was safe"


def test_metadata_helpers_accept_plain_objects():
    """admit_remote reads vLLM's field names from any object (e.g. a test double of the metadata)."""
    meta = SimpleNamespace(
        engine_id="e",
        kv_caches_base_addr=[1 << 20],
        block_lens=[PAGE],
        block_strides=[PAGE],
        num_blocks=4,
        region_num_blocks=[4],
        device_id=0,
        kv_cache_layout="LBHNC",
        block_size=BS,
        physical_blocks_per_logical_kv_block=1,
        region_mem_types=["VRAM"],
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
    )
    plan, regions = _admit(meta, layers=1)
    assert plan.convert and regions.mem_type == "VRAM"


def test_declared_head_count_mismatch_blames_the_declaration(reply):
    """Issue 15 item 9. Main: 'heterogeneous TP (different heads per rank) is not supported'."""
    wrong = AdmissionRules(
        remote_formats=(
            RemoteFormatRule("127.0.0.1:*", msgspec.structs.replace(STD, num_heads=STD.num_heads * 2)),
        )
    )
    with pytest.raises(RemoteRefused) as e:
        _admit(reply.metadata, rules=wrong)
    assert e.value.field == "num_heads"
    text = str(e.value)
    assert "[[remotes]] declaration matching '127.0.0.1:*' gives num_heads" in text
    assert "do not fit the declaration" in text and "fix the declaration's page_format" in text


def test_declared_format_fitting_the_prefill_names_the_real_difference(reply):
    local = msgspec.structs.replace(SHUF, num_heads=SHUF.num_heads * 2)
    with pytest.raises(RemoteRefused) as e:
        _admit(reply.metadata, local_format=local)
    assert "registered pages fit the declaration" in str(e.value) and "heterogeneous TP" in str(e.value)


# -- two threads: the daemon's poster and its loop ------------------------------------------------------


def test_agent_calls_from_two_threads_take_turns_and_hold_can_be_tried(tx):
    """NIXL's default sync mode is not safe for two threads (``bench nixl_threads``: a segfault), so every
    call goes through ``tx.lock``: another thread's call waits while it is held, and ``hold(blocking=False)``
    answers False instead of waiting."""
    import threading

    got: list[bytes] = []
    with tx.hold() as held:
        assert held
        caller = threading.Thread(target=lambda: got.append(tx.metadata()))
        caller.start()
        caller.join(0.2)
        assert caller.is_alive() and got == []  # waits for the holder

        def try_hold(out: list[bool]) -> None:
            with tx.hold(blocking=False) as h:
                out.append(h)

        tried: list[bool] = []
        t2 = threading.Thread(target=try_hold, args=(tried,))
        t2.start()
        t2.join(2)
        assert tried == [False]
    caller.join(5)
    assert got and got[0] == tx.metadata()
    with tx.hold(blocking=False) as h:
        assert h


def test_a_pairing_refused_at_pull_time_still_tells_the_prefill(emu, tx, planes):
    """A staged pull whose pool cannot pair with the prefill's pages (here: slots of half a page) is refused
    before anything is posted, and the prefill is told once, so it frees the blocks now, not at its lease."""
    peer = connect(tx, emu)
    pool = tx.staging(planes.dest.registration, StagingPool(planes.base, PAGE // 2, 8))
    _, params = new_request(emu, 3)
    slots = np.arange(LAYERS * 3, dtype=np.int64).reshape(LAYERS, 3)
    with pytest.raises(RemoteRefused) as e:
        tx.pull(peer, planes.dest, "staged", [1, 2, 3], params.remote_block_ids[0], params.remote_request_id,
                pool=pool, slots=slots)
    assert e.value.field
    assert emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10).notif_counts == [1]


def test_a_post_failing_midway_with_any_error_keeps_what_it_posted(emu, tx, planes, monkeypatch):
    """The second layer group's post raises something other than a TransferError (a bug, MemoryError)
    after the first group's READ was posted: the error still carries the pull, so the caller stops it
    (releases its handle, tells the prefill) before the request's memory is reused."""
    peer = connect(tx, emu)
    reply, params = new_request(emu, 4)
    planes.reset()
    calls = []
    real = NixlReads._index_bytes

    def second_fails(geo, count):
        calls.append(count)
        if len(calls) == 2:
            raise MemoryError("the second layer group's descriptors")
        return real(geo, count)

    monkeypatch.setattr(NixlReads, "_index_bytes", staticmethod(second_fails))
    with pytest.raises(MemoryError) as raised:
        tx.pull(peer, planes.dest, "direct", [0, 1, 2, 3], params.remote_block_ids[0],
                params.remote_request_id, layer_groups=2)
    pull = getattr(raised.value, "read", None)
    assert pull is not None and len(pull.handles) == 1  # the first group's READ, posted
    wait_until(lambda: tx.abort(pull), "the posted READ released")
    st = emu.client.wait_state(params.remote_request_id, "freed_by_notif", 10)
    assert st.notif_counts == [1]
