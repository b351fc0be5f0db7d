"""Cache export/import: shared memory with a real second process, layer views, checks, CUDA IPC on a GPU."""

import gc
import os
import re
import subprocess
import sys

import msgspec
import pytest
import torch

from sidecar.wire import ipc


def _vllm_like_caches(num_layers=3, blocks=6, heads=2, bs=16, c=64, dtype=torch.bfloat16):
    """One int8 allocation, per-layer [B, H, N, C] views into it, as vLLM's allocate_kv_cache makes them."""
    page = heads * bs * c * torch.tensor([], dtype=dtype).element_size()
    buf = torch.zeros(num_layers * blocks * page, dtype=torch.int8)
    caches = {}
    for layer in range(num_layers):
        raw = buf[layer * blocks * page:(layer + 1) * blocks * page]
        caches[f"model.layers.{layer}.self_attn.attn"] = raw.view(dtype).view(blocks, heads, bs, c)
    return caches


# The second process: import the caches, write ``value`` into block 1 of one layer, report the layer's sum.
CHILD = """
import sys, msgspec
from sidecar.wire import ipc
buffers_b, layers_b, name, value = msgspec.msgpack.decode(sys.stdin.buffer.read())
buffers = msgspec.msgpack.decode(buffers_b, type=list[ipc.IpcBuffer])
layers = msgspec.msgpack.decode(layers_b, type=list[ipc.LayerView])
imported, views = ipc.import_caches(buffers, layers, expect_device=buffers[0].device)
views[name][1].fill_(value)
if buffers[0].device != "cpu":
    import torch
    torch.cuda.synchronize()
total = float(views[name].float().sum())
del views
print(msgspec.json.encode({"total": total, "closed": [b.close() for b in imported]}).decode())
"""


def _in_child(exported, name, value):
    payload = msgspec.msgpack.encode([msgspec.msgpack.encode(exported.buffers),
                                      msgspec.msgpack.encode(exported.layers), name, value])
    out = subprocess.run([sys.executable, "-c", CHILD], input=payload, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    result = msgspec.json.decode(out.stdout.splitlines()[-1])
    return result["total"], result["closed"]


def test_in_place_export_and_a_second_process_writes_into_the_decoders_tensor():
    caches = _vllm_like_caches()
    exported = ipc.export_caches(caches)
    try:
        assert len(exported.buffers) == 1
        buf = exported.buffers[0]
        assert buf.kind == "shm" and buf.shm.data_offset == ipc.TORCH_SHM_HEADER_BYTES
        assert buf.shm.path.startswith("/dev/shm/torch_")
        for t, view in zip(caches.values(), exported.layers, strict=False):
            # in place: vLLM's own tensors now live in the shared file
            assert t.data_ptr() == t.untyped_storage().data_ptr() + view.offset_bytes
        name = "model.layers.1.self_attn.attn"
        total, closed = _in_child(exported, name, 2.5)
        layer = caches[name]
        assert closed == [True]
        assert total == 2.5 * layer[1].numel()
        assert torch.all(layer[1] == 2.5)
        assert torch.all(layer[0] == 0) and torch.all(layer[2:] == 0)
        assert all(torch.all(t == 0) for n, t in caches.items() if n != name)
    finally:
        exported.close()
    path = exported.buffers[0].shm.path
    assert os.path.exists(path)
    del caches, layer, t
    gc.collect()
    assert not os.path.exists(path)  # torch unlinks its file once the storage is freed


def test_plain_shm_file_export_and_strided_views():
    shm = ipc.create_shm_buffer(4096)
    try:
        base = shm.tensor.view(torch.float16)
        # a K/V-plane style view: [2 slots, 4 blocks, 8 tokens, 16] with the slot axis outermost, then a
        # non-contiguous one (every other token) to check strides travel
        planes = base[:1024].view(2, 4, 8, 16)
        skipping = base[1024:2048].view(4, 16, 16)[:, ::2, :]
        exported = ipc.export_caches({"planes": planes, "skip": skipping})
        assert exported.buffers == [shm.description]
        assert exported.layers[1].offset_bytes == 2048 and exported.layers[1].strides == [256, 32, 1]
        imported, views = ipc.import_caches(exported.buffers, exported.layers, expect_device="cpu")
        views["skip"].copy_(torch.arange(views["skip"].numel(), dtype=torch.float16).view(4, 8, 16))
        assert torch.equal(skipping, views["skip"])
        assert torch.all(base[1024:2048].view(4, 16, 16)[:, 1::2, :] == 0)
        views["planes"][1, 2].fill_(-1)
        assert torch.all(planes[1, 2] == -1)
        del views
        assert [b.close() for b in imported] == [True]
    finally:
        assert shm.close() is False  # the test's own views still map it; unlinked anyway
    assert not os.path.exists(shm.path)


def test_close_reports_live_views_then_releases():
    shm = ipc.create_shm_buffer(256)
    try:
        imported = ipc.import_buffer(shm.description)
        view = ipc.materialize_view(imported, ipc.LayerView(name="l", buffer_index=0, offset_bytes=0,
                                                            shape=[16], strides=[1], dtype="int64"))
        assert imported.close() is False
        del view
        assert imported.close() is True
        with pytest.raises(ipc.IpcError, match="closed"):
            imported.data_ptr()
    finally:
        shm.close()


def test_closing_many_buffers_collects_garbage_once(monkeypatch):
    """A decoder's 72 buffers closed while views of them are still alive (the daemon then logs that they
    unmap with their last view): one garbage collection for all of them, not one per buffer (which stalled
    the daemon's loop at unregister). Views held only by a reference cycle are unmapped by that one."""
    shms = [ipc.create_shm_buffer(64) for _ in range(72)]
    try:
        imported = [ipc.import_buffer(s.description) for s in shms]
        live = [b.tensor[:8] for b in imported[1:]]
        cycle = {"view": imported[0].tensor[:8]}
        cycle["self"] = cycle
        del cycle
        calls = []
        real = gc.collect
        monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or real(*a))
        assert ipc.close_imported(imported) is False
        assert len(calls) == 1
        assert imported[0]._map_ref() is None and all(b._map_ref() is not None for b in imported[1:])
        del live
        assert all(b._map_ref() is None for b in imported)
    finally:
        for s in shms:
            s.close()


def _layer(**kw):
    fields = dict(name="l0", buffer_index=0, offset_bytes=0, shape=[4, 8], strides=[8, 1], dtype="bfloat16")
    fields.update(kw)
    return ipc.LayerView(**fields)


def test_import_rejects_with_named_fields(tmp_path):
    shm = ipc.create_shm_buffer(128)
    try:
        d = shm.description
        with pytest.raises(ipc.IpcError, match="device: buffer lives on 'cpu' but this daemon serves"):
            ipc.import_buffer(d, expect_device="cuda:0")
        too_big = msgspec.structs.replace(d, nbytes=4096)
        with pytest.raises(ipc.IpcError, match="nbytes: .* holds 128 bytes, the description needs 4096"):
            ipc.import_buffer(too_big)
        gone = msgspec.structs.replace(d, shm=ipc.ShmFile(path="/dev/shm/kv-sidecar-missing-xyz"))
        with pytest.raises(ipc.IpcError, match="shm.path: cannot open"):
            ipc.import_buffer(gone)
        outside = tmp_path / "f"
        outside.write_bytes(b"\0" * 128)
        with pytest.raises(ipc.IpcError, match="is not under /dev/shm"):
            ipc.import_buffer(msgspec.structs.replace(d, shm=ipc.ShmFile(path=str(outside))))
        with pytest.raises(ipc.IpcError, match=r"view ends at byte 136, past buffer 0 of 128 bytes"):
            ipc.import_caches([d], [_layer(offset_bytes=72)])
        with pytest.raises(ipc.IpcError, match="offset_bytes: 3 is not a multiple"):
            ipc.import_caches([d], [_layer(offset_bytes=3)])
        with pytest.raises(ipc.IpcError, match="buffer_index: 1 but only 1 buffer"):
            ipc.import_caches([d], [_layer(buffer_index=1)])
        with pytest.raises(ipc.IpcError, match="duplicate layer name"):
            ipc.import_caches([d], [_layer(), _layer()])
        # an empty view (torch raised RuntimeError building [3, 5, 0, 2**63-1], past every typed refusal)
        for shape in ([0, 8], [3, 5, 0, 2**63 - 1]):
            with pytest.raises(ipc.IpcError, match="holds no elements"):
                ipc.import_caches([d], [_layer(shape=shape, strides=[1] * len(shape))])
    finally:
        shm.close()


def test_descriptions_validate_their_fields():
    for shape, strides in (([0, 2**64 - 1], [1, 1]), ([1, 1], [2**63, 1])):  # past a tensor's int64
        with pytest.raises(ValueError, match="must be < 2\\*\\*63"):
            _layer(shape=shape, strides=strides)
    with pytest.raises(ValueError, match="dtype 'bf16' is not one of"):
        _layer(dtype="bf16")
    with pytest.raises(ValueError, match="differ in length"):
        _layer(strides=[1])
    with pytest.raises(ValueError, match="kind 'shm' needs the shm field"):
        ipc.IpcBuffer(kind="shm", nbytes=1, device="cpu")
    with pytest.raises(ValueError, match="kind 'cuda' needs the cuda field"):
        ipc.IpcBuffer(kind="cuda", nbytes=1, device="cuda:0")
    with pytest.raises(ValueError, match="absolute path without '..'"):
        ipc.IpcBuffer(kind="shm", nbytes=1, device="cpu", shm=ipc.ShmFile(path="/dev/shm/../etc/passwd"))
    handle = ipc.CudaIpcHandle(device=1, handle=b"h", storage_size_bytes=8, storage_offset_bytes=0,
                               ref_counter_handle=b"r", ref_counter_offset=0)
    with pytest.raises(ValueError, match="disagrees with cuda.device 1"):
        ipc.IpcBuffer(kind="cuda", nbytes=8, device="cuda:0", cuda=handle)
    with pytest.raises(ValueError, match="storage_size_bytes 8 < nbytes 16"):
        ipc.IpcBuffer(kind="cuda", nbytes=16, device="cuda:1", cuda=handle)
    assert _layer().extent_bytes == 64 and _layer(shape=[0, 8]).extent_bytes == 0


def _cuda_buffer(**handle):
    fields = dict(device=0, handle=b"h" * 66, storage_size_bytes=4096, storage_offset_bytes=0,
                  ref_counter_handle=b"/torch_1_2_3", ref_counter_offset=7)
    fields.update(handle)
    return {"kind": "cuda", "nbytes": 4096, "device": "cuda:0", "cuda": fields}


@pytest.mark.parametrize(("handle", "needle"), [
    # torch's deleter decrements the int64 at slot ref_counter_offset of a 10000-slot file, unchecked
    ({"ref_counter_offset": 2**40}, "<= 9999 - at `$.cuda.ref_counter_offset`"),
    ({"ref_counter_offset": 10_000}, "at `$.cuda.ref_counter_offset`"),
    ({"ref_counter_offset": -8}, ">= 0 - at `$.cuda.ref_counter_offset`"),
    ({"storage_offset_bytes": -4096}, ">= 0 - at `$.cuda.storage_offset_bytes`"),  # before the allocation
    ({"storage_size_bytes": -1}, ">= 0 - at `$.cuda.storage_size_bytes`"),
    ({"storage_offset_bytes": 2**63 - 1}, "past a device pointer's range"),
    ({"device": -1}, ">= 0 - at `$.cuda.device`"),
    ({"event_handle": b"short"}, "event_handle must be empty or 64 bytes, got 5"),  # torch reads 64
    ({"event_sync_required": True}, "event_handle must be given when event_sync_required"),
])
def test_cuda_handle_fields_out_of_torchs_bounds_are_refused_naming_them(handle, needle):
    data = msgspec.msgpack.encode(_cuda_buffer(**handle))
    with pytest.raises(msgspec.ValidationError, match=re.escape(needle)):
        msgspec.msgpack.decode(data, type=ipc.IpcBuffer)


def test_cuda_handle_bounds_hold_for_a_constructed_handle_too():
    fields = _cuda_buffer()["cuda"]
    for name, value in (("ref_counter_offset", 10_000), ("ref_counter_offset", -1),
                        ("storage_offset_bytes", -64), ("storage_size_bytes", -1)):
        with pytest.raises(ValueError, match=name):
            ipc.CudaIpcHandle(**{**fields, name: value})
    good = msgspec.msgpack.decode(msgspec.msgpack.encode(_cuda_buffer(ref_counter_offset=9999,
                                                                      event_handle=b"e" * 64,
                                                                      event_sync_required=True)),
                                  type=ipc.IpcBuffer)
    assert good.cuda.ref_counter_offset == 9999


def test_cuda_buffer_on_a_host_without_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU; the refusal path is for GPU-less hosts")
    handle = ipc.CudaIpcHandle(device=0, handle=b"h", storage_size_bytes=8, storage_offset_bytes=0,
                               ref_counter_handle=b"r", ref_counter_offset=0)
    buf = ipc.IpcBuffer(kind="cuda", nbytes=8, device="cuda:0", cuda=handle)
    with pytest.raises(ipc.IpcError, match="this process has no GPU"):
        ipc.import_buffer(buf)


def test_ipc_module_does_not_import_torch():
    code = "import sys, sidecar.wire.ipc, sidecar.wire.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_cuda_ipc_second_process_reads_and_writes():
    alloc = torch.ones(2 * 4 * 2 * 16 * 64, dtype=torch.bfloat16, device="cuda:0")
    caches = {"l0": alloc[:8192].view(4, 2, 16, 64), "l1": alloc[8192:].view(4, 2, 16, 64)}
    exported = ipc.export_caches(caches)
    assert exported.buffers[0].kind in ("cuda", "hip")
    assert exported.layers[1].offset_bytes == 8192 * 2
    total, closed = _in_child(exported, "l1", 7.0)
    assert closed == [True]
    assert total == float(caches["l1"].numel() + 6 * caches["l1"][1].numel())
    torch.cuda.synchronize()
    assert torch.all(caches["l1"][1] == 7)
    assert torch.all(caches["l1"][0] == 1) and torch.all(caches["l1"][2:] == 1)
    assert torch.all(caches["l0"] == 1)


# The second process imports the buffer and reports what the import said.
IMPORT_CHILD = """
import sys, msgspec
from sidecar.wire import ipc
buf = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ipc.IpcBuffer)
try:
    ipc.import_buffer(buf).close()
    print("imported")
except ipc.IpcError as e:
    print("refused:", e)
"""


def _import_in_child(buf, env=None):
    out = subprocess.run([sys.executable, "-c", IMPORT_CHILD], input=msgspec.msgpack.encode(buf),
                         capture_output=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().strip().splitlines()[-1]


EXPORTER = """
import sys, msgspec, torch
from sidecar.wire import ipc
before = torch.empty(256 << 10, dtype=torch.uint8, device="cuda:0")  # so t may start inside its allocation
t = torch.ones(256 << 10, dtype=torch.uint8, device="cuda:0")
buf = ipc.export_caches({"l0": t}).buffers[0]
print(msgspec.json.encode(buf).decode(), flush=True)
sys.stdin.read()  # keep the allocation alive until the test is done
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("allocator", ["default", "expandable_segments:True"])
def test_cuda_storage_outside_its_allocation_is_refused_naming_the_field(allocator):
    """A handle whose offset or size leads past the allocation it opens is refused: torch would map it and let
    the daemon write into whatever lies beyond. An honest handle, from either allocator, imports."""
    env = dict(os.environ)
    if allocator != "default":
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
    try:
        buf = msgspec.json.decode(exporter.stdout.readline(), type=ipc.IpcBuffer)
        assert _import_in_child(buf) == "imported"
        h = buf.cuda
        longer = msgspec.structs.replace(h, storage_size_bytes=h.storage_size_bytes + (1 << 30))
        said = _import_in_child(msgspec.structs.replace(buf, cuda=longer))
        assert said.startswith("refused: cuda.storage_size_bytes"), said
        assert "past the exporter's allocation" in said
        for shift in (1 << 30, 1 << 40):
            moved = msgspec.structs.replace(h, storage_offset_bytes=h.storage_offset_bytes + shift)
            said = _import_in_child(msgspec.structs.replace(buf, cuda=moved))
            assert said.startswith("refused: cuda.storage_offset_bytes"), said
    finally:
        exporter.stdin.close()
        exporter.wait(timeout=60)
