"""The mapped read mode on a GPU: the daemon maps the prefill emulator's VRAM through UCX (cuda_ipc) and its
conversion kernel reads the pages straight from there, with no NIXL READ and no staging.

Three real processes as in ``test_gpu_slice.py`` (whose emulator and helpers this reuses): every pulled block
bit-exact against the CPU reference, one notification per request, and every block of the decoder's planes
that no request was given still holds its canary. The daemon's metrics say every pull was mapped.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from sidecar.bench.e2e_roles import DeviceStandin, start_daemon
from sidecar.bench.ucx_logs import ucx_env
from tests.gpu.test_gpu_slice import (
    DEVICE,
    GPU,
    LAYERS,
    REMOTE,
    REQUESTS,
    SHAPE,
    _free_port,
    emulator,
    pull_round,
    work,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
__all__ = ["emulator", "work"]  # fixtures, used by name

CANARY = 0x5A5A


def _metrics(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(rf'^{name}\{{\w+="(\w+)"\}} (\S+)$', text, re.M)
    return {label: float(value) for label, value in found}


def test_mapped_pulls_convert_from_the_prefills_vram_and_touch_nothing_else(work, emulator) -> None:
    name = "daemon-mapped"
    metrics_port = _free_port()
    daemon = start_daemon(
        work,
        name,
        remote_fmt=REMOTE,
        gpu=GPU,
        mode="mapped",
        staging_bytes=0,
        env=ucx_env(work, name, "info", cuda=True),
        log_path=work / f"{name}.log",
        settings={"metrics_port": str(metrics_port)},
    )
    try:
        standin = DeviceStandin(
            daemon.socket,
            SHAPE,
            device=DEVICE,
            compat_factors=dict(emulator.ready.compat_factors),
            pull_timeout_s=120.0,
        )
        try:
            assert standin.register(), standin.worker.client.status_reason
            for layer in range(LAYERS):
                standin.k_plane(layer).view(torch.int16).fill_(CANARY)
                standin.v_plane(layer).view(torch.int16).fill_(CANARY)
            used: set[int] = set()
            real_allocate = standin.allocate

            def allocate(n: int) -> list[int]:
                ids = real_allocate(n)
                used.update(ids)
                return ids

            standin.allocate = allocate
            for i, seed in enumerate((11, 12)):
                pull_round(standin, emulator, f"{name}-{i}", seed=seed)
            torch.cuda.synchronize()
            others = torch.tensor(sorted(set(range(SHAPE.num_blocks)) - used), device=DEVICE)
            assert others.numel() > 0
            for layer in range(LAYERS):
                for plane in (standin.k_plane(layer), standin.v_plane(layer)):
                    assert bool((plane.view(torch.int16).index_select(0, others) == CANARY).all()), layer
            modes = _metrics(metrics_port, "kv_sidecar_read_modes_total")
            assert modes["mapped"] == 2 * REQUESTS and modes["direct"] == 0, modes
            assert _metrics(metrics_port, "kv_sidecar_peer_mappings_total") == {
                "mapped": 1.0,
                "unavailable": 0.0,
            }
            launches = _metrics(metrics_port, "kv_sidecar_conversion_launches_total")
            assert launches["graph"] > 0, launches  # out of place: replayed from CUDA graphs
        finally:
            standin.close()
    finally:
        daemon.stop()
