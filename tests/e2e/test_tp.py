"""End to end across unequal TP: prefill emulator at TP p ⇄ one kv-sidecar daemon per decoder rank ⇄ decoder
stand-in ranks at TP d, real NIXL over UCX. Every rank's heads bit-exact, every prefill rank freed by exactly
the notifications vLLM's rule says it expects."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest

from sidecar.standins.decoder import DecoderStandin, run_tp_session, summarize
from tests.e2e.procs import ENV, REMOTE_FMT, SHAPE, log_tail, start_daemon, start_emulator
from vllm_glue.orders import PullOrder, parse_remote

pytestmark = pytest.mark.e2e

HEADS = REMOTE_FMT.num_heads  # the model's KV heads in every case below: 2


def rank_fmt(heads: int):
    return msgspec.structs.replace(REMOTE_FMT, num_heads=heads)


def staged(fmt) -> str:
    # two layer groups: a group converts once every prefill rank's read of it has landed
    return f'pull_mode = "staged"\nstaging_bytes = {SHAPE.layers * fmt.page_bytes * 64}\nlayer_groups = 2'


def run_pair(work, *, decoder_tp, prefill_tp, mode, requests=6, rng_seed=1):
    """Run ``requests`` pulls through decoder_tp daemons; return (summary, emulator client, results)."""
    prefill = rank_fmt(HEADS // prefill_tp)
    local_heads = HEADS // decoder_tp
    emu = start_emulator(work, "--heads", str(HEADS // prefill_tp), "--tp", str(prefill_tp))
    daemons, standins = [], []
    try:
        for rank in range(decoder_tp):
            extra = staged(rank_fmt(local_heads)) if mode == "staged" else 'pull_mode = "direct"'
            daemons.append(start_daemon(work, declared=prefill, extra=extra, name=f"tp{mode}{rank}"))
        shape = msgspec.structs.replace(SHAPE, heads=local_heads)
        for rank, d in enumerate(daemons):
            s = DecoderStandin(d.socket, shape, compat_factors=dict(emu.ready.compat_factors),
                               worker_rank=rank, tp_size=decoder_tp)
            standins.append(s)
            assert s.register(), s.worker.client.status_reason
        results = run_tp_session(standins, emu.client, requests=requests, seed=0, remote_fmt=prefill,
                                 tokens=(1, 120), timeout_s=60, rng_seed=rng_seed)
        logs = [log_tail(work, f"tp{mode}{r}") for r in range(decoder_tp)]
        notif = {}
        for r in {x.remote_request_id for x in results}:
            st = emu.client.wait_state(r, "freed_by_notif", 10.0)
            notif[r] = (st.notif_counts, st.expected_n, st.late_notifications)
        return summarize(results), notif, logs
    finally:
        for s in standins:
            s.close()
        for d in daemons:
            d.stop()
        emu.stop()


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_decoder_tp2_reads_its_head_slice_of_a_tp1_prefill(work, mode) -> None:
    summary, notif, logs = run_pair(work, decoder_tp=2, prefill_tp=1, mode=mode)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary["failures"] + logs
    assert summary["ok"] == summary["requests"] == 2 * 6
    # the TP1 prefill rank expects two notifications "id:2" (one per decoder rank) and got exactly those
    assert all(v == ([2], [2], 0) for v in notif.values()), notif


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_decoder_tp1_gathers_heads_from_both_ranks_of_a_tp2_prefill(work, mode) -> None:
    summary, notif, logs = run_pair(work, decoder_tp=1, prefill_tp=2, mode=mode)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary["failures"] + logs
    assert summary["ok"] == summary["requests"] == 6
    # each prefill rank was read once and told once "id:1"
    assert all(v == ([1, 1], [1, 1], 0) for v in notif.values()), notif


def test_heads_that_do_not_split_over_the_decoder_tp_are_refused_by_field(work) -> None:
    emu = start_emulator(work, "--heads", "3", "--tp", "1")
    daemons = [start_daemon(work, declared=rank_fmt(3), name=f"tprefuse{r}") for r in range(2)]
    shape = msgspec.structs.replace(SHAPE, heads=1)
    standins = [DecoderStandin(d.socket, shape, compat_factors=dict(emu.ready.compat_factors), worker_rank=r,
                               tp_size=2) for r, d in enumerate(daemons)]
    try:
        for s in standins:
            assert s.register(), s.worker.client.status_reason
        results = run_tp_session(standins, emu.client, requests=1, seed=0, remote_fmt=rank_fmt(3),
                                 tokens=(20, 20), timeout_s=30)
        assert len(results) == 2 and not any(r.ok for r in results)
        for r in results:
            assert r.reason.startswith("local_tp") and "3 KV heads" in r.reason, r.reason
        # refused after the handshake decoded: each decoder rank still told the prefill "id:2", so it frees
        # the blocks now rather than at its lease's end
        st = emu.client.wait_state(results[0].remote_request_id, "freed_by_notif", 10.0)
        assert st.notif_counts == [2] and st.expected_n == [2] and st.late_notifications == 0, st
    finally:
        for s in standins:
            s.close()
        for d in daemons:
            d.stop()
        emu.stop()


def test_standin_cli_runs_as_a_tp2_decoder(work) -> None:
    emu = start_emulator(work, "--heads", "2", "--tp", "1")
    daemons = [start_daemon(work, declared=rank_fmt(2), name=f"tpcli{r}") for r in range(2)]
    ready_file = f"{work}/emu-tp-ready.json"
    with open(ready_file, "wb") as f:
        f.write(msgspec.json.encode(emu.ready))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar.standins.decoder",
             "--socket", ",".join(d.socket for d in daemons),
             "--emulator-ready-file", ready_file, "--heads", "1", "--prefill-heads", "2",
             "--layers", str(SHAPE.layers), "--head-size", str(SHAPE.head_size), "--requests", "4"],
            capture_output=True, text=True, timeout=120, env={**os.environ, **ENV},
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = msgspec.json.decode(proc.stdout.strip().splitlines()[-1])
        assert out["ok"] == out["requests"] == 8
    finally:
        for d in daemons:
            d.stop()
        emu.stop()



def test_a_pull_refused_after_the_handshakes_tells_every_prefill_rank_once(work) -> None:
    # Decoder TP1 reading a TP2 prefill; the Pull names a remote block past the prefill's cache, so it is
    # refused before any read is posted: both prefill ranks must still be told "id:1", once each.
    emu = start_emulator(work, "--heads", "1", "--tp", "2")
    d = start_daemon(work, declared=rank_fmt(1), name="tpbadids")
    s = DecoderStandin(d.socket, SHAPE, compat_factors=dict(emu.ready.compat_factors))
    try:
        assert s.register(), s.worker.client.status_reason
        reply = emu.client.new_request(num_tokens=40)
        remote = parse_remote(reply.kv_transfer_params)
        bad = msgspec.structs.replace(remote, block_ids=[*remote.block_ids[:-1], 10**6])
        local = s.allocate(len(reply.kernel_block_ids))
        s.pull([PullOrder("bad", bad, local, True, time.monotonic_ns())])
        out = s.wait({"bad"}, 30)["bad"]
        assert not out.ok and out.reason.startswith("remote_block_ids"), out.reason
        st = emu.client.wait_state(remote.request_id, "freed_by_notif", 10.0)
        assert st.notif_counts == [1, 1] and st.late_notifications == 0, st
    finally:
        s.close()
        d.stop()
        emu.stop()


@pytest.mark.parametrize("flags", [["--decoder-tp", "2"], ["--prefill-tp", "2", "--pull-mode", "staged"]],
                         ids=["decoder-tp2", "prefill-tp2-staged"])
def test_demo_runs_at_unequal_tp(flags) -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "demo", "--requests", "8", "--json", *flags],
                          capture_output=True, text=True, timeout=180)
    out = msgspec.json.decode(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (out, proc.stderr[-3000:])
    ranks = 2 if "--decoder-tp" in flags else 1
    assert out["ok_overall"] and out["ok"] == out["requests"] == 8 * ranks
    assert out["prefill_not_freed"] == [] and out["metrics"]["consistent"]
    assert len(out["metrics"]["per_daemon"]) == ranks
