"""The tree passes the linter pyproject.toml configures (ruff, a dev extra), so a newcomer's first
``ruff check .`` is clean and CI keeps it so."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes() -> None:
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_no_two_classes_share_a_name() -> None:
    """A name says which class it is: two ``Status`` classes (the daemon's message and the prefill emulator's
    control request) made a reader check the imports to know which one a line meant."""
    import ast
    from collections import defaultdict

    where = defaultdict(list)
    for package in ("sidecar", "vllm_glue"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:  # module level: what others import
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {name: at for name, at in where.items() if len(at) > 1} == {}
