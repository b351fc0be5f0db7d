"""``{gpu}`` in ``sidecar_socket``: the physical index of the worker's GPU, without vLLM or torch.

``kv-sidecar serve --gpu N`` opens ``cuda:N`` in the daemon's own process, and the shipped units run the
daemon without ``CUDA_VISIBLE_DEVICES`` or its ROCm cousins, so N counts every GPU of the host (or of the
pod's claim). A vLLM worker may see fewer, renumbered from 0. vLLM 0.33 gives a worker ``cuda:<visible
index>`` (``gpu_worker.init_device``: its local rank, plus ``dp_local_rank * world_size`` under data
parallelism on one host, mapped through ``--device-ids``) and leaves the visibility variables as the user set
them; its ``Platform.visible_device_id_to_physical_device_id`` undoes them for one index. :func:`physical_gpu`
does the same, also for ROCm's two layers, and refuses what it cannot map for certain: a UUID or MIG id, a
list it cannot read, a worker without a GPU. A guess could connect the worker to another GPU's daemon. (Both
sides count in CUDA's device order: on a host mixing GPU models give them the same ``CUDA_DEVICE_ORDER``.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

_INDEX = re.compile(r"0|[1-9][0-9]*")  # as ROCclr reads one: no sign, space or leading 0
_HINT = "use {rank}, or name each worker's socket yourself"


class GpuUnresolved(ValueError):
    """The worker's physical GPU index cannot be known for certain; the message says why."""


def physical_gpu(env: Mapping[str, str], device: int | None, runtime: str) -> int:
    """The physical index of visible device ``device`` (the worker's ``torch.cuda.current_device()``).

    ``runtime`` is ``"cuda"`` or ``"rocm"``; anything else (``"cpu"``), or ``device`` None, has no GPU.

    CUDA: ``CUDA_VISIBLE_DEVICES`` lists physical indices in visible order; unset, visible is physical. Set
    but empty it hides every GPU (vLLM reads it as unset, for Ray's CPU-only engine processes; a worker that
    has a GPU there cannot say which).

    ROCm: ``ROCR_VISIBLE_DEVICES`` (the ROCr runtime) picks from the physical GPUs first; HIP then picks from
    those with ``HIP_VISIBLE_DEVICES``, or ``CUDA_VISIBLE_DEVICES`` when that is unset or empty. vLLM refuses
    the two set to different lists (``platforms/rocm.py``), and so does this.

    Every entry of a list up to the one picked must be a plain index (no sign, space or leading zero), each
    once; GpuUnresolved otherwise.
    """
    if runtime not in ("cuda", "rocm") or device is None:
        raise GpuUnresolved(f"this worker has no GPU (vLLM platform {runtime!r})")
    if device < 0:
        raise GpuUnresolved(f"the worker's device index {device} is not a GPU's")
    if runtime == "cuda":
        listed = env.get("CUDA_VISIBLE_DEVICES")
        if listed == "":
            raise GpuUnresolved("CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU")
        return device if listed is None else _pick("CUDA_VISIBLE_DEVICES", listed, device)
    hip, cuda = env.get("HIP_VISIBLE_DEVICES", ""), env.get("CUDA_VISIBLE_DEVICES", "")
    if hip and cuda and hip != cuda:
        raise GpuUnresolved(f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} differ")
    name, listed = ("HIP_VISIBLE_DEVICES", hip) if hip else ("CUDA_VISIBLE_DEVICES", cuda)
    index = _pick(name, listed, device) if listed else device
    rocr = env.get("ROCR_VISIBLE_DEVICES")
    if rocr is None:
        return index
    if rocr == "":
        raise GpuUnresolved("ROCR_VISIBLE_DEVICES is set but empty, which hides every GPU")
    return _pick("ROCR_VISIBLE_DEVICES", rocr, index)


def _pick(name: str, listed: str, position: int) -> int:
    """Entry ``position`` of the device list ``listed`` (variable ``name``), all entries up to it checked."""
    entries = listed.split(",")
    if position >= len(entries):
        raise GpuUnresolved(f"{name}={listed!r} has no entry {position}, the worker's device")
    seen: set[int] = set()
    for entry in entries[: position + 1]:
        if not _INDEX.fullmatch(entry):
            what = "a UUID or MIG id" if entry.upper().startswith(("GPU-", "MIG-")) else "not a plain index"
            raise GpuUnresolved(f"{name}={listed!r}: entry {entry!r} is {what}; only plain indices map")
        if int(entry) in seen:
            raise GpuUnresolved(f"{name}={listed!r} lists {entry} twice")
        seen.add(int(entry))
    return int(entries[position])


def fill_socket(template: str, *, rank: int, gpu: Callable[[], int]) -> str:
    """``sidecar_socket`` with ``{rank}`` and ``{gpu}`` replaced; ``gpu`` is called only for a ``{gpu}``.

    A ``{gpu}`` that cannot be resolved raises ValueError naming ``sidecar_socket`` and why, at start-up.
    """
    socket = template.replace("{rank}", str(rank))
    if "{gpu}" not in socket:
        return socket
    try:
        index = gpu()
    except GpuUnresolved as exc:
        raise ValueError(
            f"kv_connector_extra_config: sidecar_socket {template!r}: {{gpu}} cannot be resolved: {exc}; "
            f"{_HINT}"
        ) from None
    return socket.replace("{gpu}", str(index))
