"""The Triton kernels' out-of-place forms (plain and persistent, with and without a source index) run in
Triton's CPU interpreter (``TRITON_INTERPRET=1``) against the writer truth of conftest: a check of the kernel
logic where Triton is installed but no GPU is (a GPU runs tests/sidecar/convert/test_convert_src_index.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (the CPU torch wheel has none)",
)

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import importlib.util, sys
import numpy as np, torch
spec = importlib.util.spec_from_file_location("cf", sys.argv[1])
cf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cf)
from sidecar.convert import PlaneSet
from sidecar.convert import triton_kernel as tk
from sidecar.convert.checks import check_request
from sidecar.convert.tuning import Tuning

rng = np.random.default_rng(0)
done = 0
tunings = [tk.TUNING]
if sys.argv[2] == "1":
    tunings.append(Tuning(oop_max_programs=3))
for h, n, d in [(2, 16, 64), (3, 16, 128), (1, 32, 64)]:
    for tuning in tunings:
        for indexed in (False, True):
            ids = cf.distinct_ids(rng, 7, 4)
            case = cf.make_case(2, 7, ids, h, n, d, 1, seed=h + d)
            layers, m, page = case.src.shape
            if indexed:  # the pages at random rows of a wider, junk-filled span
                span = rng.integers(-32768, 32768, size=(layers, 6, page), dtype=np.int64).astype(np.int16)
                rows = rng.permutation(6)[:m]
                span[:, rows] = case.src
                src = torch.from_numpy(span).view(torch.bfloat16)
                index = torch.from_numpy(rows.astype(np.int64))
            else:
                src, index = torch.from_numpy(case.src).view(torch.bfloat16), None
            ks, vs = cf.planes(case.before_k, torch.bfloat16), cf.planes(case.before_v, torch.bfloat16)
            ps = PlaneSet(ks, vs, num_heads=h, block_size=n, head_size=d)
            job = check_request(ps.planes, torch.from_numpy(case.ids), src, src_index=index)
            launcher = tk.Launcher(job, tuning)
            assert launcher.strategy == "out_of_place"
            launcher()
            what = (h, n, d, tuning.oop_max_programs, indexed)
            assert np.array_equal(cf.bits(ks), case.want_k), ("K", what)
            assert np.array_equal(cf.bits(vs), case.want_v), ("V", what)
            done += 1
print("converted", done)
"""


def _interpreter_loops_over_program_ids() -> bool:
    """Triton 3.6's interpreter cannot take a program id as a ``range`` bound (the persistent form's loop:
    "only 0-dimensional arrays can be converted to Python scalars"); 3.9's can. The compiled persistent
    kernel is checked on a GPU either way (test_convert_triton.py, test_convert_src_index.py)."""
    from sidecar.convert.triton_kernel import _triton_version

    return _triton_version() >= (3, 9)


def test_out_of_place_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    persistent = _interpreter_loops_over_program_ids()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "tests/sidecar/convert/conftest.py"), str(int(persistent))],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    want = 12 if persistent else 6
    assert proc.returncode == 0 and f"converted {want}" in proc.stdout, proc.stdout + proc.stderr[-3000:]
