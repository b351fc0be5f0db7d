"""``kv-sidecar verify`` on a GPU (CUDA, or ROCm where AITER's own kernel joins the readers). Marked ``gpu``;
skipped cleanly without one. Run: python -m pytest -m gpu tests/sidecar/verify"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sidecar.verify import golden, main, readers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
DEV = "cuda:0"


def test_every_reader_this_gpu_runs_is_chosen():
    chosen, rows = main.pick_readers(DEV)
    assert not rows, rows  # Triton (and AITER on ROCm) importable
    assert set(chosen) == ({"torch", "triton", "aiter"} if torch.version.hip else {"torch", "triton"})


def test_whole_grid_on_gpu_with_every_reader():
    chosen, _ = main.pick_readers(DEV)
    results = golden.run_grid(golden.GOLDEN_GRID, torch.device(DEV), chosen)
    bad = [(r.shape.label, r.mode, r.bytes_ok, r.readers) for r in results if not r.ok]
    assert not bad
    assert all(len(r.readers) == len(chosen) for r in results)


def test_triton_reader_catches_a_wrong_layout_on_gpu():
    from sidecar.verify.triton_reader import decode_triton

    def swap_heads(k_planes, v_planes, ids, fmt, src):
        golden.daemon_converter(k_planes, v_planes, ids, fmt, src)
        half = fmt.block_size * fmt.head_size  # one head's run inside a plane-block
        t = torch.from_numpy(ids).to(k_planes[0].device)
        for kp in k_planes:
            blocks = kp[t]
            kp[t] = torch.cat([blocks[:, half:2 * half], blocks[:, :half], blocks[:, 2 * half:]], dim=1)

    shape = golden.Shape(16, 128, 4, "bfloat16", 2)
    r = golden.run_shape(shape, torch.device(DEV), {"triton": decode_triton}, convert=swap_heads,
                         check_bytes=False)
    assert not r.attention_ok
    assert r.readers[0].max_error > 10 * golden.tolerance("aiter", "bfloat16")


def test_triton_and_torch_readers_agree_with_the_cpu_reader():
    from sidecar.verify.triton_reader import decode_triton

    shape = golden.Shape(32, 256, 3, "float16", 4)
    case = golden.make_case(shape, torch.device(DEV))
    golden.land_halves(case)
    golden.daemon_converter(case.k_planes(), case.v_planes(), case.ids,
                            shape.page_format("aiter_shuffled", "LHBNC"), None)
    args = (case.queries[1], *readers.shuffled_views(*case.sides(1), 3, 256), case.block_tables,
            case.context_lens, 256 ** -0.5)
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    ref = readers.decode_torch(*cpu_args)
    torch.testing.assert_close(decode_triton(*args).cpu(), ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(readers.decode_torch(*args).cpu(), ref, rtol=0, atol=1e-4)


def test_cli_on_cuda_passes_with_probes():
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "sidecar.cli", "verify", "--device", "cuda", "--json", "-"]  # no rich needed
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(r.stderr[-4000:])
    obj = json.loads(r.stdout)
    assert r.returncode == 0, [c for c in obj["checks"] if c["status"] == "fail"]
    rows = {c["name"]: c for c in obj["checks"]}
    assert sum(n.startswith("golden ") for n in rows) == len(golden.GOLDEN_GRID)
    assert rows["ipc"]["status"] == "pass"
    assert rows["nixl"]["status"] in ("pass", "skip")  # skip only where nixl is not installed
    assert obj["platform"].startswith("ROCm" if torch.version.hip else "CUDA")
