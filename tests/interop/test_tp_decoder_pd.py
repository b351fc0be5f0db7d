"""Unequal TP the other way with real engines: a stock vLLM prefill at TP 1 → one kv-sidecar daemon per
decoder rank → a vLLM decoder at TP 2 with our shim (socket template ``…/rank{rank}/…``). Each decoder rank
reads its one KV head out of the prefill's two-head pages; the prefill expects two notifications ("id:2"),
one from each daemon, before it frees a request.

The decoder's two CPU workers bind their threads by hand (VLLM_CPU_OMP_THREADS_BIND; see test_tp_pd), both
to the first core, because the prefill's is not ours to pick: vLLM's NixlConnectorWorker on CPU pins its
thread to the last core of each NUMA node (core 1 here, whatever VLLM_CPU_OMP_THREADS_BIND says), and at TP 1
that thread is the prefill's EngineCore, whose side-channel listener and its ZMQ I/O thread inherit the pin.
With the decoder's workers on core 1 too, their sched_yield spin while a load is pending took all of it: the
listener's I/O thread ran 0 ms in 24 s while they ran 9.7 and 10.7 s (/proc/<tid>/schedstat), connections
queued un-accepted on the prefill's port, and handshakes took 8-65 s or timed out at 120 s (two CI failures,
reproduced 2 runs in 3; bench/results/interop-tp-stall-cpu-2026-12-04.json).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.standins.demo import sample
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
from tests.interop.test_pd import PROMPTS, generate, pd

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

# The decoder's workers' core: the lowest this host allows (vLLM pins the prefill to the last; on the 2-core
# CI host they differ).
FIRST_CORE = min(os.sched_getaffinity(0))
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
            prefill_config(TP_LEASE_S),  # TP_*: long deadlines on a 2-core host (conftest.py)
        )
        for rank in (0, 1):
            (work / f"rank{rank}").mkdir()
            s.daemons.append(start_daemon(work / f"rank{rank}", CPU_PAGE, TP_LEASE_S, TP_HANDSHAKE))
        template = s.daemons[0].socket.replace("rank0", "rank{rank}")
        assert template != s.daemons[0].socket and template.replace("{rank}", "1") == s.daemons[1].socket
        s.decoder = Engine(
            "decoder-tp2",
            python,
            tiny_model,
            work,
            decoder_config(template, TP_LEASE_S, TP_PULL_TIMEOUT_S),
            extra_args=("--tensor-parallel-size", "2"),
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": f"{FIRST_CORE}|{FIRST_CORE}"},  # not the prefill's
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

    # Decode at TP 2 against a TP 1 reference (another reduction order); controls.py for the bound.
    assert_matches_one_engine("TP 1 -> 2", reference, results, decoder)

    # Each decoder rank's daemon pulled every request: its one head of every block.
    blocks = sum(len(k["remote_block_ids"][0]) for k, _ in results)
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        assert_only_ok(b, a, len(PROMPTS), rank)
        pulled = sample(a, "kv_sidecar_bytes_pulled_total") - sample(b, "kv_sidecar_bytes_pulled_total")
        assert pulled == blocks * LAYERS * LOCAL_PAGE_BYTES, rank

    # The prefill frees a request only after "id:2" from both daemons; none by lease expiry.
    assert_prefill_freed(prefill, results)


def test_dtp_pd_with_another_prompts_kv_differs(dtp: DecoderTP2Stack) -> None:
    """The control (controls.py): another prompt's blocks move the output beyond the bound."""
    assert dtp.prefill is not None and dtp.decoder is not None
    assert_other_kv_differs("dtp", dtp.prefill, dtp.decoder)
