"""Config ``loop_pieces`` on a real ``kv-sidecar serve``: pulls through it are timed piece by piece, and the
file is written when the daemon stops."""

from __future__ import annotations

import json
import os

import pytest

from sidecar.standins.decoder import run_session, summarize
from tests.e2e.procs import REMOTE_FMT, log_tail, start_daemon

pytestmark = pytest.mark.e2e


def test_a_daemon_with_pieces_on_times_each_pull(work, emulator, make_standin) -> None:
    path = os.path.join(work, "pieces.json")
    daemon = start_daemon(work, name="pieces", extra=f'loop_pieces = "{path}"')
    try:
        standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors))
        assert standin.register(), standin.worker.client.status_reason
        results = run_session(standin, emulator.client, requests=6, seed=0, remote_fmt=REMOTE_FMT,
                              tokens=(1, 100), rng_seed=3, timeout_s=60)
        summary = summarize(results)
        tail = [log_tail(work, "pieces")]
        assert summary["ok"] == 6 and summary["mismatched"] == 0, summary["failures"] + tail
    finally:
        daemon.stop()
    with open(path) as f:
        got = json.load(f)
    # the CPU twin has no GPU launch; every other piece of a pull ran once per pull at least
    for piece in ("receipt", "pairing", "answer", "poll"):
        assert got[piece]["n"] >= 6 and got[piece]["p50_us"] > 0, (piece, got)
    assert not any(p.startswith("launch") for p in got)
    # the post, on the loop (coroutines: wall time only) and on the poster thread (CPU and wall)
    for piece in ("transfer.post", "transfer.poster", "transfer.wait"):
        row = got[piece]
        assert row["n"] >= 6 and row["wall_p50_us"] > 0 and "p50_us" not in row, (piece, got)
    for piece in ("post", "post.table", "post.nixl"):
        row = got[piece]
        assert row["n"] >= 6 and row["wall_p50_us"] >= row["p50_us"] * 0.5 > 0, (piece, got)
    assert got["transfer.post"]["wall_p50_us"] >= got["post"]["wall_p50_us"] * 0.5
