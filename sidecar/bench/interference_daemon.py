"""``kv-sidecar bench interference --source daemon``: the real daemon converting pulled requests.

Per setting, fresh processes: a prefill emulator (``--keep-bytes``, pages on the decoder's device), one
``kv-sidecar serve`` configured by the setting (its config keys; MPS through its environment), and the
decoder (``interference_decoder``): decode steps in a loop plus the shim's worker half, registered with the
daemon, pulling requests that arrive as a Poisson process. First each context's pulls alone (the decoder
idle), then a baseline of steps without pulls, each (context, rate) cell, and a closing baseline. The first
answered pull of every phase is checked bit for bit against the emulator's pages.

On one GPU the emulator's pages sit on that GPU too: the daemon's NIXL reads of them are device-to-device
copies that share the GPU with the decode steps as well as the conversions (a real prefill is on another
GPU or host: its reads would use the link, not this GPU's copy engines alone).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from sidecar.bench import interference_stats as st
from sidecar.bench.e2e_common import BenchError, daemon_settings
from sidecar.bench.interference_decoder import Alone, DecoderConfig, PhaseReply, Ready, RunPhase, shape_of
from sidecar.bench.interference_roles import Setting

MODULE = "sidecar.bench.interference_decoder"


class DaemonPlan(msgspec.Struct, frozen=True):
    """A setting as the real daemon runs it: its extra config keys (raw TOML values) and MPS cap."""

    setting: str
    config: dict[str, str]
    mps: bool
    mps_percent: int
    decoder_high_priority: bool


def daemon_plan(s: Setting, slice_us: float) -> DaemonPlan:
    """How ``s`` applies to a ``kv-sidecar serve`` process; settings it has no key for are refused."""
    if s.max_ctas or s.slice_gap_us:
        what = "a grid cap (max_ctas)" if s.max_ctas else "paced slices (slice_gap_us)"
        raise ValueError(f"setting {s.name!r}: {what} applies only to conversions launched by the bench "
                         "(--source launch); the daemon has no config key for it")
    cfg = {}
    if s.max_slice_pairs:
        cfg["conversion_max_step_delay_us"] = repr(float(slice_us))
    return DaemonPlan(setting=s.name, config=cfg, mps=s.mps, mps_percent=s.mps_percent,
                      decoder_high_priority=s.decoder_high_priority)


_CELL = re.compile(r"(\d+):([\d.]+(?:,[\d.]+)*)")


def parse_cells(text: str) -> list[tuple[int, float]]:
    """``"4096:0,10,20 16384:0,10"`` -> [(4096, 10.0), (4096, 20.0), (16384, 10.0)]: context:rates groups,
    blank-separated; rate 0 is the baseline every group measures anyway, so it is dropped."""
    out: list[tuple[int, float]] = []
    for item in text.split():
        m = _CELL.fullmatch(item)
        if m is None or int(m.group(1)) < 1:
            raise ValueError(f"--cells: {item!r} is not CONTEXT:RATE[,RATE...] (e.g. 4096:0,10,50)")
        for r in m.group(2).split(","):
            if float(r) > 0:
                out.append((int(m.group(1)), float(r)))
    if not text.split():
        raise ValueError("--cells: empty")
    return out


def analyse(reply: PhaseReply, base: dict[str, float], base_mean_s: float) -> dict[str, Any]:
    """One phase's numbers (ms): steps against the baseline, steps overlapping a pull in flight, pulls."""
    durs = [e - s for s, e in reply.steps]
    ok = [p for p in reply.pulls if p.ok]
    busy = [(p.sent, p.done) for p in reply.pulls if p.done]
    hit = st.collided(reply.steps, busy)
    q = st.quantiles_ms(durs)
    mean_s = sum(durs) / len(durs) if durs else math.nan
    stages: dict[str, list[float]] = {}
    for p in ok:
        for k, v in p.timings.items():
            stages.setdefault(k, []).append(v)
    return {
        "step": q,
        "step_p50_ratio": st.ratio(q["p50"], base["p50"]),
        "step_p99_ratio": st.ratio(q["p99"], base["p99"]),
        "collided": {"count": int(sum(hit)),
                     **st.quantiles_ms([d for d, h in zip(durs, hit, strict=True) if h])},
        "conversions": len(ok),
        "pulls": {"answered": len(reply.pulls), "ok": len(ok), "failed": len(reply.pulls) - len(ok),
                  "unanswered": reply.unanswered, "sent_late": reply.sent_late, "not_sent": reply.not_sent,
                  "emulator_full": reply.emulator_full,
                  "failures": sorted({p.reason for p in reply.pulls if not p.ok})[:5],
                  "emulator_errors": reply.emulator_errors},
        "conversion_e2e": st.quantiles_ms([p.done - p.sent for p in ok]),
        "arrival_to_done": st.quantiles_ms([p.done - p.arrival for p in ok]),
        "daemon_stages": {k: st.quantiles_ms(v) for k, v in sorted(stages.items())},
        "interference_ms_per_conversion": st.interference_per_conversion_ms(base_mean_s, mean_s, len(durs),
                                                                            len(ok)),
        "verified": msgspec.to_builtins(reply.verified),
    }


def problems(result: dict[str, Any]) -> list[str]:
    """What makes a daemon-source run fail: a group that broke, a pull that failed or got no answer, a phase
    whose first answered request was not checked or not bit-exact."""
    out = [f"{g['settings']}: {g['error']}" for g in result["groups"] if "error" in g]
    for g in result["groups"]:
        for p in g.get("phases", []):
            where = f"{p['setting']} {p['context']} @ {p['rate']:g}/s"
            n = p["pulls"]
            if n["failed"] or n["unanswered"] or n["not_sent"] or n["emulator_errors"]:
                out.append(f"{where}: pulls {n}")
            v = p["verified"]
            if not v or v["requests"] != 1 or v["mismatches"]:
                out.append(f"{where}: bit-exact check {v}")
    return out


def _ucx_env(cuda: bool) -> dict[str, str]:
    env = {"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
           "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
           "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "warn")}
    if cuda:
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    return env


def run_group(args: argparse.Namespace, device: str, plan: DaemonPlan, cells: list[tuple[int, float]],
              mps_ctl: Any, t_start: float, extra: dict[str, str]) -> dict[str, Any]:
    """One setting: its own emulator, daemon and decoder; alone pulls, baselines and every cell. ``extra``:
    ``--daemon-set``'s keys, under the setting's own."""
    from sidecar.bench.e2e_roles import start_daemon
    from sidecar.bench.interference import Child
    from sidecar.standins.decoder import StandinShape
    from sidecar.standins.emulator_control import spawn_emulator

    cuda = device != "cpu"
    s = shape_of(args.tiny)
    contexts = sorted({c for c, _ in cells})
    slot_blocks = -(-max(contexts) // s.block_size)
    remote_fmt = StandinShape(layers=s.layers, heads=s.kv_heads, head_size=s.head_size,
                              block_size=s.block_size).remote_fmt
    env = {**os.environ, **_ucx_env(cuda), **(mps_ctl.env() if mps_ctl is not None else {})}
    work = Path(tempfile.mkdtemp(prefix="kv-sidecar-interf-"))
    emu = daemon = dec = None
    g: dict[str, Any] = {"settings": [plan.setting], "mps": plan.mps, "mps_percent": plan.mps_percent,
                         "daemon_config": plan.config, "phases": []}
    try:
        emu = spawn_emulator([
            "--device", device, "--layers", str(s.layers), "--heads", str(s.kv_heads),
            "--head-size", str(s.head_size), "--block-size", str(s.block_size), "--dtype", "bfloat16",
            "--num-blocks", str(2 * args.pull_slots * slot_blocks + 1), "--lease", "600", "--keep-bytes",
            "--seed", str(args.seed), "--control", f"ipc://{work}/emu.sock"], 180.0, env)
        denv = {**env, **(mps_ctl.env(plan.mps_percent) if mps_ctl is not None and plan.mps_percent else {})}
        staging = args.pull_slots * slot_blocks * remote_fmt.page_bytes * s.layers
        daemon = start_daemon(work, "daemon", remote_fmt=remote_fmt,
                              gpu=int(device.split(":")[1]) if cuda else None, mode=args.pull_mode,
                              staging_bytes=staging, env=denv, log_path=work / "daemon.log",
                              settings={"max_inflight": str(max(8, args.pull_slots)),
                                        **extra, **plan.config})
        cfg = DecoderConfig(device=device, tiny=args.tiny, batch=args.batch, context_min=args.context_min,
                            context_max=args.context_max, seed=args.seed, socket=daemon.socket,
                            emulator_control=emu.ready.control, compat_factors=dict(emu.ready.compat_factors),
                            emulator_seed=args.seed, max_context=max(contexts), pull_slots=args.pull_slots,
                            timeout_s=args.pull_timeout_s, verify_layers=args.verify_layers)
        dec = Child("decoder", msgspec.to_builtins(cfg), env, module=MODULE)
        ready = msgspec.convert(dec.recv(), Ready)
        g["daemon_mode_line"] = _mode_line(work / "daemon.log")
        if not ready.registered:
            raise RuntimeError(f"the decoder did not register its caches with the daemon: {ready.reason}")
        if not ready.attention_rel_err < 0.05:  # also catches NaN: the step must compute real attention
            raise RuntimeError(
                f"the decode step's attention is off from torch's by {ready.attention_rel_err}")
        g.update(attention_rel_err=ready.attention_rel_err, kv_bytes_per_step=ready.kv_bytes_per_step)
        g["alone"] = {}
        g["alone_ms"] = {plan.setting: {}}
        g["alone_ms_is"] = ("median Pull->Done of pulls one at a time with the decoder idle (read, convert "
                            "and Done; an upper bound of the conversion's GPU time)")
        for c in contexts:
            dec.send(Alone(context=c, reps=args.alone_reps))
            rep = msgspec.convert(dec.recv(), PhaseReply)
            ok = [p for p in rep.pulls if p.ok]
            g["alone"][str(c)] = {"pull_to_done": st.quantiles_ms([p.done - p.sent for p in ok]),
                                  "ok": len(ok), "requests": args.alone_reps}
            g["alone_ms"][plan.setting][str(c)] = g["alone"][str(c)]["pull_to_done"]["p50"]

        def baseline(tag: str) -> dict[str, float]:
            dec.send(RunPhase(seconds=args.phase_s, high_priority=plan.decoder_high_priority))
            q = st.quantiles_ms([e - b for b, e in msgspec.convert(dec.recv(), PhaseReply).steps])
            g[tag] = q
            return q

        base = baseline("baseline")
        seed = args.seed
        for c, r in cells:
            if time.monotonic() - t_start + args.phase_s + 2 > args.budget_s:
                g.setdefault("skipped_phases", []).append([plan.setting, c, r])
                continue
            seed += 1
            dec.send(RunPhase(seconds=args.phase_s, context=c, rate=r, seed=seed,
                              high_priority=plan.decoder_high_priority))
            res = analyse(msgspec.convert(dec.recv(), PhaseReply), base, base["mean"] * 1e-3)
            g["phases"].append({"setting": plan.setting, "context": c, "rate": r, **res})
            _print_phase(g["phases"][-1])
        baseline("baseline_end")
    except Exception as exc:  # noqa: BLE001 - a group that fails is recorded; the next one still runs
        g["error"] = f"{type(exc).__name__}: {exc}"
        g["daemon_log_tail"] = _tail(work / "daemon.log")
        print(f"setting {plan.setting}: {g['error']}", flush=True)
    finally:
        for part, close in ((dec, "close"), (daemon, "stop"), (emu, "stop")):
            if part is None:
                continue
            with contextlib.suppress(Exception):
                getattr(part, close)()
        shutil.rmtree(work, ignore_errors=True)
    return g


def _mode_line(log: Path) -> str:
    """The line the daemon logged at start about how its conversions share the GPU."""
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if "conversions:" in line:
                return line[line.index("conversions:"):]
    return ""


def _tail(log: Path, n: int = 20) -> list[str]:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace").splitlines()[-n:]
    return []


def _print_phase(p: dict[str, Any]) -> None:
    v = p["verified"] or {}
    print(f"{p['setting']:>14} {p['context']:>6} {p['rate']:>5g}/s  step p50 {p['step']['p50']:.3f} "
          f"p99 {p['step']['p99']:.3f} max {p['step']['max']:.3f} ms (x{p['step_p50_ratio']:.3f}, "
          f"x{p['step_p99_ratio']:.3f})  collided {p['collided']['count']}/{p['step']['n']}  pulls "
          f"{p['pulls']['ok']}/{p['pulls']['answered']} ok, Pull->Done p99 "
          f"{p['conversion_e2e']['p99']:.3f} ms"
          f"  bit-exact {'yes' if v.get('requests') and not v.get('mismatches') else 'NO'}", flush=True)


def run(args: argparse.Namespace, device: str, table: dict[str, Setting], names: list[str],
        out: dict[str, Any], t_start: float) -> None:
    """Every setting's group under the daemon source, appended to ``out["groups"]``."""
    from sidecar.convert.gpu_share import MpsControl, mps_available

    try:
        plans = [daemon_plan(table[n], args.slice_us) for n in names]
        cells = parse_cells(args.cells) if args.cells else [
            (int(c), float(r)) for c in args.contexts.split(",") if c for r in args.rates.split(",")
            if r and float(r) > 0]
        extra = daemon_settings(args.daemon_set)
    except (ValueError, BenchError) as exc:
        raise SystemExit(str(exc)) from None
    out["cells"] = cells
    for plan in plans:
        if plan.mps and (device == "cpu" or not mps_available()):
            out["groups"].append({"settings": [plan.setting], "skipped": "MPS needs an NVIDIA GPU and "
                                  "nvidia-cuda-mps-control"})
            continue
        if time.monotonic() - t_start + 3 * args.phase_s > args.budget_s:
            out["groups"].append({"settings": [plan.setting],
                                  "skipped": f"--budget-s {args.budget_s:g} spent"})
            continue
        mps_ctl = MpsControl() if plan.mps else None
        try:
            if mps_ctl is not None:
                mps_ctl.start()
            out["groups"].append(run_group(args, device, plan, cells, mps_ctl, t_start, extra))
        finally:
            if mps_ctl is not None:
                mps_ctl.quit()
