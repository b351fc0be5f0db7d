"""Sharing the decoder's GPU: an MPS control daemon for a benchmark, a CU-masked stream on ROCm, and the
line the daemon logs at start saying how its conversions share the GPU.

MPS (NVIDIA): without it, kernels of two processes time-slice; with it they run side by side and
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps a client's share of the SMs. ``MpsControl`` starts the control
daemon as an ordinary user process with its pipe and log directories in a temporary directory, and always
quits it (context exit, error, or ``atexit``). It never touches the GPU's own settings (compute mode etc.).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from sidecar.convert.launch import ConversionLimits

MPS_CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """The MPS control daemon could not be started (or quit)."""


class MpsControl:
    """A private MPS control daemon: ``env()`` is what a client process needs to use it."""

    def __init__(self, command: Sequence[str] = (MPS_CONTROL,), root: str | None = None,
                 timeout_s: float = 10.0) -> None:
        self.command = list(command)
        self.root = root
        self.timeout_s = timeout_s
        self.running = False
        self._made_root = False

    def env(self, active_thread_percentage: int | None = None) -> dict[str, str]:
        """Variables for a client; with a percentage, that client's cap on the SMs it may use."""
        assert self.root is not None
        out = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.root, "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.root, "log")}
        if active_thread_percentage is not None:
            if not 0 < active_thread_percentage <= 100:
                raise ValueError(
                    f"active_thread_percentage must be in (0, 100], got {active_thread_percentage}")
            out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(active_thread_percentage))
        return out

    def start(self) -> MpsControl:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="kv-sidecar-mps-")
            self._made_root = True
        for sub in ("pipe", "log"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        env = {**os.environ, **self.env()}
        atexit.register(self.quit)  # first, so a failed start still tries to quit
        try:
            r = subprocess.run([*self.command, "-d"], env=env, capture_output=True, text=True,
                               timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.running = True  # it may have started before the timeout: quit must try
            self.quit()
            raise MpsError(f"{self.command[0]} -d: {exc}") from exc
        self.running = True
        if r.returncode != 0:
            self.quit()
            raise MpsError(f"{self.command[0]} -d exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
        return self

    def quit(self) -> bool:
        """Send ``quit`` to the control daemon (idempotent); True if it was asked to quit."""
        if not self.running:
            return False
        self.running = False
        with contextlib.suppress(ValueError):
            atexit.unregister(self.quit)
        env = {**os.environ, **self.env()}
        ok = False
        try:
            r = subprocess.run(self.command, input="quit\n", env=env, capture_output=True, text=True,
                               timeout=self.timeout_s, check=False)
            ok = r.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if self._made_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        return ok

    def __enter__(self) -> MpsControl:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.quit()


def mps_available(command: str = MPS_CONTROL) -> bool:
    return shutil.which(command) is not None


def cu_mask_words(total_cus: int, share: float) -> list[int]:
    """The CU mask (32-bit words, CU i = bit i % 32 of word i // 32) enabling the first ``share`` of the
    CUs, at least one."""
    if total_cus <= 0 or not 0 < share <= 1:
        raise ValueError(f"need total_cus > 0 and 0 < share <= 1, got {total_cus}, {share}")
    n = max(1, int(total_cus * share))
    words = [0] * (-(-total_cus // 32))
    for i in range(n):
        words[i // 32] |= 1 << (i % 32)
    return words


def cu_masked_stream(device: int, share: float) -> Any:  # pragma: no cover - ROCm only, unverified
    """ROCm: a stream whose kernels run only on the first ``share`` of the CUs
    (``hipExtStreamCreateWithCUMask``), wrapped for torch. UNVERIFIED: written without an AMD GPU."""
    import torch

    if torch.version.hip is None:
        raise RuntimeError("a CU-masked stream needs a ROCm build of torch")
    lib = ctypes.CDLL("libamdhip64.so")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    words = cu_mask_words(total, share)
    arr = (ctypes.c_uint32 * len(words))(*words)
    stream = ctypes.c_void_p()
    with torch.cuda.device(device):
        err = lib.hipExtStreamCreateWithCUMask(ctypes.byref(stream), ctypes.c_uint32(len(words)), arr)
    if err != 0:
        raise RuntimeError(f"hipExtStreamCreateWithCUMask failed: hipError {err}")
    return torch.cuda.ExternalStream(stream.value, device=device)


def mode_line(limits: ConversionLimits | None, *, gpu: int | None, platform: str | None = None,
              environ: dict[str, str] | None = None) -> str:
    """What the daemon logs at start: where conversions run and how they share the decoder's GPU.
    ``platform``: "cuda", "rocm" or None (CPU); ``environ``: the process environment (MPS variables)."""
    env = os.environ if environ is None else environ
    if gpu is None:
        return "conversions: CPU twin (in a worker thread; no GPU shared)"
    parts = [f"conversions: GPU {gpu} ({platform or 'cuda'})"]
    if platform == "rocm":
        parts.append("kernels of the decoder and the daemon run side by side (shared CUs)")
    elif env.get("CUDA_MPS_PIPE_DIRECTORY") or env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        pct = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        parts.append(f"MPS client, active thread percentage {pct}%" if pct else "MPS client, no SM cap")
    else:
        parts.append("no MPS: the decoder's and the daemon's kernels time-slice")
    lim = limits or ConversionLimits()
    if lim.unbounded:
        parts.append("unbounded (one launch per layer group, the kernel's own grid)")
    else:
        if lim.max_slice_pairs:
            parts.append(f"slices of <= {lim.max_slice_pairs} (layer, block) pairs")
        if lim.slice_gap_us:
            parts.append(f"paced {lim.slice_gap_us:g} us between slices")
        if lim.max_ctas:
            parts.append(f"grid capped at {lim.max_ctas} programs")
    parts.append("low-priority stream" if lim.low_priority else "default-priority stream")
    return "; ".join(parts)
