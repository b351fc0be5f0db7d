"""scripts/slim-wheels.py: the dropped package and its RECORD lines go, the rest stays."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slim-wheels.py"


def _load():
    spec = importlib.util.spec_from_file_location("slim_wheels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items())
    record += "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def test_drops_the_package_and_its_record_lines(tmp_path: Path) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB that does not compress away
    wheel = _wheel(
        tmp_path / "pkg-1.0-py3-none-any.whl",
        {"nixl/__init__.py": b"x = 1\n", "nixl_ep_cu13/lib.so": big, "nixl_ep_cu13/__init__.py": b""},
    )
    saved = _load().slim(wheel)
    assert saved > 0
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
        names = set(z.namelist())
        assert names == {"nixl/__init__.py", "pkg-1.0.dist-info/RECORD"}
        assert z.read("nixl/__init__.py") == b"x = 1\n"
        record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
    assert record == ["nixl/__init__.py,sha256=x,6", "pkg-1.0.dist-info/RECORD,,"]


def test_a_wheel_without_the_package_is_left_alone(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", {"nixl/__init__.py": b"x = 1\n"})
    before = wheel.read_bytes()
    assert _load().slim(wheel) == 0
    assert wheel.read_bytes() == before


def test_cli_says_when_there_are_no_wheels(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "no wheels" in r.stderr
