"""The mapped read mode on a GPU: the daemon maps the prefill emulator's VRAM through UCX (cuda_ipc) and its
conversion kernel reads the pages straight from there, with no NIXL READ and no staging.

Three real processes as in ``test_gpu_slice.py`` (whose emulator and helpers this reuses): every pulled block
bit-exact against the CPU reference, one notification per request, and every block of the decoder's planes
that no request was given still holds its canary. The daemon's metrics say every pull was mapped.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
import urllib.request

import pytest
import torch

from sidecar.bench.e2e_roles import DeviceStandin, start_daemon
from sidecar.bench.ucx_logs import ucx_env
from sidecar.standins.emulator_control import spawn_emulator
from tests.gpu.test_gpu_slice import (
    DEVICE,
    GPU,
    LAYERS,
    MAX_TOKENS,
    REMOTE,
    REQUESTS,
    SEED,
    SHAPE,
    _free_port,
    emulator,
    mismatches,
    pull_round,
    work,
)
from vllm_glue.orders import PullOrder, parse_remote

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
__all__ = ["emulator", "work"]  # fixtures, used by name

CANARY = 0x5A5A


def _metrics(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(rf'^{name}\{{\w+="(\w+)"\}} (\S+)$', text, re.M)
    return {label: float(value) for label, value in found}


def _gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@contextlib.contextmanager
def mapped_daemon(work, name: str, factors: dict, **settings: str):
    """A ``kv-sidecar serve --gpu 0`` in pull_mode mapped (``settings``: more config keys, raw TOML values)
    and the decoder stand-in registered with it: yields (stand-in, metrics port, daemon); both stopped on the
    way out."""
    metrics_port = _free_port()
    daemon = start_daemon(
        work,
        name,
        remote_fmt=REMOTE,
        gpu=GPU,
        mode="mapped",
        staging_bytes=0,
        env=ucx_env(work, name, "info", cuda=True),
        log_path=work / f"{name}.log",
        settings={"metrics_port": str(metrics_port), **settings},
    )
    try:
        standin = DeviceStandin(
            daemon.socket, SHAPE, device=DEVICE, compat_factors=factors, pull_timeout_s=60.0
        )
        try:
            assert standin.register(), standin.worker.client.status_reason
            yield standin, metrics_port, daemon
        finally:
            standin.close()
    finally:
        daemon.stop()


def test_mapped_pulls_convert_from_the_prefills_vram_and_touch_nothing_else(work, emulator) -> None:
    """Two rounds of pulls, a pause past mapping_idle_s (the mapping is let go), a third round (mapped
    again): every round bit-exact, and no block outside the rounds' ever written."""
    name = "daemon-mapped"
    factors = dict(emulator.ready.compat_factors)
    with mapped_daemon(work, name, factors, mapping_idle_s="1.0") as (standin, metrics_port, _):
        used = _paint_and_track(standin)
        for i, seed in enumerate((11, 12)):
            pull_round(standin, emulator, f"{name}-{i}", seed=seed)
        time.sleep(2.0)  # past mapping_idle_s: let go
        assert _gauge(metrics_port, "kv_sidecar_mapped_peers") == 0
        pull_round(standin, emulator, f"{name}-2", seed=13)  # mapped again (counted below)
        _assert_canaries(standin, used)
        modes = _metrics(metrics_port, "kv_sidecar_read_modes_total")
        assert modes["mapped"] == 3 * REQUESTS and modes["direct"] == 0, modes
        mappings = _metrics(metrics_port, "kv_sidecar_peer_mappings_total")
        # at least once more after the pause (also between rounds, if one's checks outlast the idle time)
        assert mappings["mapped"] >= 2 and mappings["unavailable"] == 0, mappings
        launches = _metrics(metrics_port, "kv_sidecar_conversion_launches_total")
        assert launches["graph"] > 0, launches  # out of place: replayed from CUDA graphs


def _paint_and_track(standin: DeviceStandin) -> set[int]:
    """Paint every block of the decoder's planes with the canary; the returned set fills with the block ids
    handed to requests from then on."""
    for layer in range(LAYERS):
        standin.k_plane(layer).view(torch.int16).fill_(CANARY)
        standin.v_plane(layer).view(torch.int16).fill_(CANARY)
    used: set[int] = set()
    real_allocate = standin.allocate

    def allocate(n: int) -> list[int]:
        ids = real_allocate(n)
        used.update(ids)
        return ids

    standin.allocate = allocate
    return used


def _assert_canaries(standin: DeviceStandin, used: set[int]) -> None:
    """Every block no request was given still holds the canary, in every layer's K and V plane."""
    torch.cuda.synchronize()
    others = torch.tensor(sorted(set(range(SHAPE.num_blocks)) - used), device=DEVICE)
    assert others.numel() > 0
    for layer in range(LAYERS):
        for plane in (standin.k_plane(layer), standin.v_plane(layer)):
            assert bool((plane.view(torch.int16).index_select(0, others) == CANARY).all()), layer


def test_reloads_that_readmit_the_prefill_map_it_again_and_lose_nothing(work, emulator) -> None:
    """SIGHUPs that change ``remotes`` while a round's pulls are in flight: each re-admits the prefill, a peer
    of its own mapping the same pages again while pulls may still convert through the retired one's mapping
    (closed once they let go). Every pull bit-exact and mapped, nothing written outside its blocks."""
    name = "daemon-mapped-reload"
    path = work / f"{name}.toml"
    rules = ('match = "127.0.0.1:*"', 'match = "127.0.0.*:*"')  # the same prefill, another rule's text
    rounds = 4
    with mapped_daemon(work, name, dict(emulator.ready.compat_factors)) as (standin, metrics_port, daemon):
        text = path.read_text()
        assert rules[0] in text
        used = _paint_and_track(standin)
        pull_round(standin, emulator, f"{name}-warm", seed=31)  # the first admission and mapping

        real_pull, reloads = standin.pull, iter(range(rounds))

        def pull_then_reload(orders: list[PullOrder]) -> None:
            """Send a round's Pulls, then reload while they are in flight."""
            real_pull(orders)
            i = next(reloads)
            path.with_suffix(".new").write_text(text.replace(rules[0], rules[(i + 1) % 2]))
            path.with_suffix(".new").replace(path)  # replaced whole: a reload never reads it half written
            daemon.signal(signal.SIGHUP)

        standin.pull = pull_then_reload
        for i in range(rounds):
            pull_round(standin, emulator, f"{name}-{i}", seed=32 + i)
            time.sleep(0.1)  # one reload per round (signals of one kind merge while pending)
        standin.pull = real_pull
        pull_round(standin, emulator, f"{name}-last", seed=40)  # through the last admission's mapping
        _assert_canaries(standin, used)
        modes = _metrics(metrics_port, "kv_sidecar_read_modes_total")
        assert modes["mapped"] == (rounds + 2) * REQUESTS and modes["direct"] == 0, modes
        mappings = _metrics(metrics_port, "kv_sidecar_peer_mappings_total")
        assert mappings["mapped"] >= 2 and mappings["unavailable"] == 0, mappings
    log = (work / f"{name}.log").read_text()
    assert log.count("SIGHUP: applied remotes") >= rounds and log.count(" admitted: ") >= 2, log[-4000:]


def _spawn_prefill(work, name: str, num_blocks: int):
    args = [
        *("--device", DEVICE, "--layers", str(LAYERS), "--heads", str(SHAPE.heads), "--head-size"),
        *(str(SHAPE.head_size), "--block-size", str(SHAPE.block_size), "--num-blocks", str(num_blocks)),
        *("--seed", str(SEED), "--lease", "600", "--control", f"ipc://{work}/{name}.sock"),
    ]
    return spawn_emulator(args, 180.0, ucx_env(work, name, "info", cuda=True))


def test_a_killed_prefill_is_answered_and_the_next_one_is_mapped_afresh(work) -> None:
    """SIGKILL a prefill whose pages the daemon has mapped: a pull of a request it had prefilled is answered
    (what the driver does with the dead process's memory is recorded, not assumed), the daemon stays
    healthy, and a new prefill is mapped and read bit-exact."""
    name = "daemon-mapped-restart"
    first = _spawn_prefill(work, "prefill-a", 8192)  # 2 GiB of pages: visible in the device's free memory
    second = None
    seen: dict[str, object] = {}
    try:
        with mapped_daemon(work, name, dict(first.ready.compat_factors)) as (standin, metrics_port, _):
            pull_round(standin, first, f"{name}-a", seed=21)
            left = first.client.new_request(num_tokens=MAX_TOKENS)  # prefilled, then its prefill dies
            free_before = torch.cuda.mem_get_info(GPU)[0]
            first.proc.kill()
            first.proc.wait(30)
            time.sleep(1.0)
            seen["freed_gib_at_kill"] = (torch.cuda.mem_get_info(GPU)[0] - free_before) / 2**30
            local = standin.allocate(len(left.kernel_block_ids))
            order = PullOrder(
                "after-kill", parse_remote(left.kv_transfer_params), local, True, time.monotonic_ns()
            )
            standin.pull([order])
            got = standin.wait({"after-kill"}, 60.0)["after-kill"]  # answered, not hung
            seen["pull_after_kill"] = "ok" if got.ok else f"failed: {got.reason}"
            if got.ok:
                torch.cuda.synchronize()
                seen["bit_exact_after_kill"] = mismatches(standin, left, local) == []
            second = _spawn_prefill(work, "prefill-b", 2048)
            pull_round(standin, second, f"{name}-b", seed=22)  # bit-exact, from a fresh mapping
            mappings = _metrics(metrics_port, "kv_sidecar_peer_mappings_total")
            assert mappings == {"mapped": 2.0, "unavailable": 0.0}, mappings
    finally:
        for emu in (first, second):
            if emu is not None and emu.proc.poll() is None:
                emu.stop()
        print(json.dumps({"killed_prefill": seen}))
