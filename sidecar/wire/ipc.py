"""Export and import of the decoder's cache buffers across processes, as plain typed fields (never pickle).

Two kinds of buffer:

* ``cuda`` / ``hip``: a GPU allocation shared through torch's storage IPC (``storage._share_cuda_()`` on the
  exporter, ``torch.UntypedStorage._new_shared_cuda`` on the importer). torch on ROCm uses the same calls.
* ``shm``: the CPU twin. A file under ``/dev/shm``: either the decoder's own storage moved there in place by
  ``storage._share_filename_cpu_()`` (torch's refcount header puts the data at byte 64) or a plain file
  created by :func:`create_shm_buffer` (data at byte 0). The importer mmaps the file.

Each layer is a :class:`LayerView` into one of the buffers: offset, shape, strides (elements) and dtype,
so the description covers whatever layout the attention backend allocated. torch is imported lazily: the
shim side imports this module inside vLLM and must stay light at import time.

Size: two buffer kinds (device IPC, POSIX shm), each with export, import and checks that must agree.
"""

from __future__ import annotations

import contextlib
import gc
import math
import mmap
import os
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if TYPE_CHECKING:  # pragma: no cover
    import torch

BufferKind = Literal["cuda", "hip", "shm"]

SHM_DIR = "/dev/shm"
# torch's refcounted map allocator keeps an int64 refcount at the start of a filename-shared storage.
TORCH_SHM_HEADER_BYTES = 64

# torch's CUDA IPC ref-counter files hold CUDA_IPC_REF_COUNTER_FILE_SIZE int64 slots
# (10000 in torch/csrc/CudaIPCTypes.h, torch 2.13). ``ref_counter_offset`` is a slot index, and the
# importer's deleter decrements ``*((int64_t*)map + offset)`` unchecked: past the file, a write in the daemon.
TORCH_IPC_REF_COUNTER_SLOTS = 10000
# sizeof(cudaIpcEventHandle_t), hipIpcEventHandle_t's too: torch reads that many bytes of event_handle.
IPC_EVENT_HANDLE_BYTES = 64
# Device pointers are int64 (ptrdiff_t) in torch: storage offset + size must stay below this.
_PTR_LIMIT = 2**63

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=_PTR_LIMIT - 1)]

# torch dtype name (without "torch.") -> bytes per element. Layer views may use any of these.
VIEW_DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}


class IpcError(ValueError):
    """A buffer or layer description that cannot be imported; the message names the field."""


class CudaIpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fields of ``storage._share_cuda_()``, in its order, plus the device's UUID for a cross-check."""

    device: NonNegInt
    handle: bytes
    storage_size_bytes: ByteCount
    storage_offset_bytes: ByteCount  # where the storage starts in the exporter's allocation
    ref_counter_handle: bytes
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=TORCH_IPC_REF_COUNTER_SLOTS)]
    event_handle: bytes = b""
    event_sync_required: bool = False
    device_uuid: str = ""

    def __post_init__(self) -> None:
        # The Meta bounds hold for decoded handles only; these hold for constructed ones too.
        if not 0 <= self.ref_counter_offset < TORCH_IPC_REF_COUNTER_SLOTS:
            raise ValueError(f"ref_counter_offset must be a slot in 0..{TORCH_IPC_REF_COUNTER_SLOTS - 1} of "
                             f"torch's ref-counter file, got {self.ref_counter_offset}")
        for name in ("storage_offset_bytes", "storage_size_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.storage_offset_bytes + self.storage_size_bytes >= _PTR_LIMIT:
            raise ValueError(f"storage_offset_bytes {self.storage_offset_bytes} + storage_size_bytes "
                             f"{self.storage_size_bytes} is past a device pointer's range (2**63)")
        if len(self.event_handle) not in (0, IPC_EVENT_HANDLE_BYTES):
            raise ValueError(f"event_handle must be empty or {IPC_EVENT_HANDLE_BYTES} bytes, "
                             f"got {len(self.event_handle)}")
        if self.event_sync_required and not self.event_handle:
            raise ValueError("event_handle must be given when event_sync_required is set")


class ShmFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A /dev/shm file holding the buffer at ``data_offset`` (64 for torch's filename sharing, else 0)."""

    path: str
    data_offset: ByteCount = 0
    owner_pid: int = 0


class IpcBuffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One exported allocation. ``nbytes`` is the usable size; ``device`` is ``"cpu"`` or ``"cuda:N"``."""

    kind: BufferKind
    nbytes: ByteCount
    device: str
    cuda: CudaIpcHandle | None = None
    shm: ShmFile | None = None

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {self.nbytes}")
        if self.kind == "shm":
            if self.shm is None:
                raise ValueError("kind 'shm' needs the shm field")
            if self.device != "cpu":
                raise ValueError(f"kind 'shm' lives on device 'cpu', not {self.device!r}")
            if self.shm.data_offset < 0:
                raise ValueError(f"shm.data_offset must be >= 0, got {self.shm.data_offset}")
            if not os.path.isabs(self.shm.path) or ".." in self.shm.path.split("/"):
                raise ValueError(f"shm.path must be an absolute path without '..', got {self.shm.path!r}")
        else:
            if self.cuda is None:
                raise ValueError(f"kind {self.kind!r} needs the cuda field")
            if self.device != f"cuda:{self.cuda.device}":
                raise ValueError(f"device {self.device!r} disagrees with cuda.device {self.cuda.device}")
            if self.cuda.storage_size_bytes < self.nbytes:
                raise ValueError(f"cuda.storage_size_bytes {self.cuda.storage_size_bytes} "
                                 f"< nbytes {self.nbytes}")


class LayerView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layer's tensor as a view into ``buffers[buffer_index]``: byte offset, shape, strides, dtype."""

    name: str
    buffer_index: int
    offset_bytes: int
    shape: list[int]
    strides: list[int]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        if self.buffer_index < 0:
            raise ValueError(f"buffer_index must be >= 0, got {self.buffer_index}")
        if self.offset_bytes < 0:
            raise ValueError(f"offset_bytes must be >= 0, got {self.offset_bytes}")
        if len(self.shape) != len(self.strides):
            raise ValueError(f"shape {self.shape} and strides {self.strides} differ in length")
        if any(s < 0 for s in self.shape) or any(s < 0 for s in self.strides):
            raise ValueError(f"shape {self.shape} and strides {self.strides} must be >= 0")
        if any(s >= 2**63 for s in self.shape) or any(s >= 2**63 for s in self.strides):
            raise ValueError(f"shape {self.shape} and strides {self.strides} must be < 2**63 (torch int64)")
        if self.dtype not in VIEW_DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(VIEW_DTYPE_BYTES)}")

    @property
    def elem_bytes(self) -> int:
        return VIEW_DTYPE_BYTES[self.dtype]

    @property
    def extent_bytes(self) -> int:
        """Bytes from the view's first element to one past its last."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((n - 1) * st for n, st in zip(self.shape, self.strides, strict=True))
        return (1 + last) * self.elem_bytes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.elem_bytes


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in VIEW_DTYPE_BYTES or not hasattr(torch, name):
        raise IpcError(f"dtype {name!r} is not a torch dtype this build knows")
    return getattr(torch, name)


# ------------------------------------------------------------------------------------------ exporter side


class ExportedCaches:
    """What the exporter keeps: the buffer descriptions to send and the layer views.

    A file made by torch's filename sharing belongs to torch: it unlinks it when the storage is freed,
    and aborts the process (a C++ error thrown in a destructor) if anyone else unlinked the name before.
    So :meth:`close` never unlinks those; it only drops this object's references.
    """

    def __init__(self, buffers: list[IpcBuffer], layers: list[LayerView], keep_alive: list[Any]) -> None:
        self.buffers = buffers
        self.layers = layers
        self._keep_alive = keep_alive

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def close(self) -> None:
        self._keep_alive = []


def export_caches(kv_caches: dict[str, torch.Tensor]) -> ExportedCaches:
    """Export the storages behind vLLM's layer tensors and describe each layer as a view into them.

    CPU storages are moved into /dev/shm in place (``_share_filename_cpu_``), unless they already live in
    a file this module created; GPU storages are shared by CUDA/HIP IPC. Call after vLLM allocated its
    caches and before anything records their addresses: in-place sharing changes ``data_ptr``.
    """
    storages: dict[int, Any] = {}
    order: list[int] = []
    for t in kv_caches.values():
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in storages:
            storages[key] = st
            order.append(key)
    index_of = {key: i for i, key in enumerate(order)}
    # Record offsets before sharing: in-place sharing moves the data but keeps each view's storage offset.
    offsets = {name: t.storage_offset() * t.element_size() for name, t in kv_caches.items()}
    layer_buffer = {name: index_of[t.untyped_storage().data_ptr()] for name, t in kv_caches.items()}

    buffers = [_export_storage(storages[key]) for key in order]
    layers = [
        LayerView(name=name, buffer_index=layer_buffer[name], offset_bytes=offsets[name], shape=list(t.shape),
                  strides=list(t.stride()), dtype=dtype_name(t.dtype))
        for name, t in kv_caches.items()
    ]
    for layer in layers:
        _check_view_fits(layer, buffers)
    return ExportedCaches(buffers, layers, list(storages.values()))


def _export_storage(st: Any) -> IpcBuffer:
    if st.device.type == "cuda":
        return export_cuda_storage(st)
    if st.device.type != "cpu":
        raise IpcError(f"cannot export a storage on device {st.device}")
    known = _CREATED_SHM.get(st.data_ptr())
    if known is not None:
        return known
    _manager_handle, filename, size = st._share_filename_cpu_()
    return IpcBuffer(kind="shm", nbytes=int(size), device="cpu",
                     shm=ShmFile(path=SHM_DIR + filename.decode(), data_offset=TORCH_SHM_HEADER_BYTES,
                                 owner_pid=os.getpid()))


def export_cuda_storage(st: Any) -> IpcBuffer:
    """Share one CUDA/HIP storage by IPC; the event handle lets the importer wait for pending writes."""
    import torch

    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = st._share_cuda_()
    device = int(device)
    uuid_str = ""
    props = torch.cuda.get_device_properties(device)
    if getattr(props, "uuid", None) is not None:
        uuid_str = str(props.uuid)
    kind: BufferKind = "hip" if torch.version.hip else "cuda"
    return IpcBuffer(
        kind=kind, nbytes=int(st.nbytes()), device=f"cuda:{device}",
        cuda=CudaIpcHandle(device=device, handle=bytes(handle), storage_size_bytes=int(size),
                           storage_offset_bytes=int(offset), ref_counter_handle=bytes(ref_handle),
                           ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
                           event_sync_required=bool(event_sync), device_uuid=uuid_str))


# data_ptr -> description of the shm files created here, so export_caches recognises them.
_CREATED_SHM: dict[int, IpcBuffer] = {}


class ShmBuffer:
    """A plain /dev/shm file created by this process, mapped and wrapped as a uint8 tensor."""

    def __init__(self, path: str, nbytes: int) -> None:
        import torch

        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            m = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._map_ref: weakref.ref[mmap.mmap] | None = weakref.ref(m)
        self.tensor = torch.frombuffer(m, dtype=torch.uint8, count=nbytes) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        self.description = IpcBuffer(kind="shm", nbytes=nbytes, device="cpu",
                                     shm=ShmFile(path=path, data_offset=0, owner_pid=os.getpid()))
        _CREATED_SHM[self.tensor.untyped_storage().data_ptr()] = self.description

    def close(self) -> bool:
        """Unlink the file and drop the mapping; False if tensors still use it (the last one unmaps)."""
        if self.tensor is not None:
            _CREATED_SHM.pop(self.tensor.untyped_storage().data_ptr(), None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.tensor = None
        return _release_map(self._map_ref)


def create_shm_buffer(nbytes: int, *, name: str | None = None) -> ShmBuffer:
    """Create ``/dev/shm/<name>`` of ``nbytes`` (owner-only) and map it; the caller owns and closes it."""
    name = name or f"kv-sidecar-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if "/" in name:
        raise IpcError(f"shm name {name!r} must not contain '/'")
    return ShmBuffer(os.path.join(SHM_DIR, name), nbytes)


def _release_map(ref: weakref.ref[mmap.mmap] | None) -> bool:
    """True when nothing maps the memory any more. Never ``mmap.close()`` explicitly: torch.frombuffer
    tensors keep only a reference to the mmap object, not a buffer export, so closing it under a live
    view would unmap memory the view still points to."""
    gc_needed = ref is not None and ref() is not None
    if gc_needed:
        gc.collect()
    return ref is None or ref() is None


# ------------------------------------------------------------------------------------------ importer side


class ImportedBuffer:
    """One imported buffer as a flat uint8 tensor on its device; :meth:`close` releases the mapping."""

    def __init__(self, description: IpcBuffer, tensor: torch.Tensor, mapping: mmap.mmap | None) -> None:
        self.description = description
        self.tensor: torch.Tensor | None = tensor
        # Only the tensor (and views made from it) keep the mapping alive; it unmaps when the last one goes.
        self._map_ref = weakref.ref(mapping) if mapping is not None else None

    @property
    def nbytes(self) -> int:
        return self.description.nbytes

    def data_ptr(self) -> int:
        if self.tensor is None:
            raise IpcError("buffer already closed")
        return self.tensor.data_ptr()

    def close(self) -> bool:
        """Drop this object's mapping. False if views made from it are still alive (the last one unmaps)."""
        return close_imported([self])

    def _drop(self) -> weakref.ref[mmap.mmap] | None:
        self.tensor = None
        return self._map_ref


def close_imported(buffers: Sequence[ImportedBuffer]) -> bool:
    """Close every buffer, with one garbage collection at most for all of them (one per buffer stalled the
    daemon's loop for over a second when a 36-layer CPU decoder unregistered). True when none is mapped."""
    refs = [b._drop() for b in buffers]
    if any(r is not None and r() is not None for r in refs):
        gc.collect()
    return all(r is None or r() is None for r in refs)


def import_buffer(buf: IpcBuffer, *, expect_device: str | None = None) -> ImportedBuffer:
    """Map one exported buffer. ``expect_device`` (``"cpu"`` / ``"cuda:N"``) must match the buffer's."""
    if expect_device is not None and buf.device != expect_device:
        raise IpcError(f"device: buffer lives on {buf.device!r} but this daemon serves {expect_device!r}")
    if buf.kind == "shm":
        return _import_shm(buf)
    return _import_cuda(buf)


def _import_shm(buf: IpcBuffer) -> ImportedBuffer:
    import torch

    assert buf.shm is not None
    path = buf.shm.path
    real = os.path.realpath(path)
    if not real.startswith(SHM_DIR + "/"):
        raise IpcError(f"shm.path: {path!r} is not under {SHM_DIR}")
    try:
        fd = os.open(real, os.O_RDWR)
    except OSError as e:
        raise IpcError(f"shm.path: cannot open {path!r}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        need = buf.shm.data_offset + buf.nbytes
        if size < need:
            raise IpcError(f"nbytes: {path!r} holds {size} bytes, the description needs {need} "
                           f"(data_offset {buf.shm.data_offset} + nbytes {buf.nbytes})")
        if buf.nbytes == 0:
            return ImportedBuffer(buf, torch.empty(0, dtype=torch.uint8), None)
        m = mmap.mmap(fd, need)
    finally:
        os.close(fd)
    t = torch.frombuffer(m, dtype=torch.uint8, count=buf.nbytes, offset=buf.shm.data_offset)
    return ImportedBuffer(buf, t, m)


def _import_cuda(buf: IpcBuffer) -> ImportedBuffer:
    import torch

    assert buf.cuda is not None
    h = buf.cuda
    if not torch.cuda.is_available():
        raise IpcError(f"device: buffer is {buf.kind} on {buf.device} but this process has no GPU")
    if h.device >= torch.cuda.device_count():
        raise IpcError(f"cuda.device: {h.device} but only {torch.cuda.device_count()} GPU(s) are visible")
    if h.device_uuid:
        props = torch.cuda.get_device_properties(h.device)
        mine = str(getattr(props, "uuid", ""))
        if mine and mine != h.device_uuid:
            raise IpcError(f"cuda.device_uuid: exporter's GPU {h.device_uuid} is not local GPU {h.device} "
                           f"({mine}); check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES on both sides")
    torch.cuda._lazy_init()
    st = torch.UntypedStorage._new_shared_cuda(
        h.device, h.handle, h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_handle,
        h.ref_counter_offset, h.event_handle or None, h.event_sync_required)
    if st.nbytes() < buf.nbytes:
        raise IpcError(f"nbytes: imported storage has {st.nbytes()} bytes, description says {buf.nbytes}")
    _check_within_allocation(h, st.data_ptr(), bool(torch.version.hip))
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}")
    t.set_(st, 0, (buf.nbytes,), (1,))
    return ImportedBuffer(buf, t, None)


def _check_within_allocation(h: CudaIpcHandle, ptr: int, hip: bool) -> None:
    """The imported storage lies inside the allocation its handle opened. torch maps the whole allocation
    and trusts the offset and size it is given: past the allocation's end the daemon's address space may hold
    another mapping, such as another buffer of the same decoder, and a write there is a write outside the
    request's blocks."""
    if h.storage_size_bytes == 0:
        return
    base, size = _allocation_range(h.device, ptr, hip)
    mapped = ptr - h.storage_offset_bytes  # where torch mapped the handle's allocation
    if base != mapped:
        raise IpcError(f"cuda.storage_offset_bytes: {h.storage_offset_bytes} leads out of the exporter's "
                       f"allocation into another one")
    if h.storage_offset_bytes + h.storage_size_bytes > size:
        raise IpcError(f"cuda.storage_size_bytes: storage_offset_bytes {h.storage_offset_bytes} + "
                       f"storage_size_bytes {h.storage_size_bytes} run past the exporter's allocation of "
                       f"{size} bytes")


def _allocation_range(device: int, ptr: int, hip: bool) -> tuple[int, int]:
    """(base, bytes) of the device allocation holding ``ptr`` (``cuMemGetAddressRange`` /
    ``hipMemGetAddressRange``, through the driver library torch has loaded already)."""
    import ctypes

    import torch

    lib, fn = ("libamdhip64.so", "hipMemGetAddressRange") if hip else \
        ("libcuda.so.1", "cuMemGetAddressRange_v2")
    try:
        call = getattr(ctypes.CDLL(lib), fn)
    except (OSError, AttributeError) as e:
        raise IpcError(f"cuda.handle: cannot check the imported storage's bounds ({lib}: {e})") from None
    call.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device):  # the driver call needs the device's context current on this thread
        rc = call(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise IpcError(f"cuda.storage_offset_bytes: the imported storage's start {ptr:#x} is in no "
                       f"allocation of GPU {device} ({fn} returned {rc})")
    return int(base.value), int(size.value)


def _check_view_fits(layer: LayerView, buffers: list[IpcBuffer]) -> None:
    if layer.buffer_index >= len(buffers):
        raise IpcError(f"layers[{layer.name}].buffer_index: {layer.buffer_index} but only "
                       f"{len(buffers)} buffer(s)")
    _check_view_in(layer, buffers[layer.buffer_index].nbytes)


def _check_view_in(layer: LayerView, size: int) -> None:
    if layer.offset_bytes % layer.elem_bytes:
        raise IpcError(f"layers[{layer.name}].offset_bytes: {layer.offset_bytes} is not a multiple of the "
                       f"{layer.dtype} element size {layer.elem_bytes}")
    if layer.extent_bytes == 0:
        raise IpcError(f"layers[{layer.name}]: shape {layer.shape} holds no elements")
    end = layer.offset_bytes + layer.extent_bytes
    if end > size:
        raise IpcError(f"layers[{layer.name}]: view ends at byte {end}, past buffer {layer.buffer_index} "
                       f"of {size} bytes")


def check_layers(layers: list[LayerView], buffers: list[IpcBuffer]) -> None:
    """Validate every view against the buffer descriptions (pure; no mapping needed)."""
    seen: set[str] = set()
    for layer in layers:
        if layer.name in seen:
            raise IpcError(f"layers[{layer.name}]: duplicate layer name")
        seen.add(layer.name)
        _check_view_fits(layer, buffers)


def materialize_view(buffer: ImportedBuffer, layer: LayerView) -> torch.Tensor:
    """The layer's tensor over an imported buffer: uint8 slice → ``.view(dtype)`` → ``as_strided``."""
    _check_view_in(layer, buffer.nbytes)
    if buffer.tensor is None:
        raise IpcError(f"layers[{layer.name}]: buffer {layer.buffer_index} is closed")
    dtype = torch_dtype(layer.dtype)
    extent = layer.extent_bytes
    flat = buffer.tensor[layer.offset_bytes:layer.offset_bytes + extent].view(dtype)
    return flat.as_strided(tuple(layer.shape), tuple(layer.strides))


def materialize_views(buffers: list[ImportedBuffer], layers: list[LayerView]) -> dict[str, torch.Tensor]:
    """Every layer's tensor, by name, checked against its buffer."""
    check_layers(layers, [b.description for b in buffers])
    return {layer.name: materialize_view(buffers[layer.buffer_index], layer) for layer in layers}


def import_caches(buffers: list[IpcBuffer], layers: list[LayerView], *,
                  expect_device: str | None = None) -> tuple[list[ImportedBuffer], dict[str, torch.Tensor]]:
    """Map every buffer and build every layer view; on any failure, release what was mapped and raise."""
    check_layers(layers, buffers)
    imported: list[ImportedBuffer] = []
    try:
        for buf in buffers:
            imported.append(import_buffer(buf, expect_device=expect_device))
        return imported, materialize_views(imported, layers)
    except BaseException:
        close_imported(imported)
        raise


# ----------------------------------------------------------------------------------------------- events


def export_event(event: Any) -> bytes:
    """IPC handle of a ``torch.cuda.Event(interprocess=True)``."""
    return bytes(event.ipc_handle())


def import_event(device: int, handle: bytes) -> Any:
    import torch

    return torch.cuda.Event.from_ipc_handle(device, handle)
