"""The loop bench: every cell's pulls answered OK and timed, its calls counted; a refused pull is reported."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from sidecar.bench import loop_cost
from sidecar.wire import protocol as p


def test_every_cell_is_timed_with_its_pulls_answered_ok(capsys, tmp_path):
    out_file = tmp_path / "loop.json"
    args = ["--blocks", "16", "--bursts-of", "1,3", "--idle-ms", "0,1", "--bursts", "6"]
    args += ["--out", str(out_file)]
    assert loop_cost.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == out
    assert [(c["burst"], c["idle_ms"]) for c in out["cells"]] == [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    for c in out["cells"]:
        assert c["failed"] == 0 and c["first_failure"] is None, c
        assert c["bursts"] == 6
        assert 0 < c["cpu_us_per_pull_p50"] <= c["cpu_us_per_pull_p90"]
        assert 0 < c["queue_ms_p50"] <= c["queue_ms_p99"] < 1000
        # a pull is hundreds of Python calls (decode, pairing, hand-off, answer); none of the bench's own
        assert 100 < c["calls_per_pull"] < 5000, c
        assert len(c["receipt_us_p50_by_place"]) == c["burst"] and min(c["receipt_us_p50_by_place"]) > 0, c


def test_staged_pulls_of_back_to_back_blocks(capsys):
    """--remote-order contiguous with a staging pool: every pull staged and answered, the order reported."""
    args = ["--blocks", "16", "--bursts-of", "2", "--idle-ms", "0", "--bursts", "4", "--remote-order",
            "contiguous", "--daemon-set", 'pull_mode="staged"', "--daemon-set", "staging_bytes=16777216"]
    assert loop_cost.main(args) == 0
    (c,) = json.loads(capsys.readouterr().out)["cells"]
    assert (c["remote_order"], c["failed"], c["bursts"]) == ("contiguous", 0, 4), c


def test_payload_orders():
    for order, back_to_back in (("contiguous", True), ("random", False)):
        for i, raw in enumerate(loop_cost.payloads(4, 32, 2, 2048, seed=1, order=order)):
            remote = p.unpack_block_ids(p.decode_on_completions(raw).remote_block_ids)
            assert (np.diff(remote) == 1).all() == back_to_back and remote.size == 32
            if back_to_back:
                assert remote[0] == (i % 2) * 32  # disjoint within a burst
    with pytest.raises(ValueError, match="order"):
        loop_cost.payloads(1, 4, 1, 64, seed=0, order="churn")


def test_a_refused_pull_counts_as_failed():
    async def run() -> list[str]:
        rig = loop_cost.LoopRig(64)
        await rig.start()
        try:
            answered = rig.answered(1)
            bad = loop_cost.payloads(1, 4, 1, 64, seed=0)[0]
            msg = p.decode_on_completions(bad)
            far = p.Pull(**{**{f: getattr(msg, f) for f in msg.__struct_fields__},
                            "local_block_ids": p.pack_block_ids(np.arange(100, 104))})
            rig.receive(p.encode(far))  # local blocks past the 64 registered
            await asyncio.wait_for(answered, 30)
            return rig.failed
        finally:
            await rig.stop()

    failed = asyncio.run(run())
    assert len(failed) == 1 and "q0" in failed[0], failed


def test_a_bad_daemon_setting_is_refused_naming_the_key(capsys):
    assert loop_cost.main(["--bursts", "1", "--daemon-set", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert loop_cost.main(["--bursts", "1", "--daemon-set", "poll_linger_s=["]) == 2
    assert "not a TOML value" in capsys.readouterr().err
