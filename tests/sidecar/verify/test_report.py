"""The output format of ``kv-sidecar verify`` is fixed: JSON keys, table columns, the support-matrix row."""

from __future__ import annotations

import json

import msgspec

from sidecar.verify import report

VERSIONS = {"kv-sidecar": "0.1.0", "torch": "2.13.0", "nixl": "1.5.1", "aiter": None, "vllm": None}


def checks(golden_fail: bool = False) -> list[report.Check]:
    return [
        report.Check("golden N=16 D=64 H=3 bfloat16 gqa=4", "fail" if golden_fail else "pass", "x",
                     {"readers": ["torch", "triton"]}),
        report.Check("golden N=32 D=64 H=3 bfloat16 gqa=4", "pass", "x", {"readers": ["torch", "triton"]}),
        report.Check("ipc", "pass", "x"),
        report.Check("nixl", "pass", "x"),
        report.Check("ucx transport", "pass", "x", {"transports": ["cma", "tcp"]}),
        report.Check("vllm", "skip", "not importable"),
    ]


def test_json_keys_are_fixed():
    rep = report.make_report("cuda:0", "CUDA 13.0 (NVIDIA H200)", VERSIONS, checks())
    obj = json.loads(report.to_json(rep))
    assert tuple(obj) == report.JSON_KEYS == ("ok", "device", "platform", "versions", "support_row", "checks")
    assert all(tuple(c) == report.CHECK_KEYS == ("name", "status", "detail", "data") for c in obj["checks"])
    assert obj["ok"] is True and obj["device"] == "cuda:0"
    assert msgspec.json.decode(report.to_json(rep), type=report.Report) == rep  # round-trips


def test_any_fail_fails_the_report_and_skips_do_not():
    assert report.make_report("cpu", "CPU", VERSIONS, checks()).ok
    assert not report.make_report("cpu", "CPU", VERSIONS, checks(golden_fail=True)).ok
    assert not report.make_report("cpu", "CPU", VERSIONS, []).ok  # nothing checked is not a pass


def test_support_row():
    row = report.make_report("cuda:0", "CUDA 13.0 (NVIDIA H200)", VERSIONS, checks()).support_row
    assert row == ("| CUDA 13.0 (NVIDIA H200) | kv-sidecar 0.1.0 | torch 2.13.0 | AITER - | NIXL 1.5.1 "
                   "| vLLM - "
                   "| verify PASS: golden 2/2 (readers torch+triton) | ipc pass | nixl pass over cma+tcp "
                   "| vllm flags skip |")
    failed = report.make_report("cpu", "CPU", VERSIONS, checks(golden_fail=True)).support_row
    assert "verify FAIL: golden 1/2" in failed
    assert "\n" not in row


def test_table_columns_and_rows():
    from rich.console import Console  # imported here: collecting the GPU tests must not need rich

    rep = report.make_report("cpu", "CPU", VERSIONS, checks(golden_fail=True))
    console = Console(record=True, width=200)
    report.render(rep, console)
    text = console.export_text()
    header = next(line for line in text.splitlines() if "check" in line and "status" in line)
    cols = [c.strip() for c in header.strip("┃│ ").split("┃" if "┃" in header else "│")]
    assert tuple(cols) == report.TABLE_COLUMNS == ("check", "status", "detail")
    assert "golden N=16 D=64 H=3 bfloat16 gqa=4" in text and "fail" in text
    assert "result: FAIL" in text
    assert rep.support_row in text
