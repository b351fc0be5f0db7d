"""Unequal TP the other way with real engines: a stock vLLM prefill at TP 1 → one kv-sidecar daemon per
decoder rank → a vLLM decoder at TP 2 with our shim (socket template ``…/rank{rank}/…``). Each decoder rank
reads its one KV head out of the prefill's two-head pages; the prefill expects two notifications ("id:2"),
one from each daemon, before it frees a request.

The decoder's two CPU workers bind their threads by hand (VLLM_CPU_OMP_THREADS_BIND; see test_tp_pd), both
to core 1, the prefill's to core 0: with both cores taken by the decoder's workers and another job on the host
(load 15 on 2 cores) a handshake reply took over 5 s and reads stalled past the 30 s pull deadline.
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

# Three engines and their busy loops on a 2-core CI host: vLLM's prefill EngineCore spins at 100 % of one core
# while it holds blocks for a remote decoder, and the decoder's workers spin on the other, so the daemons get
# a few slices a second. A first handshake took 8.6 s here and once over 20 s, so the lease, the handshake and
# the pull deadline are long: the tests check bytes, outputs and frees, not speed.
LEASE_S = 120
PULL_TIMEOUT_S = 90
HANDSHAKE = ("handshake_timeout_s = 60.0",)
LOCAL_PAGE_BYTES = 2 * 1 * 128 * 128 * 2  # one decoder rank's page: [1 head, 128 tokens, 2 * 128] bf16
LAYERS = 2


class DecoderTP2Stack:
    def __init__(self) -> None:
        self.prefill: Engine | None = None
        self.decoder: Engine | None = None
        self.daemons: list = []

    def stop(self) -> None:
        for engine in (self.decoder, self.prefill):
            if engine is not None:
                engine.stop()
        for d in self.daemons:
            d.stop()


@pytest.fixture(scope="module")
def dtp(
    python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory, stack: Stack
) -> Iterator[DecoderTP2Stack]:
    stack.stop()  # the package's engines, if an earlier module started them: free the cores
    work: Path = tmp_path_factory.mktemp("interop-dtp")
    s = DecoderTP2Stack()
    try:
        s.prefill = Engine(
            "prefill-tp1",
            python,
            tiny_model,
            work,
            prefill_config(LEASE_S),
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
        )
        for rank in (0, 1):
            (work / f"rank{rank}").mkdir()
            s.daemons.append(start_daemon(work / f"rank{rank}", CPU_PAGE, LEASE_S, HANDSHAKE))
        template = s.daemons[0].socket.replace("rank0", "rank{rank}")
        assert template != s.daemons[0].socket and template.replace("{rank}", "1") == s.daemons[1].socket
        s.decoder = Engine(
            "decoder-tp2",
            python,
            tiny_model,
            work,
            decoder_config(template, LEASE_S, PULL_TIMEOUT_S),
            extra_args=("--tensor-parallel-size", "2"),
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1|1"},
        )
        s.prefill.wait_ready(START_TIMEOUT_S)
        s.decoder.wait_ready(START_TIMEOUT_S)
        yield s
    finally:
        s.stop()


def test_tp1_prefill_to_tp2_decoder_greedy_equal_and_prefill_freed(dtp: DecoderTP2Stack) -> None:
    prefill, decoder = dtp.prefill, dtp.decoder
    assert prefill is not None and decoder is not None
    reference = [generate(prefill, p) for p in PROMPTS]
    generate(decoder, "warm up")  # a cold decoder's first forward is slow; see test_pd
    before = [scrape(d.metrics_url) for d in dtp.daemons]
    results = [pd(prefill, decoder, p) for p in PROMPTS]
    after = [scrape(d.metrics_url) for d in dtp.daemons]

    diffs = []
    for prompt, ref, (_, out) in zip(PROMPTS, reference, results, strict=True):
        assert out["token_ids"] == ref["token_ids"], (
            f"P/D (TP 1 → 2) differs from the TP 1 engine for {prompt[:40]!r}: {out['token_ids']} != "
            f"{ref['token_ids']}\ndecoder log:\n{decoder.log_tail(40)}"
        )
        assert len(out["token_ids"]) == MAX_TOKENS
        diffs.append(logprob_diff(out, ref))
    # Decode at TP 2 against a TP 1 reference (another reduction order); controls.py for the bound.
    assert max(diffs) <= LOGPROB_TOLERANCE, diffs
    assert len({tuple(out["token_ids"]) for _, out in results}) > 1
    print(f"TP 1 -> 2: max |logprob diff| per prompt {diffs}")

    # Each decoder rank's daemon pulled every request: its one head of every block.
    n = len(PROMPTS)
    blocks = sum(len(k["remote_block_ids"][0]) for k, _ in results)
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):

        def delta(name: str, **labels: str) -> float:
            return sample(a, name, **labels) - sample(b, name, **labels)  # noqa: B023

        assert delta("kv_sidecar_requests_total", outcome="ok") == n, rank
        for outcome in ("failed", "refused", "aborted", "expired"):
            assert delta("kv_sidecar_requests_total", outcome=outcome) == 0, (rank, outcome)
        assert delta("kv_sidecar_bytes_pulled_total") == blocks * LAYERS * LOCAL_PAGE_BYTES, rank

    # The prefill frees a request only after "id:2" from both daemons; none by lease expiry.
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


def test_dtp_pd_with_another_prompts_kv_differs(dtp: DecoderTP2Stack) -> None:
    """The control (controls.py): another prompt's blocks move the output beyond the bound."""
    assert dtp.prefill is not None and dtp.decoder is not None
    out, reference = swapped_kv_output(dtp.prefill, dtp.decoder)
    diff = logprob_diff(out, reference)
    print(
        f"dtp control: tokens equal {out['token_ids'] == reference['token_ids']}, max |logprob diff| {diff}"
    )
    assert out["token_ids"] != reference["token_ids"] or diff > LOGPROB_TOLERANCE
