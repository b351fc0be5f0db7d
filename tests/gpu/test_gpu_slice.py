"""The vertical slice on a GPU: prefill pages in VRAM, the decoder's planes in VRAM exported by CUDA IPC, the
daemon (``kv-sidecar serve --gpu 0``) registering them with NIXL and converting on its own stream.

Three real processes: the prefill emulator (``--device cuda:0``), the daemon, and this test as the decoder
stand-in driving the vLLM shim's worker half. Every converted block is checked bit for bit against the torch
reference on the CPU applied to the emulator's expected pages; every request frees the prefill's blocks by
its one notification. Per-stage timings (and the transports UCX logged) go to ``$KV_SIDECAR_BENCH_OUT`` as
JSON when that variable is set.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import random
import re
import socket
import time
import urllib.request

import pytest
import torch

from sidecar.bench.e2e_report import quantiles
from sidecar.bench.e2e_roles import DeviceStandin, start_daemon
from sidecar.bench.ucx_logs import summarize_ucx_logs, ucx_env
from sidecar.standins.decoder import StandinShape, expected_planes
from sidecar.standins.emulator_control import spawn_emulator
from sidecar.wire.formats import STANDARD, PageFormat
from vllm_glue.orders import PullOrder, parse_remote

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

DEVICE, GPU = "cuda:0", 0
LAYERS, HEADS, HEAD_SIZE, BLOCK = 4, 8, 128, 16  # Qwen3-8B's KV heads and head size, fewer layers
SEED, REQUESTS, MAX_TOKENS = 5, 24, 600
SHAPE = StandinShape(layers=LAYERS, heads=HEADS, head_size=HEAD_SIZE, block_size=BLOCK, num_blocks=1024)
REMOTE = PageFormat(
    kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=HEADS, block_size=BLOCK, head_size=HEAD_SIZE
)
STAGING = LAYERS * REQUESTS * (-(-MAX_TOKENS // BLOCK)) * REMOTE.page_bytes  # every request at once
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("gpu-slice")


@pytest.fixture(scope="module")
def emulator(work):
    args = [
        *("--device", DEVICE, "--layers", str(LAYERS), "--heads", str(HEADS), "--head-size", str(HEAD_SIZE)),
        *("--block-size", str(BLOCK), "--num-blocks", "2048", "--seed", str(SEED), "--lease", "600"),
        *("--control", f"ipc://{work}/emu.sock"),
    ]  # the lease the daemons assume (start_daemon: lease_s = 600)
    emu = spawn_emulator(args, 180.0, ucx_env(work, "prefill", "info", cuda=True))
    yield emu
    emu.stop()


@pytest.fixture(scope="module", autouse=True)
def bench_out():
    """Write what the tests measured to $KV_SIDECAR_BENCH_OUT (one JSON object, both modes) at the end."""
    yield
    path = os.environ.get("KV_SIDECAR_BENCH_OUT")
    if not path or not RESULTS:
        return
    report = {
        "bench": "gpu-slice",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(GPU),
        "torch": torch.__version__,
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("UCX_CUDA")},
        "shape": {
            "layers": LAYERS,
            "heads": HEADS,
            "head_size": HEAD_SIZE,
            "block_size": BLOCK,
            "dtype": "bfloat16",
            "page_bytes": REMOTE.page_bytes,
        },
        "requests_per_mode": REQUESTS,
        "tokens": [1, MAX_TOKENS],
        "modes": RESULTS,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def mismatches(standin: DeviceStandin, reply, local: list[int]) -> list[str]:
    """Blocks whose VRAM bytes differ from the CPU reference conversion of the emulator's expected pages."""
    ids = torch.tensor(local, dtype=torch.long, device=DEVICE)
    bad = []
    for layer in range(LAYERS):
        k_want, v_want = expected_planes(reply, SEED, REMOTE, layer, len(local))
        for name, plane, want in (
            ("K", standin.k_plane(layer), k_want),
            ("V", standin.v_plane(layer), v_want),
        ):
            got = plane.index_select(0, ids).contiguous().view(torch.uint8).cpu().numpy()
            bad += [
                f"layer {layer} block {b} {name}" for i, b in enumerate(local) if (got[i] != want[i]).any()
            ]
    return bad


def pull_round(standin: DeviceStandin, emulator, name: str, seed: int) -> dict:
    """REQUESTS prefilled requests pulled in one engine step; all bit-exact and freed; their timings."""
    rng = random.Random(seed)
    replies = [emulator.client.new_request(num_tokens=rng.randint(1, MAX_TOKENS)) for _ in range(REQUESTS)]
    local = [standin.allocate(len(r.kernel_block_ids)) for r in replies]
    orders = [
        PullOrder(f"{name}-{i}", parse_remote(r.kv_transfer_params), lo, True, time.monotonic_ns())
        for i, (r, lo) in enumerate(zip(replies, local, strict=True))
    ]
    t0 = time.monotonic()
    standin.pull(orders)
    got = standin.wait({o.req_id for o in orders}, 180.0)
    assert len(got) == REQUESTS, sorted({o.req_id for o in orders} - got.keys())
    failed = [f"{o.req_id}: {o.reason}" for o in got.values() if not o.ok]
    assert not failed, failed
    wall = max(o.received_at for o in got.values()) - t0
    torch.cuda.synchronize()
    for r, lo in zip(replies, local, strict=True):
        assert mismatches(standin, r, lo) == [], r.kv_transfer_params["remote_request_id"]
    for r in replies:  # the prefill got exactly one notification per request and freed its blocks
        st = emulator.client.wait_state(r.kv_transfer_params["remote_request_id"], "freed_by_notif", 10.0)
        assert st.notif_counts == [1] and st.late_notifications == 0
    for lo in local:
        standin.release(lo)
    stages: dict[str, list[float]] = {}
    for o in got.values():
        for k, v in o.timings.items():
            stages.setdefault(k, []).append(v)
    assert {"queue", "handshake", "transfer", "convert", "end_to_end"} <= set(stages)
    round_trips = [standin.round_trip_s(o) for o in got.values()]
    nbytes = sum(len(lo) for lo in local) * LAYERS * REMOTE.page_bytes
    return {
        "requests": REQUESTS,
        "bytes": nbytes,
        "wall_s": wall,
        "GBps": nbytes / wall / 1e9,
        "stages_ms": {k: quantiles(v) for k, v in sorted(stages.items())},
        "shim_round_trip_ms": quantiles([t for t in round_trips if t is not None]),
        "bit_exact": True,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launches(port: int) -> dict[str, float]:
    """The daemon's conversion launches by path, from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(r'^kv_sidecar_conversion_launches_total\{path="(\w+)"\} (\S+)$', text, re.M)
    return {path: float(value) for path, value in found}


@pytest.mark.parametrize("groups", [0, LAYERS], ids=["groups-auto", "group-per-layer"])
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_slice_on_one_gpu_is_bit_exact(mode: str, groups: int, work, emulator) -> None:
    """With one layer group per layer too: each group converts once it landed, while later ones read."""
    launches = _slice(mode, groups, work, emulator)
    # replayed from CUDA graphs (config conversion_graphs, on by default) once a size was seen: staged out
    # of place, direct in place
    assert launches["graph"] > 0, launches


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_slice_with_conversion_gates_is_bit_exact(mode: str, work, emulator) -> None:
    """Gates on (config conversion_gates): once a size was seen, each group's launch is queued while it
    reads and only let run when it landed, staged (out of place) and direct (in place). The direct cell once
    hung here: a graph was instantiated while a gate held work (three runs of three, an H100, 2026-12-06)."""
    launches = _slice(mode, LAYERS, work, emulator, gates=True)
    assert launches["gated"] > 0, launches


def _slice(mode: str, groups: int, work, emulator, gates: bool = False) -> dict[str, float]:
    """Cold and warm pull rounds through one daemon; its launches by path."""
    name = f"daemon-{mode}-groups-{groups or 'auto'}" + ("-gates" if gates else "")
    env = ucx_env(work, name, "info", cuda=True)
    metrics_port = _free_port()
    daemon = start_daemon(
        work,
        name,
        remote_fmt=REMOTE,
        gpu=GPU,
        mode=mode,
        staging_bytes=STAGING,
        env=env,
        log_path=work / f"{name}.log",
        settings={"layer_groups": str(groups), "metrics_port": str(metrics_port),
                  "conversion_gates": "true" if gates else "false"},
    )
    rounds = {}
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
            assert [b.kind for b in standin.worker.exported.buffers] in (["cuda"], ["hip"])  # by CUDA IPC
            # cold: the first requests pay the handshake, NIXL's list preparation and the kernel's JIT
            rounds["cold"] = pull_round(standin, emulator, f"{name}-cold", seed=7)
            rounds["warm"] = pull_round(standin, emulator, f"{name}-warm", seed=8)
            launches = _launches(metrics_port)
            rounds["launches"] = launches
        finally:
            standin.close()
    finally:
        daemon.stop()  # UCX flushes its log when the daemon exits
    logs = sorted(glob.glob(str(work / f"ucx-{name}-*.log")))
    RESULTS[name.removeprefix("daemon-")] = {**rounds, "transports": summarize_ucx_logs(logs)}
    return launches
