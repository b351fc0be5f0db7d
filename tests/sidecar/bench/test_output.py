"""A bench's result is printed and, with --out, written: the same JSON in both places."""

from __future__ import annotations

import json

from sidecar.bench.output import emit


def test_emit_prints_and_writes_the_same_json(capsys, tmp_path):
    out = tmp_path / "r.json"
    emit({"bench": "x", "v": [1, 2]}, str(out), indent=2)
    printed = capsys.readouterr().out
    assert json.loads(printed) == json.loads(out.read_text()) == {"bench": "x", "v": [1, 2]}
    assert out.read_text().endswith("\n")


def test_emit_without_out_only_prints(capsys, tmp_path):
    emit({"a": 1}, None)
    assert json.loads(capsys.readouterr().out) == {"a": 1}
    assert not list(tmp_path.iterdir())
