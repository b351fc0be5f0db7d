"""End to end: prefill emulator ⇄ kv-sidecar daemon ⇄ decoder stand-in driving the vLLM shim's worker half."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from sidecar.standins.decoder import run_session, summarize
from sidecar.standins.demo import metrics_check, sample, scrape
from tests.e2e.procs import REMOTE_FMT, SHAPE, log_tail, start_daemon, start_emulator
from vllm_glue.orders import HeartbeatOrder, PullOrder, StepOrders, parse_remote

pytestmark = pytest.mark.e2e


def pull_one(standin, emulator, req_id: str, *, num_tokens: int = 40, **new_kw):
    reply = emulator.client.new_request(num_tokens=num_tokens, **new_kw)
    local = standin.allocate(len(reply.kernel_block_ids))
    order = PullOrder(req_id, parse_remote(reply.kv_transfer_params), local, True, time.monotonic_ns())
    return reply, order


def test_many_concurrent_requests_bit_exact_freed_and_counted(work, emulator, daemon, make_standin) -> None:
    before = scrape(daemon.metrics_url)
    standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors))
    assert standin.register(), standin.worker.client.status_reason
    results = run_session(
        standin,
        emulator.client,
        requests=48,
        seed=0,
        remote_fmt=REMOTE_FMT,
        tokens=(1, 300),
        rng_seed=11,
        timeout_s=60,
    )
    summary = summarize(results)
    assert summary["failed"] == 0, summary["failures"] + [log_tail(work)]
    assert summary["mismatched"] == 0, summary["failures"]
    assert summary["ok"] == 48 and summary["bytes"] > 0
    # Each block appears in the decoder's memory bit for bit; and the prefill got its one notification per
    # request.
    for r in results:
        st = emulator.client.wait_state(r.remote_request_id, "freed_by_notif", 10.0)
        assert st.notif_counts == [1] and st.late_notifications == 0
    after = scrape(daemon.metrics_url)
    delta_ok = sample(after, "kv_sidecar_requests_total", outcome="ok") - sample(
        before, "kv_sidecar_requests_total", outcome="ok"
    )
    assert delta_ok == 48
    delta_bytes = sample(after, "kv_sidecar_bytes_pulled_total") - sample(
        before, "kv_sidecar_bytes_pulled_total"
    )
    assert delta_bytes == summary["bytes"]
    assert sample(after, "kv_sidecar_requests_in_flight") == 0
    assert sample(after, "kv_sidecar_ready") == 1
    assert (
        sample(after, "kv_sidecar_stage_seconds_count", stage="end_to_end")
        - sample(before, "kv_sidecar_stage_seconds_count", stage="end_to_end")
        == 48
    )
    # The stand-in's shim saw the same timings the daemon measured, and the Pull's delivery (its shim's send
    # time to the daemon's receipt, protocol 3: over the completion socket).
    stages = {"handshake", "transfer", "convert", "end_to_end", "delivery"}
    assert all(set(r.timings) >= stages for r in results)
    assert all(0 < r.timings["delivery"] < r.timings["end_to_end"] + 1.0 for r in results)
    assert all(0 < r.timings["return"] < 1.0 for r in results)  # the Done's way back (its send time)


@pytest.mark.parametrize("inline", [False, True], ids=["poster", "inline"])
def test_staged_mode_is_bit_exact_too(work, emulator, make_standin, inline) -> None:
    """Staged pulls, all at once; with ``inline`` one at a time with inline posts on (the GPU default, off on
    the CPU twin): each lone pull is posted on the daemon's loop over real NIXL, and lands bit-exact."""
    page = REMOTE_FMT.page_bytes
    name = "staged-inline" if inline else "staged"
    extra = f'pull_mode = "staged"\nstaging_bytes = {SHAPE.layers * page * 64}'
    if inline:
        extra += "\ninline_post_max_descriptors = 4096"
    daemon = start_daemon(work, name=name, extra=extra)
    try:
        standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors))
        assert standin.register()
        results = run_session(
            standin,
            emulator.client,
            requests=16,
            seed=0,
            remote_fmt=REMOTE_FMT,
            tokens=(1, 200),
            concurrency=1 if inline else 0,
            rng_seed=12,
            timeout_s=60,
        )
        summary = summarize(results)
        assert summary["ok"] == 16, summary["failures"] + [log_tail(work, name)]
        m = metrics_check(daemon.metrics_url, summary)
        assert m["consistent"], m["problems"]
        # an inline post waits for no poster thread: its Done says poster_queue 0 (a handed-off one, > 0)
        on_loop = sum(r.timings.get("poster_queue") == 0.0 for r in results)
        assert on_loop >= 8 if inline else on_loop == 0, [r.timings.get("poster_queue") for r in results]
    finally:
        daemon.stop()


def test_refused_pairing_is_a_failed_load_with_its_reason(work, emulator, make_standin) -> None:
    # The operator declared nothing about this prefill: vLLM publishes no page-format tag, so it is refused.
    daemon = start_daemon(work, name="undeclared", declared=None, extra="handshake_timeout_s = 2.0")
    try:
        standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors))
        assert standin.register()
        reply, order = pull_one(standin, emulator, "refused-1")
        standin.pull([order])
        (out,) = standin.wait({"refused-1"}, 30).values()
        assert not out.ok
        assert "page-format" in out.reason and "declaration" in out.reason, out.reason
        # vLLM is told once: finished + failed, and the blocks that must not be trusted, in the same step.
        assert standin.reported("refused-1") == [(True, set(order.local_block_ids))]
        m = scrape(daemon.metrics_url)
        assert sample(m, "kv_sidecar_requests_total", outcome="refused") == 1
        refusals = {
            dict(k[1]).get("field"): v for k, v in m.items() if k[0] == "kv_sidecar_refusals_total" and v
        }
        assert refusals and sum(refusals.values()) >= 1, m
    finally:
        daemon.stop()


def test_dead_prefill_is_a_failed_load(work, make_standin) -> None:
    emu = start_emulator(work)
    daemon = start_daemon(work, name="deadp", extra="handshake_timeout_s = 1.0")
    try:
        standin = make_standin(daemon.socket, dict(emu.ready.compat_factors))
        assert standin.register()
        reply, order = pull_one(standin, emu, "dead-1")
        emu.kill()  # the prefill dies after answering, before the decoder pulls
        standin.pull([order])
        got = standin.wait({"dead-1"}, 30)
        assert "dead-1" in got, log_tail(work, "deadp")
        assert not got["dead-1"].ok and got["dead-1"].reason
        assert standin.reported("dead-1") == [(True, set(order.local_block_ids))]
        m = scrape(daemon.metrics_url)
        assert sample(m, "kv_sidecar_requests_total", outcome="failed") == 1
        assert sample(m, "kv_sidecar_handshakes_total", outcome="failed") >= 1
        assert sample(m, "kv_sidecar_requests_in_flight") == 0
    finally:
        daemon.stop()
        emu.stop()


def test_abort_is_reported_once_and_never_as_a_failure(work, emulator, daemon, make_standin) -> None:
    standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors))
    assert standin.register()
    reply, order = pull_one(standin, emulator, "abort-1", num_tokens=300)
    standin.pull([order], aborts=["abort-1"])
    got = standin.wait({"abort-1"}, 30)
    assert "abort-1" in got
    # Either the Done won the race or the daemon confirmed the abort: vLLM frees the blocks exactly once, and
    # an
    # aborted request is never reported as a failed load.
    assert standin.reported("abort-1") == [(False, set())]
    # The prefill is released either way (a read, or the daemon's notification on abort).
    emulator.client.wait_state(reply.kv_transfer_params["remote_request_id"], "freed_by_notif", 10.0)


def test_heartbeats_keep_a_waiting_request_alive_past_its_lease(work, emulator, daemon, make_standin) -> None:
    standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors))
    assert standin.register()
    # A 3 s lease (heartbeats extend it by 2 s: room for a late one on a loaded CI box); without heartbeats
    # the blocks would be reused long before the pull.
    reply = emulator.client.new_request(num_tokens=64, lease_s=3.0)
    remote = parse_remote(reply.kv_transfer_params)
    hb = StepOrders(
        heartbeats=[HeartbeatOrder(remote.engine_id, remote.host, remote.port, 1, [remote.request_id])]
    )
    t_end = time.monotonic() + 4.5
    while (
        time.monotonic() < t_end
    ):  # the scheduler half's heartbeat cadence while the request waits for blocks
        standin.worker.start_step(hb)
        time.sleep(0.25)
    st = emulator.client.status(remote.request_id)
    assert st.state == "pending" and st.heartbeats >= 3, st
    local = standin.allocate(len(reply.kernel_block_ids))
    standin.pull([PullOrder("hb-1", remote, local, True, time.monotonic_ns())])
    (out,) = standin.wait({"hb-1"}, 30).values()
    assert out.ok, out.reason
    from sidecar.standins.decoder import mismatched_blocks

    assert mismatched_blocks(standin, reply, local, 0, REMOTE_FMT) == []
    emulator.client.wait_state(remote.request_id, "freed_by_notif", 10.0)


def test_daemon_down_fails_loads_cleanly_then_recovers(work, emulator, make_standin) -> None:
    daemon = start_daemon(work, name="restart")
    socket = daemon.socket
    try:
        standin = make_standin(socket, dict(emulator.ready.compat_factors), register_timeout_s=30)
        assert standin.register()
        daemon.stop()
        _, order = pull_one(standin, emulator, "down-1")
        deadline = time.monotonic() + 10
        while standin.worker.client.is_ready() and time.monotonic() < deadline:
            standin.worker.collect()  # the disconnect arrives as an event
            time.sleep(0.01)
        t0 = time.monotonic()
        standin.pull([order])
        got = standin.wait({"down-1"}, 5)
        assert time.monotonic() - t0 < 4.0  # failed at once, not at the pull's 30 s deadline
        assert not got["down-1"].ok and "kv-sidecar" in got["down-1"].reason
        assert standin.reported("down-1") == [(True, set(order.local_block_ids))]
        # The daemon comes back on the same socket: the shim says Hello and registers again by itself.
        daemon = start_daemon(work, name="restart")
        assert standin.worker.client.wait_ready(30), standin.worker.client.status_reason
        results = run_session(
            standin, emulator.client, requests=4, seed=0, remote_fmt=REMOTE_FMT, rng_seed=13
        )
        assert summarize(results)["ok"] == 4
    finally:
        daemon.stop()


def test_standin_runs_as_its_own_process(work, emulator, daemon) -> None:
    ready_file = f"{work}/emu-ready.json"
    with open(ready_file, "w") as f:
        import msgspec

        f.write(msgspec.json.encode(emulator.ready).decode())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.standins.decoder",
            "--socket",
            daemon.socket,
            "--emulator-ready-file",
            ready_file,
            "--requests",
            "12",
            "--layers",
            str(SHAPE.layers),
            "--heads",
            str(SHAPE.heads),
            "--head-size",
            str(SHAPE.head_size),
            "--block-size",
            str(SHAPE.block_size),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] == 12 and summary["mismatched"] == 0


def test_demo_command_passes_and_cleans_up() -> None:
    """README's first command: all bit-exact, the prefill freed, metrics agree, nothing left running."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", "--requests", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert summary["ok_overall"] and summary["ok"] == 16 and summary["metrics"]["consistent"]
    assert summary["prefill_not_freed"] == [] and "cleanup_errors" not in summary
    # read as the shipped config reads: staged through a pool, every slot given back
    assert summary["metrics"]["read_modes"] == {"staged": 16, "direct": 0}
    assert summary["metrics"]["staging_bytes_in_use"] == 0
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_fp8_pages_of_the_same_flavour_are_bit_exact_and_freed(work, make_standin, dtype) -> None:
    """fp8 KV on both sides, one flavour, equal (default) scales: shuffled with x = 16, bit for bit."""
    import msgspec

    fmt = msgspec.structs.replace(REMOTE_FMT, dtype=dtype)
    emulator = start_emulator(work, "--dtype", dtype)
    daemon = start_daemon(work, name=f"fp8-{dtype}", declared=fmt)
    try:
        shape = msgspec.structs.replace(SHAPE, dtype=dtype)
        standin = make_standin(daemon.socket, dict(emulator.ready.compat_factors), shape=shape)
        assert standin.register(), standin.worker.client.status_reason
        results = run_session(
            standin,
            emulator.client,
            requests=12,
            seed=0,
            remote_fmt=fmt,
            tokens=(1, 200),
            rng_seed=13,
            timeout_s=60,
        )
        summary = summarize(results)
        assert summary["ok"] == 12 and summary["mismatched"] == 0, summary["failures"] + [
            log_tail(work, f"fp8-{dtype}")
        ]
        for r in results:
            st = emulator.client.wait_state(r.remote_request_id, "freed_by_notif", 10.0)
            assert st.notif_counts == [1] and st.late_notifications == 0
    finally:
        daemon.stop()
        emulator.stop()
