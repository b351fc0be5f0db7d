"""sidecar.ops.doctor_pull: doctor's test pull against a real prefill emulator over real NIXL/UCX."""

from __future__ import annotations

import os

import msgspec
import pytest

from sidecar.ops import doctor_pull as dp
from sidecar.standins.emulator_control import spawn_emulator

LAYERS = 2


def _spawn():
    """An emulator as doctor starts one: EMULATOR_SPEC's format and seed."""
    return spawn_emulator(dp.EMULATOR_SPEC.emulator_args(LAYERS), timeout_s=60)


@pytest.fixture(scope="module")
def emulator():
    emu = _spawn()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.mark.e2e
def test_the_probe_reads_every_byte_and_the_emulator_frees_the_request(emulator):
    result, log = dp.run_probe(emulator.ready.control, dp.EMULATOR_SPEC, 5.0, os.environ)
    assert result.ok, result.reason
    assert result.verified and result.freed and result.seconds > 0
    assert result.nbytes == LAYERS * 4 * dp.EMULATOR_SPEC.format.page_bytes  # probe_pull reads 4 blocks
    assert "UCX" in log  # UCX_LOG_LEVEL=info reached the probe's process


@pytest.mark.e2e
def test_bytes_unlike_the_spec_fail_the_probe(emulator):
    wrong = dp.EmulatorSpec(seed=dp.EMULATOR_SPEC.seed + 1, format=dp.EMULATOR_SPEC.format)
    result, _ = dp.run_probe(emulator.ready.control, wrong, 5.0, os.environ)
    assert not result.ok and "differ from the emulator's pages" in result.reason, result
    assert not result.verified


@pytest.mark.e2e
def test_a_page_size_unlike_the_spec_is_named(emulator):
    f = dp.EMULATOR_SPEC.format
    other = dp.EmulatorSpec(
        seed=dp.EMULATOR_SPEC.seed, format=msgspec.structs.replace(f, head_size=f.head_size // 2)
    )
    result, _ = dp.run_probe(emulator.ready.control, other, 5.0, os.environ)
    assert not result.ok
    assert (
        result.reason == f"the emulator's pages are {f.page_bytes} bytes, its spec says {f.page_bytes // 2}"
    )


@pytest.mark.e2e
def test_a_stopped_emulator_is_named():
    emu = _spawn()
    control = emu.ready.control
    emu.stop()
    result, _ = dp.run_probe(control, dp.EMULATOR_SPEC, 2.0, os.environ)
    assert not result.ok and result.reason.startswith(f"emulator control {control}: "), result
