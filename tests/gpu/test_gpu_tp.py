"""Heterogeneous TP on GPUs: a prefill emulator at TP p with its pages in VRAM, one daemon per decoder rank
(``--gpu N``, one GPU per rank when there are two, else both on GPU 0), decoder stand-in ranks with their
planes in VRAM. Every rank's heads bit-exact against the CPU reference; every prefill rank freed by exactly
the notifications vLLM's rule says."""

from __future__ import annotations

import pytest
import torch

from sidecar.bench.e2e_roles import DeviceStandin, start_daemon
from sidecar.bench.ucx_logs import ucx_env
from sidecar.standins.decoder import StandinShape, run_tp_session, summarize
from sidecar.standins.emulator_control import spawn_emulator
from sidecar.wire.formats import STANDARD, PageFormat

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

LAYERS, HEADS, HEAD_SIZE, BLOCK, REQUESTS = 4, 8, 128, 16, 12  # Qwen3-8B's 8 KV heads, fewer layers


def rank_fmt(heads: int) -> PageFormat:
    return PageFormat(kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=heads, block_size=BLOCK,
                      head_size=HEAD_SIZE)


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("decoder_tp,prefill_tp", [(2, 1), (1, 2)], ids=["d2p1", "d1p2"])
def test_unequal_tp_on_gpus_is_bit_exact_and_frees_every_rank(tmp_path, mode, decoder_tp, prefill_tp):
    gpus = torch.cuda.device_count()
    prefill = rank_fmt(HEADS // prefill_tp)
    local_heads = HEADS // decoder_tp
    shape = StandinShape(layers=LAYERS, heads=local_heads, head_size=HEAD_SIZE, block_size=BLOCK,
                         num_blocks=1024)
    emu = spawn_emulator(
        [*("--device", "cuda:0", "--layers", str(LAYERS), "--heads", str(HEADS // prefill_tp)),
         *("--tp", str(prefill_tp), "--head-size", str(HEAD_SIZE), "--block-size", str(BLOCK)),
         *("--num-blocks", "2048", "--lease", "600", "--control", f"ipc://{tmp_path}/emu.sock")],
        180.0, ucx_env(tmp_path, "prefill", "warn", cuda=True),
    )
    daemons, standins = [], []
    try:
        for rank in range(decoder_tp):
            gpu = rank % gpus
            daemons.append(start_daemon(
                tmp_path, f"d{rank}", remote_fmt=prefill, gpu=gpu, mode=mode,
                staging_bytes=LAYERS * 4096 * shape.fmt.page_bytes,
                env=ucx_env(tmp_path, f"d{rank}", "warn", True),
                log_path=tmp_path / f"d{rank}.log",
            ))
            s = DeviceStandin(daemons[-1].socket, shape, device=f"cuda:{gpu}",
                              compat_factors=dict(emu.ready.compat_factors), worker_rank=rank,
                              tp_size=decoder_tp)
            standins.append(s)
            assert s.register(), s.worker.client.status_reason
        results = run_tp_session(standins, emu.client, requests=REQUESTS, seed=0, remote_fmt=prefill,
                                 tokens=(1, 600), timeout_s=180)
        summary = summarize(results)
        assert summary["ok"] == summary["requests"] == decoder_tp * REQUESTS, summary["failures"]
        want = ([decoder_tp // prefill_tp], [1] * prefill_tp)[prefill_tp > decoder_tp]
        for rid in {r.remote_request_id for r in results}:
            st = emu.client.wait_state(rid, "freed_by_notif", 10.0)
            assert st.notif_counts == want and st.late_notifications == 0, st
    finally:
        for s in standins:
            s.close()
        for d in daemons:
            d.stop()
        emu.stop()

