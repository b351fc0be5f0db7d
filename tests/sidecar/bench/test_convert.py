"""``bench convert`` on the CPU at a tiny size: the reference against a copy, written as JSON; a shape the
device's memory cannot hold is skipped with a row that says so, and the others are still measured."""

from __future__ import annotations

import json

import pytest
import torch

from sidecar.bench import convert

SMALL = "L2-H2-N16-D64-T64"  # 2 layers, 4 blocks of 2 x 16 x 64: milliseconds on any CPU


def _run(tmp_path, *extra: str) -> tuple[int, list[dict]]:
    rc = convert.main(["--device", "cpu", "--reps", "1", "--warmup", "0", "--no-plot", "--tag", "t",
                       "--out-dir", str(tmp_path), *extra])
    (out,) = tmp_path.glob("convert-t-*.json")
    return rc, json.loads(out.read_text())


def test_a_cpu_run_writes_the_reference_against_a_copy(tmp_path):
    rc, rows = _run(tmp_path, "--shapes", SMALL)
    assert rc == 0
    (row,) = rows
    assert row["shape"] == SMALL and row["device"].startswith("CPU")
    assert row["copy_GBps"] > 0 and row["torch_ref_GBps"] > 0
    assert row["torch_ref_vs_copy"] == pytest.approx(row["torch_ref_GBps"] / row["copy_GBps"])


def test_a_shape_that_does_not_fit_is_skipped_and_the_others_are_kept(tmp_path, monkeypatch):
    measure = convert.measure

    def measure_or_oom(shape, *args, **kwargs):
        if shape.name == "L2-H2-N16-D64-T128":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 84.00 GiB.\nmore text")
        return measure(shape, *args, **kwargs)

    monkeypatch.setattr(convert, "measure", measure_or_oom)
    rc, rows = _run(tmp_path, "--shapes", f"L2-H2-N16-D64-T128,{SMALL}", "--check")
    assert [r["shape"] for r in rows] == ["L2-H2-N16-D64-T128", SMALL]
    skipped, kept = rows
    assert skipped["skipped"] == "out of device memory: CUDA out of memory. Tried to allocate 84.00 GiB."
    assert "copy_GBps" not in skipped and skipped["device"] == kept["device"]
    assert kept["copy_GBps"] > 0
    assert rc == 1  # --check: a shape not measured is a must-show not shown
    assert convert.must_show(rows, torch.device("cpu"))[0].startswith("L2-H2-N16-D64-T128: not measured")
