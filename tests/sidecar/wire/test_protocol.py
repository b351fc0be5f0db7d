"""Round trips of every shim↔daemon message and every way a frame is rejected."""

import re

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat
from sidecar.wire.ipc import IpcBuffer, LayerView, ShmFile
from sidecar.wire.prefill import compatibility_hash

FMT = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=2, block_size=16,
                 head_size=128)
BUF = IpcBuffer(kind="shm", nbytes=4096, device="cpu", shm=ShmFile(path="/dev/shm/x", data_offset=64))
CUDA = {"device": 0, "handle": b"h" * 66, "storage_size_bytes": 4096, "storage_offset_bytes": 0,
        "ref_counter_handle": b"/torch_1_2_3", "ref_counter_offset": 0}
CUDA_BUF = {"kind": "cuda", "nbytes": 4096, "device": "cuda:0",
            "cuda": CUDA}
LAYER = LayerView(name="model.layers.0.attn", buffer_index=0, offset_bytes=0, shape=[2, 4, 16, 256],
                  strides=[16384, 4096, 256, 1], dtype="bfloat16")


def register_frame(factors):
    """A RegisterCaches frame carrying ``factors`` as its compat_factors, whatever they are."""
    return enc({"type": "RegisterCaches", "buffers": [msgspec.to_builtins(BUF)],
                "layers": [msgspec.to_builtins(LAYER)], "page_format": msgspec.to_builtins(FMT),
                "compat_factors": factors})


def pull(**kw):
    fields = dict(req_id="r1", remote_engine_id="eng", remote_host="127.0.0.1", remote_port=5600,
                  remote_request_id="cmpl-1-abcd", remote_block_ids=p.pack_block_ids([7, 8, 9]),
                  local_block_ids=p.pack_block_ids([4, 3]),
                  timeout_s=5.0)
    fields.update(kw)
    return p.Pull(**fields)


TO_DAEMON = [
    p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="0.1.0", worker_rank=1, tp_size=2, pid=42),
    p.RegisterCaches(buffers=[BUF], layers=[LAYER], page_format=FMT,
                     compat_factors={"model": "m", "num_kv_heads": 8, "speculative_config": None}),
    p.Unregister(),
    p.Heartbeat(targets=[p.HeartbeatTarget(remote_engine_id="e", remote_host="h", remote_port=1,
                                           remote_request_ids=["a", "b"], remote_tp_size=2,
                                           remote_registration_generation=2)]),
    pull(remote_tp_size=2, remote_registration_generation=1, sent_at_ns=123, lease_started_at_ns=100),
    pull(timeout_s=None),
    p.Abort(req_id="r1"),
    p.Ping(nonce=7, sent_at_ns=1),
    p.Status(nonce=9),
]
TO_SHIM = [
    p.Welcome(protocol_version=1, package_version="0.1.0", device="cuda:3", gpu=3, pid=9),
    p.Registered(generation=2, registered_bytes=4096, num_layers=1),
    p.Unregistered(),
    p.Done(req_id="r1", ok=True, timings={"transfer": 0.01, "convert": 0.002}, sent_at_ns=99),
    p.Done(req_id="r1", ok=False, reason="deadline 5.0 s passed"),
    p.Aborted(req_id="r1", safe=True),
    p.Pong(nonce=7, sent_at_ns=2),
    p.Error(reason="bad", in_reply_to="Pull", req_id="r1"),
    p.StatusReply(nonce=9, registered=False),
    p.StatusReply(nonce=9, registered=True, registered_bytes=4096, num_layers=1, page_format=FMT,
                  compat_factors={"model": "m"},
                  peers=[p.PeerStatus(address="10.0.0.5:5600", engine_id="e", tp_rank=1)]),
    p.StatusReply(nonce=9, registered=True, page_format=FMT, tp_size=2, tp_rank=1,
                  peers=[p.PeerStatus(address="10.0.0.5:5600", engine_id="e", tp_rank=3, tp_size=4)]),
]


@pytest.mark.parametrize("msg", TO_DAEMON, ids=lambda m: type(m).__name__)
def test_to_daemon_round_trip(msg):
    data = p.encode(msg)
    assert p.decode_to_daemon(data) == msg
    assert p.decode_any(data) == msg
    assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__


@pytest.mark.parametrize("msg", TO_SHIM, ids=lambda m: type(m).__name__)
def test_to_shim_round_trip(msg):
    data = p.encode(msg)
    assert p.decode_to_shim(data) == msg
    assert p.decode_any(data) == msg


def test_an_older_daemons_status_reply_decodes_as_equal_tp():
    """A daemon older than the TP fields: doctor reads its reply as a decoder and prefills at one TP."""
    old = {"type": "StatusReply", "nonce": 1, "registered": True,
           "peers": [{"address": "10.0.0.5:5600", "engine_id": "e", "tp_rank": 0}]}
    reply = p.decode_to_shim(enc(old))
    assert (reply.tp_size, reply.tp_rank, reply.peers[0].tp_size) == (1, 0, 1)


def test_directions_are_not_mixed():
    with pytest.raises(p.DecodeError, match="'Done' travels daemon→shim"):
        p.decode_to_daemon(p.encode(TO_SHIM[3]))
    with pytest.raises(p.DecodeError, match="'Pull' travels shim→daemon"):
        p.decode_to_shim(p.encode(pull()))


def enc(obj):
    return msgspec.msgpack.encode(obj)


def pull_dict(**kw):
    d = msgspec.to_builtins(pull(), builtin_types=(bytes,))
    d.update(kw)
    return d


@pytest.mark.parametrize(("frame", "needle"), [
    (b"\xc1", "malformed frame"),
    (b"", "malformed frame"),
    (enc([1, 2]), "Expected `object`, got `array`"),
    (enc({"req_id": "x"}), "missing or non-string field 'type'"),
    (enc({"type": 3}), "missing or non-string field 'type'"),
    (enc({"type": "Frobnicate"}), "unknown message type 'Frobnicate'"),
    (enc({"type": "Ping", "extra": 1}), "unknown field `extra`"),
    (enc(pull_dict(req_id="")), "req_id must not be empty"),
    (enc(pull_dict(remote_port=0)), "remote_port must be in 1..65535"),
    (enc(pull_dict(remote_port="5600")), "Expected `int`, got `str` - at `$.remote_port`"),
    (enc(pull_dict(remote_request_id="a,b")), "must not contain ','"),
    (enc(pull_dict(remote_block_ids=b"\x01\x00\x00")), "remote_block_ids holds 3 bytes, not a whole number"),
    (enc(pull_dict(local_block_ids=p.pack_block_ids([0]) + b"\x02")), "local_block_ids holds 5 bytes"),
    (enc(pull_dict(remote_block_ids=[1, 2, 3])), "Expected `bytes`, got `array` - at `$.remote_block_ids`"),
    (enc(pull_dict(remote_num_tokens=-1)), "remote_num_tokens must be >= 0"),
    (enc(pull_dict(local_block_ids=p.pack_block_ids([2, 2]))), "must not repeat a block (block 2 does)"),
    (enc(pull_dict(local_block_ids=p.pack_block_ids([9, 4, 7, 4]))),
     "must not repeat a block (block 4 does)"),
    (enc(pull_dict(timeout_s=0)), "timeout_s must be a finite number > 0"),
    (enc(pull_dict(timeout_s=float("inf"))), "timeout_s must be a finite number > 0, got inf"),
    (enc(pull_dict(timeout_s=float("nan"))), "timeout_s must be a finite number > 0, got nan"),
    (enc(pull_dict(remote_tp_size=0)), "remote_tp_size must be in 1..64"),
    (enc(pull_dict(remote_tp_size=65)), "remote_tp_size must be in 1..64, got 65"),
    (enc(pull_dict(remote_host="h" * 256)), "remote_host must be at most 255 characters, got 256"),
    (enc(pull_dict(remote_request_id="r" * 1025)), "remote_request_id must be at most 1024 characters"),
    (enc(pull_dict(req_id="r" * 5000)), "req_id must be at most 1024 characters, got 5000"),
    (enc(pull_dict(remote_engine_id="e" * 1025)), "remote_engine_id must be at most 1024 characters"),
    (enc({"type": "Heartbeat", "targets": [{"remote_engine_id": "e", "remote_host": "h" * 300,
                                            "remote_port": 1, "remote_request_ids": ["a"]}]}),
     "remote_host must be at most 255"),
    (enc({"type": "Abort", "req_id": "a" * 1025}), "req_id must be at most 1024 characters"),
    (enc(pull_dict(remote_request_id="HB:r1")), "must not start with HB: or PUSH_REG:"),
    (enc(pull_dict(remote_request_id="PUSH_REG:x")), "must not start with HB: or PUSH_REG:"),
    (enc({"type": "Heartbeat", "targets": [{"remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                                            "remote_request_ids": ["HB:a"]}]}), "must not start with HB:"),
    (enc({"type": "Heartbeat", "targets": [{"remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                                            "remote_request_ids": ["a"], "remote_tp_size": 2**20}]}),
     "remote_tp_size must be in 1..64"),
    (enc({"type": "Hello", "protocol_version": 1, "package_version": "x", "tp_size": 1000}),
     "tp_size must be in 1..64"),
    (enc(pull_dict(remote_registration_generation=-1)), "remote_registration_generation must be >= 0"),
    (enc({"type": "Heartbeat", "targets": [{"remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                                            "remote_request_ids": ["a"],
                                            "remote_registration_generation": -1}]}),
     "remote_registration_generation must be >= 0"),
    (enc({k: v for k, v in pull_dict().items() if k != "req_id"}), "missing required field `req_id`"),
    (enc(pull_dict(lease_started_at_ns=-5)), "lease_started_at_ns must be >= 0"),
    (enc(pull_dict(timeout_s=None, local_block_ids="1,2")), "Expected `bytes`, got `str`"),
    (enc({"type": "Hello", "protocol_version": 1, "package_version": "x", "worker_rank": 2, "tp_size": 2}),
     "worker_rank must be in 0..tp_size-1"),
    (enc({"type": "Abort", "req_id": ""}), "req_id must not be empty"),
    (enc({"type": "Heartbeat", "targets": [{"remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                                            "remote_request_ids": ["a,b"]}]}), "must not contain ','"),
    (enc({"type": "RegisterCaches", "buffers": [], "layers": [], "page_format": msgspec.to_builtins(FMT)}),
     "buffers must not be empty"),
    (enc({"type": "RegisterCaches", "buffers": [msgspec.to_builtins(BUF)],
          "layers": [msgspec.to_builtins(LAYER) | {"buffer_index": 1}],
          "page_format": msgspec.to_builtins(FMT)}),
     "buffer_index 1 is out of range"),
    (enc({"type": "RegisterCaches", "buffers": [msgspec.to_builtins(BUF)],
          "layers": [msgspec.to_builtins(LAYER)], "page_format": msgspec.to_builtins(FMT) | {"dtype": "f7"}}),
     "dtype 'f7' is not one of"),
    (enc({"type": "RegisterCaches", "buffers": [msgspec.to_builtins(BUF) | {"device": "cuda:0"}],
          "layers": [msgspec.to_builtins(LAYER)], "page_format": msgspec.to_builtins(FMT)}),
     "kind 'shm' lives on device 'cpu'"),
    (enc({"type": "RegisterCaches", "buffers": [CUDA_BUF | {"cuda": CUDA | {"ref_counter_offset": 2**33}}],
          "layers": [msgspec.to_builtins(LAYER)], "page_format": msgspec.to_builtins(FMT)}),
     "<= 9999 - at `$.buffers[0].cuda.ref_counter_offset`"),
    (enc({"type": "RegisterCaches", "buffers": [CUDA_BUF | {"cuda": CUDA | {"storage_offset_bytes": -1}}],
          "layers": [msgspec.to_builtins(LAYER)], "page_format": msgspec.to_builtins(FMT)}),
     ">= 0 - at `$.buffers[0].cuda.storage_offset_bytes`"),
    (register_frame({"model": b"m"}), "compat_factors['model'] is of type bytes, not a JSON value"),
    (register_frame({"spec": {"k": {1: "a", "b": 2}}}),
     "compat_factors['spec']['k'] has the key 1 of type int, not str"),
    (register_frame({"rope": [1.0, float("nan")]}), "compat_factors['rope'][1] must be a finite number"),
    (register_frame({"x": float("inf")}), "compat_factors['x'] must be a finite number, got inf"),
    (register_frame({"deep": "HERE"}).replace(enc("HERE"), b"\x91" * 40 + b"\x01"), "nests deeper than 32"),
    (register_frame({"t": "HERE"}).replace(enc("HERE"), b"\xd6\xff\x00\x00\x00\x01"), "not a JSON value"),
    # nested arrays: msgspec raises RecursionError, which once escaped the decoder and ended the receive loop
    (b"\x91" * 3000 + b"\x01", "Expected `object`, got `array`"),
    (enc({"type": "RegisterCaches", "buffers": [msgspec.to_builtins(BUF)],
          "layers": [msgspec.to_builtins(LAYER)], "page_format": msgspec.to_builtins(FMT),
          "compat_factors": {"deep": "HERE"}}).replace(enc("HERE"), b"\x91" * 3000 + b"\x01"),
     "nested too deep"),
])
def test_daemon_rejects(frame, needle):
    with pytest.raises(p.DecodeError) as info:
        p.decode_to_daemon(frame)
    assert needle in str(info.value)


@pytest.mark.parametrize("shape", ["array", "map"])
def test_a_huge_invalid_frame_is_refused_without_being_decoded_whole(shape):
    """The router's Error names an invalid frame's type and req_id: it decoded the whole frame untyped to
    find them (twice: the decoder's message did too), so a 64 MiB array of zeros (ZMQ's MAXMSGSIZE lets it
    in) cost 1.1 s of the daemon's loop and 600 MB where its typed refusal costs microseconds."""
    import tracemalloc

    from sidecar.daemon.router import _peek

    n = 4 << 20
    zeros = b"\xdd" + n.to_bytes(4, "big") + b"\x00" * n  # a msgpack array of 4 Mi zeros
    if shape == "array":
        frame, expected = zeros, (None, None)
    else:  # a Pull with one field too many, the array
        frame = enc(pull_dict(req_id="r-1") | {"junk": "HERE"}).replace(enc("HERE"), zeros)
        expected = ("Pull", "r-1")
    tracemalloc.start()
    try:
        with pytest.raises(p.DecodeError):
            p.decode_to_daemon(frame)
        with pytest.raises(p.DecodeError):
            p.decode_on_completions(frame)
        assert _peek(frame) == expected
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a {len(frame)}-byte frame"


def test_a_heartbeat_is_bounded_and_the_shim_splits_a_larger_one():
    """A Heartbeat took any number of request ids: one of 4 M (34 MB, within ZMQ's MAXMSGSIZE), from a
    session that had only said Hello, held the daemon's loop 11 to 25 s, and seconds per pass after."""
    cap = p.MAX_HEARTBEAT_IDS

    def target(engine: str, n: int) -> dict:
        return {"remote_engine_id": engine, "remote_host": "h", "remote_port": 1,
                "remote_request_ids": [f"{engine}-{i}" for i in range(n)]}

    assert len(p.decode_to_daemon(enc({"type": "Heartbeat", "targets": [target("e", cap)]})).targets) == 1
    for targets, needle in [
        ([target("e", cap + 1)], f"length <= {cap} - at `$.targets[0].remote_request_ids`"),
        ([target("e", cap), target("f", 1)], f"at most {cap} request ids"),
        ([target("e", 1)] * 65, "length <= 64 - at `$.targets`"),
    ]:
        with pytest.raises(p.DecodeError, match=re.escape(needle)):
            p.decode_to_daemon(enc({"type": "Heartbeat", "targets": targets}))
    sizes = [("a", 3), ("b", 2 * cap + 5), ("c", 0), *((f"d{i}", 1) for i in range(70))]
    many = [p.HeartbeatTarget(**target(e, n)) for e, n in sizes]  # as the shim builds them: unbounded
    beats = p.heartbeats(many)
    assert len(beats) == 4 and all(p.decode_to_daemon(p.encode(b)) == b for b in beats)
    sent = [(t.remote_engine_id, rid) for b in beats for t in b.targets for rid in t.remote_request_ids]
    assert sent == [(t.remote_engine_id, rid) for t in many for rid in t.remote_request_ids]
    assert [len(b.targets) for b in beats] == [2, 1, 64, 8]


def test_compat_factors_that_decode_hash_alike_in_every_process():
    factors = {"model": "m", "n": 8, "f": 0.5, "spec": {"k": [1, {"x": None}], "on": True}, "none": None}
    msg = p.decode_to_daemon(register_frame(factors))
    assert msg.compat_factors == factors
    assert compatibility_hash(msg.compat_factors) == compatibility_hash(factors)
    with pytest.raises(ValueError, match=r"compat_factors\['b'\] is of type bytes"):  # built by a shim, too
        p.RegisterCaches(buffers=[BUF], layers=[LAYER], page_format=FMT, compat_factors={"b": b"x"})


def test_a_reason_is_cut_when_encoded_so_any_reply_fits_a_completion_packet():
    long = "x" * 300_000
    for msg in (p.Done(req_id="r" * p.MAX_ID_CHARS, ok=False, reason=long), p.Aborted(req_id="r", safe=True,
                reason=long), p.Error(reason=long), p.CompletionsBound(ok=False, reason=long)):
        data = p.encode(msg)
        assert len(data) < 65536 // 4
        reason = p.decode_to_shim(data).reason
        assert len(reason) == p.MAX_REASON_CHARS and reason.endswith(" [... cut, 300000 characters in all]")
    worst = p.encode(p.Done(req_id="\U0010ffff" * p.MAX_ID_CHARS, ok=False, reason="\U0010ffff" * 10**5,
                            timings={"end_to_end": 1.0}))
    assert len(worst) < 65536  # 4-byte UTF-8 everywhere
    short = p.Done(req_id="r", ok=False, reason="y" * p.MAX_REASON_CHARS)
    assert p.decode_to_shim(p.encode(short)) == short


def test_shim_rejects_unknown_fields():
    with pytest.raises(p.DecodeError, match="unknown field `surprise`"):
        p.decode_to_shim(enc({"type": "Done", "req_id": "r", "ok": True, "surprise": 1}))


def test_decode_error_is_a_value_error():
    assert issubclass(p.DecodeError, ValueError)


def test_protocol_3_carries_requests_on_the_completion_socket():
    """Version 3: Pull, Heartbeat and Abort decode on a bound completion socket; nothing else does."""
    assert p.PROTOCOL_VERSION >= 3
    pull = p.Pull(
        req_id="r",
        remote_engine_id="e",
        remote_host="h",
        remote_port=1,
        remote_request_id="rr",
        remote_block_ids=p.pack_block_ids([1]),
        local_block_ids=p.pack_block_ids([2]),
        sent_at_ns=123,
    )
    for msg in (pull, p.Heartbeat(targets=[]), p.Abort(req_id="r"), p.BindCompletions(routing_id=b"x")):
        assert p.decode_on_completions(p.encode(msg)) == msg
    for msg in (p.Hello(protocol_version=3, package_version="t"), p.Ping(), p.Unregister()):
        with pytest.raises(p.DecodeError, match="main \\(ZMQ\\) socket"):
            p.decode_on_completions(p.encode(msg))
    with pytest.raises(p.DecodeError, match="travels daemon→shim"):
        p.decode_on_completions(p.encode(p.Done(req_id="r", ok=True)))
    with pytest.raises(p.DecodeError, match="invalid Pull.*remote_port"):
        fields = msgspec.to_builtins(pull, builtin_types=(bytes,))
        p.decode_on_completions(msgspec.msgpack.encode({**fields, "remote_port": 0}))
    with pytest.raises(p.DecodeError, match="malformed"):
        p.decode_on_completions(b"\xc1")
    with pytest.raises(p.DecodeError, match="BindCompletions first"):
        p.decode_bind(p.encode(pull))


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300))
def test_block_ids_pack_and_unpack_to_the_same_ids(ids):
    packed = p.pack_block_ids(ids)
    assert len(packed) == 4 * len(ids)
    got = p.unpack_block_ids(packed)
    assert got.dtype == np.int64 and got.tolist() == ids


def test_packed_block_ids_are_little_endian_uint32():
    """The wire's bytes, written out: a peer on any platform reads the same ids."""
    assert p.pack_block_ids([1, 0x01020304, 2**32 - 1]) == bytes.fromhex("01000000" "04030201" "ffffffff")


@pytest.mark.parametrize(("ids", "needle"), [
    ([3, -1], "negative"),
    ([2**32], "greater than maximum"),
    ([1.5], "float"),
    (["7"], "str"),
])
def test_pack_block_ids_refuses_what_is_not_a_uint32(ids, needle):
    with pytest.raises(ValueError, match=f"block ids must be integers in 0..2\\*\\*32-1: .*{needle}"):
        p.pack_block_ids(ids)


def test_a_pull_made_with_id_lists_is_refused_at_once():
    """Protocol 4 packs the ids: a list would otherwise go out as a msgpack array the daemon refuses."""
    with pytest.raises(TypeError, match="local_block_ids must be bytes from pack_block_ids\\(\\), got list"):
        pull(local_block_ids=[4, 3])


def test_a_pull_counts_its_packed_ids():
    msg = p.decode_to_daemon(p.encode(pull()))
    assert (msg.num_remote_blocks, msg.num_local_blocks) == (3, 2)
    assert p.unpack_block_ids(msg.local_block_ids).tolist() == [4, 3]
