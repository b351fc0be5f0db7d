"""The processes a bench drives and the byte check it trusts: the decoder stand-in with its planes on a
device, ``kv-sidecar serve`` from a TOML file, and every converted block compared with the emulator's pages.

Shared by ``bench e2e``, ``bench interference`` and the GPU tests (``tests/gpu``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from sidecar.bench.e2e_common import parse_device
from sidecar.standins.decoder import DecoderStandin, StandinShape
from sidecar.wire.formats import PageFormat


class DeviceStandin(DecoderStandin):
    """The decoder stand-in with its planes where ``device`` says: /dev/shm on ``cpu`` (exactly the parent's),
    VRAM on ``cuda:N`` (one torch allocation, exported by CUDA IPC at registration)."""

    def __init__(self, socket: str, shape: StandinShape, *, device: str, **kw: Any) -> None:
        parse_device(device)  # refuse anything but cpu / cuda:N
        super().__init__(socket, shape, device=device, **kw)

    def plane_bases(self) -> tuple[list[int], list[int]]:
        """Byte addresses of each layer's K plane and V plane (block 0 of each)."""
        base, s = self.buffer.tensor.data_ptr(), self.shape
        plane = s.num_blocks * s.fmt.plane_block_bytes
        return [base + 2 * i * plane for i in range(s.layers)], [
            base + (2 * i + 1) * plane for i in range(s.layers)
        ]


def spread(n: int, k: int) -> list[int]:
    """``k`` indices spread over ``range(n)``, first and last included."""
    if k >= n:
        return list(range(n))
    if k <= 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def mismatched_planes(
    standin: DecoderStandin,
    kernel_block_ids: list[int],
    generations: list[int],
    local_ids: list[int],
    seed: int,
    remote_fmt: PageFormat,
    layers: Sequence[int],
) -> list[str]:
    """Every (layer, block, plane) of the decoder that differs from the torch reference conversion of the
    emulator's pages, computed on the planes' own device ([] when bit-exact)."""
    import torch

    from sidecar.convert.checks import check_job
    from sidecar.convert.reference import run_reference
    from sidecar.standins.emulator_pages import expected_pages_torch
    from sidecar.wire.ipc import torch_dtype

    dev = standin.buffer.tensor.device
    count = len(local_ids)
    kb, gens = kernel_block_ids[len(kernel_block_ids) - count :], generations[len(generations) - count :]
    dtype = torch_dtype(remote_fmt.dtype)
    half = remote_fmt.plane_block_bytes // remote_fmt.elem_bytes
    ids = torch.tensor(local_ids, dtype=torch.long)
    bad: list[str] = []
    for layer in layers:
        pages = expected_pages_torch(seed, layer, kb, gens, remote_fmt, device=str(dev)).view(dtype)
        want_k = torch.zeros((count, half), dtype=dtype, device=dev)
        want_v = torch.zeros((count, half), dtype=dtype, device=dev)
        job = check_job(
            [want_k],
            [want_v],
            torch.arange(count),
            num_heads=remote_fmt.num_heads,
            block_size=remote_fmt.block_size,
            head_size=remote_fmt.head_size,
            srcs=[pages],
        )
        run_reference(job)
        for name, plane, want in (
            ("K", standin.k_plane(layer), want_k),
            ("V", standin.v_plane(layer), want_v),
        ):
            got = plane.index_select(0, ids.to(dev)).view(torch.int16)
            rows = (got != want.view(torch.int16)).any(dim=1).nonzero().flatten().tolist()
            bad += [f"layer {layer} block {local_ids[r]} {name} plane" for r in rows]
    return bad


# ------------------------------------------------------------------------------------------------ processes


def toml_format(f: PageFormat) -> str:
    return (
        f'{{kind = "{f.kind}", layout = "{f.layout}", dtype = "{f.dtype}", num_heads = {f.num_heads}, '
        f"block_size = {f.block_size}, head_size = {f.head_size}}}"
    )


def start_daemon(
    work: Path,
    name: str,
    *,
    remote_fmt: PageFormat,
    gpu: int | None,
    mode: str,
    staging_bytes: int,
    env: dict[str, str],
    log_path: Path,
    settings: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Any:
    """``kv-sidecar serve`` for one pull mode, configured by a TOML file (``settings``: more keys, raw TOML
    values, overriding these); returns the ServeProcess."""
    from sidecar.cli import spawn_serve
    from sidecar.ops.config import ENV_NOT_KEYS, Config

    keys = {
        "socket": f'"ipc://{work}/{name}.sock"',
        "metrics_port": "-1",
        "log_level": '"INFO"',
        "pull_mode": f'"{mode}"',
        "staging_bytes": str(staging_bytes if mode == "staged" else 0),
        "lease_s": "600.0",
    }
    if gpu is not None:
        keys["gpu"] = str(gpu)
    keys.update(settings or {})
    lines = [f"{k} = {v}" for k, v in keys.items()]
    lines += ["", "[[remotes]]", 'match = "127.0.0.1:*"', f"page_format = {toml_format(remote_fmt)}"]
    path = work / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    # The daemon reads every KV_SIDECAR_* variable as a config key and refuses unknown ones (such as
    # KV_SIDECAR_BENCH_OUT, which the GPU slice test reads): keep those out of its environment.
    config_vars = {f"KV_SIDECAR_{f.name.upper()}" for f in msgspec.structs.fields(Config)} | ENV_NOT_KEYS
    foreign = [k for k in os.environ if k.startswith("KV_SIDECAR_") and k not in config_vars]
    hidden = {k: os.environ.pop(k) for k in foreign}
    try:
        with open(log_path, "ab") as log:
            return spawn_serve(["--config", str(path)], timeout_s=timeout_s, env=env, stderr=log)
    finally:
        os.environ.update(hidden)


