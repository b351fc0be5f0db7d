"""Three real processes: prefill emulator and daemon as subprocesses, the decoder stand-in in the test.

The test process is the decoder: it owns the shared-memory K/V planes and drives the vLLM shim's worker half.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The tests import their helpers as ``tests.<dir>.<module>``: make the repository importable under plain
# ``pytest`` too (``python -m pytest`` already has it on sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sidecar.standins.decoder import DecoderStandin
from tests.e2e.procs import SHAPE, start_daemon, start_emulator


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="module")
def emulator(work: str) -> Iterator[Any]:
    emu = start_emulator(work)
    yield emu
    emu.stop()


@pytest.fixture(scope="module")
def daemon(work: str) -> Iterator[Any]:
    d = start_daemon(work)
    yield d
    d.stop()


@pytest.fixture
def make_standin() -> Iterator[Callable[..., DecoderStandin]]:
    made: list[DecoderStandin] = []

    def make(socket: str, factors: dict[str, Any], **kw: Any) -> DecoderStandin:
        s = DecoderStandin(socket, kw.pop("shape", SHAPE), compat_factors=factors, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
