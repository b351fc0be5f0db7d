"""A UCP endpoint of our own to a prefill's UCX worker: read its registered memory, or map it.

NIXL keeps its UCP endpoints and remote keys inside C++, so it cannot hand us what ``ucp_rkey_ptr`` gives:
a pointer in this process to another process's registered memory (on NVIDIA, UCX's cuda_ipc maps the
prefill's VRAM here; a kernel can then read the prefill's pages itself). Both things UCX needs come with the
prefill's agent metadata (``sidecar.wire.nixl_metadata``): its worker's address and each region's packed key.
So this opens a small UCP context of its own on the UCX the nixl wheel ships, through ctypes and UCP's public
API only. Each parameter struct is passed as a zeroed buffer with its field mask first (``ucp.h``, UCX 1.2x),
so fields we leave unset keep UCX's defaults.

Used by the mapped read mode (``sidecar.nixl.mapping``) and ``kv-sidecar bench map``.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import time
from collections.abc import Callable

UCS_OK, UCS_INPROGRESS, UCS_ERR_UNREACHABLE = 0, 1, -6
UCP_FEATURE_RMA = 1 << 1
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_ERR_HANDLING_MODE_PEER = 1  # a dead peer fails requests instead of hanging them; lets close force
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0
_PARAMS_WORDS = 64  # 512 zeroed bytes: larger than any UCP parameter struct we pass
_ERR_PTR_FLOOR = (1 << 64) - 100  # UCS_PTR_IS_ERR: a "pointer" at or above this is a negative status


class UcxError(RuntimeError):
    """A UCP call failed; ``status`` is UCX's ``ucs_status_t``."""

    def __init__(self, call: str, status: int, text: str) -> None:
        super().__init__(f"{call}: {text} (UCS status {status})")
        self.call = call
        self.status = status


def wheel_ucx_dir() -> str:
    """The folder holding the UCX libraries of the installed nixl wheel (``nixl_cu13.libs`` or cu12)."""
    for name in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            path = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), f"{name}.libs")
            if glob.glob(os.path.join(path, "libucp-*.so*")):
                return path
    raise UcxError("load", -1, "no nixl_cu13 or nixl_cu12 wheel with its bundled libucp is installed")


class Ucp:
    """The bundled libucp and libucs, their signatures declared once."""

    def __init__(self, libdir: str | None = None) -> None:
        libdir = libdir or wheel_ucx_dir()
        self.libdir = libdir
        self.ucs = ctypes.CDLL(_one(libdir, "libucs-*.so*"))
        self.ucp = ctypes.CDLL(_one(libdir, "libucp-*.so*"))
        vp, pvp, u64 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64
        self.ucs.ucs_status_string.restype = ctypes.c_char_p
        self.ucs.ucs_status_string.argtypes = [ctypes.c_int]
        self.ucp.ucp_get_version_string.restype = ctypes.c_char_p
        self.ucp.ucp_get_version.argtypes = [ctypes.POINTER(ctypes.c_uint)] * 3
        self.ucp.ucp_init_version.argtypes = [ctypes.c_uint, ctypes.c_uint, vp, vp, pvp]
        self.ucp.ucp_cleanup.argtypes = [vp]
        self.ucp.ucp_worker_create.argtypes = [vp, vp, pvp]
        self.ucp.ucp_worker_destroy.argtypes = [vp]
        self.ucp.ucp_worker_progress.restype = ctypes.c_uint
        self.ucp.ucp_worker_progress.argtypes = [vp]
        self.ucp.ucp_ep_create.argtypes = [vp, vp, pvp]
        self.ucp.ucp_ep_close_nbx.restype = vp
        self.ucp.ucp_ep_close_nbx.argtypes = [vp, vp]
        self.ucp.ucp_ep_rkey_unpack.argtypes = [vp, vp, pvp]
        self.ucp.ucp_rkey_destroy.argtypes = [vp]
        self.ucp.ucp_rkey_ptr.argtypes = [vp, u64, pvp]
        self.ucp.ucp_get_nbx.restype = vp
        self.ucp.ucp_get_nbx.argtypes = [vp, vp, ctypes.c_size_t, u64, vp, vp]
        self.ucp.ucp_request_check_status.argtypes = [vp]
        self.ucp.ucp_request_free.argtypes = [vp]

    @property
    def version(self) -> str:
        return self.ucp.ucp_get_version_string().decode()

    def check(self, call: str, status: int) -> None:
        if status != UCS_OK:
            raise UcxError(call, status, self.ucs.ucs_status_string(status).decode())


class UcpWorker:
    """A UCP context (remote memory access only) and one worker, progressed by whoever calls it.
    Close it after its endpoints (``close`` closes what it opened, in reverse order)."""

    def __init__(self, ucp: Ucp | None = None) -> None:
        self.ucp = ucp = ucp or Ucp()
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        ucp.ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        params = _params(UCP_PARAM_FIELD_FEATURES, UCP_FEATURE_RMA)
        self._context = ctypes.c_void_p()
        ucp.check(
            "ucp_init", ucp.ucp.ucp_init_version(major, minor, params, None, ctypes.byref(self._context))
        )
        self._worker = ctypes.c_void_p()
        try:
            ucp.check(
                "ucp_worker_create",
                ucp.ucp.ucp_worker_create(self._context, _params(), ctypes.byref(self._worker)),
            )
        except UcxError:
            ucp.ucp.ucp_cleanup(self._context)
            raise
        self._endpoints: list[Endpoint] = []

    def connect(self, worker_address: bytes) -> Endpoint:
        """An endpoint to the worker at ``worker_address`` (UCX's address bytes, e.g. from agent metadata)."""
        ep = Endpoint(self, worker_address)
        self._endpoints.append(ep)
        return ep

    def wait(
        self, call: str, request: int | None, timeout_s: float, on_timeout: Callable[[], None] | None = None
    ) -> None:
        """Progress until ``request`` (a UCP status pointer) completes and raise its failure. After
        ``timeout_s``, ``on_timeout`` must make it end (a forced close fails an endpoint's requests); the
        request is released only once it has ended, so a late GET never writes into a buffer given up."""
        if request is None:
            return  # completed in place
        if request >= _ERR_PTR_FLOOR:
            self.ucp.check(call, request - (1 << 64))
        deadline = time.monotonic() + timeout_s
        ucp = self.ucp.ucp
        timed_out = False
        while (status := ucp.ucp_request_check_status(request)) == UCS_INPROGRESS:
            if not timed_out and time.monotonic() > deadline:
                timed_out = True
                if on_timeout is None:
                    raise UcxError(call, UCS_INPROGRESS, f"not complete after {timeout_s:g} s")
                on_timeout()
            ucp.ucp_worker_progress(self._worker)
        ucp.ucp_request_free(request)
        if timed_out:
            raise UcxError(call, status, f"not complete after {timeout_s:g} s; its endpoint was closed")
        self.ucp.check(call, status)

    def close(self) -> None:
        for ep in reversed(self._endpoints):
            ep.close()
        self._endpoints.clear()
        if self._worker:
            self.ucp.ucp.ucp_worker_destroy(self._worker)
            self._worker = ctypes.c_void_p()
        if self._context:
            self.ucp.ucp.ucp_cleanup(self._context)
            self._context = ctypes.c_void_p()

    def __enter__(self) -> UcpWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Endpoint:
    """One endpoint to a remote worker, and the remote keys unpacked on it."""

    def __init__(self, worker: UcpWorker, worker_address: bytes) -> None:
        self._worker = worker
        self._address = ctypes.create_string_buffer(worker_address, len(worker_address))  # kept alive
        self._ep = ctypes.c_void_p()
        fields = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        params = _params(fields, ctypes.addressof(self._address), UCP_ERR_HANDLING_MODE_PEER)
        status = worker.ucp.ucp.ucp_ep_create(worker._worker, params, ctypes.byref(self._ep))
        worker.ucp.check("ucp_ep_create", status)
        self._keys: list[RemoteKey] = []
        self._closing: int | None = None  # the forced close's request, until ``close`` has waited for it

    def unpack(self, packed_key: bytes) -> RemoteKey:
        """A region's packed key (``ucp_rkey_pack``'s bytes, e.g. ``nixl_metadata.Region.key``). On a GPU, the
        device's CUDA context must be current: cuda_ipc opens the memory handle here."""
        buf = ctypes.create_string_buffer(packed_key, len(packed_key))
        handle = ctypes.c_void_p()
        self._worker.ucp.check(
            "ucp_ep_rkey_unpack", self._worker.ucp.ucp.ucp_ep_rkey_unpack(self._ep, buf, ctypes.byref(handle))
        )
        key = RemoteKey(self._worker.ucp, handle)
        self._keys.append(key)
        return key

    def get(
        self, key: RemoteKey, remote_addr: int, local_ptr: int, nbytes: int, timeout_s: float = 10.0
    ) -> None:
        """Read ``nbytes`` at ``remote_addr`` into this process's memory at ``local_ptr`` (host memory: UCX
        finds the memory type itself), and wait for it. Not done within ``timeout_s`` (a stalled peer), the
        endpoint is closed, which ends the read; the endpoint is unusable after that."""
        if not self._ep:
            raise UcxError("ucp_get_nbx", -1, "the endpoint is closed")
        ucp = self._worker.ucp.ucp
        request = ucp.ucp_get_nbx(self._ep, local_ptr, nbytes, remote_addr, key._handle, _params())
        self._worker.wait("ucp_get_nbx", request, timeout_s, on_timeout=self._force_close)

    def close(self, timeout_s: float = 5.0) -> None:
        """Destroy its keys (which unmaps what they mapped), then close the endpoint without flushing: it
        only ever reads, and a dead peer must not hold us up."""
        for key in reversed(self._keys):
            key.close()
        self._keys.clear()
        self._force_close()
        closing, self._closing = self._closing, None
        self._worker.wait("ucp_ep_close_nbx", closing, timeout_s)

    def _force_close(self) -> None:
        """Close the endpoint at once: its outstanding requests fail (``close`` waits for the close)."""
        if self._ep:
            flags = (UCP_EP_CLOSE_FLAG_FORCE << 32) | UCP_OP_ATTR_FIELD_FLAGS
            self._closing = self._worker.ucp.ucp.ucp_ep_close_nbx(self._ep, _params(flags))
            self._ep = ctypes.c_void_p()


class RemoteKey:
    """An unpacked remote key. ``ptr`` maps the remote memory where a transport can (cuda_ipc on NVIDIA);
    the mapping lives as long as the key."""

    def __init__(self, ucp: Ucp, handle: ctypes.c_void_p) -> None:
        self._ucp = ucp
        self._handle = handle

    def ptr(self, remote_addr: int) -> int:
        """This process's address of the remote byte at ``remote_addr``; ``UcxError`` (status
        ``UCS_ERR_UNREACHABLE``) where no transport maps it, as for host memory without xpmem."""
        out = ctypes.c_void_p()
        self._ucp.check(
            "ucp_rkey_ptr", self._ucp.ucp.ucp_rkey_ptr(self._handle, remote_addr, ctypes.byref(out))
        )
        return int(out.value or 0)

    def close(self) -> None:
        if self._handle:
            self._ucp.ucp.ucp_rkey_destroy(self._handle)
            self._handle = ctypes.c_void_p()


def _params(*words: int) -> ctypes.Array:
    """A zeroed parameter struct with ``words`` as its first 64-bit words (the field mask first)."""
    buf = (ctypes.c_uint64 * _PARAMS_WORDS)()
    for i, word in enumerate(words):
        buf[i] = word
    return buf


def _one(libdir: str, pattern: str) -> str:
    found = sorted(glob.glob(os.path.join(libdir, pattern)))
    if not found:
        raise UcxError("load", -1, f"no {pattern} in {libdir}")
    return found[0]
