"""``bench e2e``'s report: the must-show arithmetic."""

import pytest

from sidecar.bench import e2e, e2e_report


def test_must_show_arithmetic() -> None:
    cell = e2e.Cell(4096, 8, "direct", "random", 256, nbytes=10**9)
    cell.bare_s, cell.sidecar_s = [0.010, 0.011, 0.012], [0.0120, 0.0126, 0.02]
    ms = e2e_report.must_show(cell, peer_gbps=120.0)
    assert ms["nixl_over_peer"] == pytest.approx((1e9 / 0.011 / 1e9) / 120.0)
    assert ms["nixl_at_least_0.8_peer"] is False  # 90.9 GB/s < 96
    assert ms["sidecar_limit_s"] == pytest.approx(1.05 * 0.011 + 8 * 0.2e-3)
    assert ms["sidecar_within_limit"] is True  # 12.6 ms <= 13.15 ms
    assert e2e_report.must_show(cell, peer_gbps=100.0)["nixl_at_least_0.8_peer"] is True


def test_markdown_rows_from_a_committed_result():
    """One row per cell, its numbers from the file (a committed H200 result, so the README's rows trace)."""
    import json
    from pathlib import Path

    from sidecar.bench.e2e_report import markdown_rows

    path = Path(__file__).parents[3] / "bench/results/e2e-h200-orders-compact-2026-12-02.json"
    result = json.loads(path.read_text())
    lines = markdown_rows([(path.name, result)]).splitlines()
    assert len(lines) == 2 + len(result["cells"])
    c = result["cells"][4]  # 4k x 8 quarter density
    row = lines[2 + 4].split(" | ")
    assert row[1:3] == ["4k × 8", "staged / density-0.25"]
    assert row[3] == f"{c['bare']['median_s'] * 1e3:.2f}"
    assert row[4].startswith(f"{c['sidecar']['median_s'] * 1e3:.2f} (")
    assert lines[-1].endswith("| bit-exact |")


def test_the_report_command_prints_rows_and_answers_help(capsys):
    """``python -m sidecar.bench.e2e_report``: rows for the files named; ``--help`` is help, not a file."""
    from pathlib import Path

    import pytest

    from sidecar.bench.e2e_report import main

    path = Path(__file__).parents[3] / "bench/results/e2e-h200-orders-compact-2026-12-02.json"
    main([str(path)])
    assert f"| {path.name} | 4k × 8 | staged / density-0.25 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "bench e2e JSON results" in capsys.readouterr().out


def test_skipped_cells_are_named_with_their_reason():
    """A result's unmeasured cells, one line each with why: the H100 run whose x 32 cells did not fit."""
    import json
    from pathlib import Path

    from sidecar.bench.e2e_report import skipped_lines

    path = Path(__file__).parents[3] / "bench/results/e2e-h100-compact-2026-12-05.json"
    lines = skipped_lines(json.loads(path.read_text())["cells"])
    assert lines == [
        f"staged/{order} 4096 tokens x 32: skipped: needs ~122 GiB on cuda:0, more than is free"
        for order in ("contiguous", "churn", "density-0.25")
    ]
    measured = {"mode": "staged", "order": "contiguous", "context": 4096, "concurrency": 1, "bare": {}}
    assert skipped_lines([measured]) == []


def test_timeline_rows_are_ms_from_the_batch_start_and_the_longest_accepts_are_kept() -> None:
    row = e2e_report.timeline_row({"delivery": 0.0002, "accept": 0.003, "other": 1.0}, 0.010, 0.0095)
    assert row == {"delivery": 0.2, "accept": 3.0, "done_at": 10.0, "sent_at": 0.5}
    assert "sent_at" not in e2e_report.timeline_row({}, 0.01, None)
    kept: list = []
    for i, accepts in enumerate(([1.0, 2.0], [5.0], [0.5], [3.0, 0.1], [4.0])):
        e2e_report.keep_timeline(kept, [{"accept": a, "sent_at": -a} for a in accepts], 100.0 + i)
    assert [(b["max_accept_ms"], b["start_s"]) for b in kept] == [(5.0, 101.0), (4.0, 104.0), (3.0, 103.0)]
    assert [r["accept"] for r in kept[2]["requests"]] == [3.0, 0.1]  # in the order they were sent
