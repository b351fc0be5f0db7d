"""``kv-sidecar bench soak``: pull batches for N seconds through the fault rig while faults are injected.

Faults, drawn at random per batch (after its second wave went out, so pulls are in flight): SIGKILL of the
prefill (restarted on its port and engine id, or as a new one), SIGKILL of the daemon (restarted), a graceful
daemon restart, aborts of in-flight pulls, SIGHUP reloads between waves, or none. Reports pulls, outcomes,
failures by cause, unanswered pulls, bit mismatches, canary violations (sidecar.standins.faults), and the
daemon's RSS and fd count over time, as JSON. Not a speed benchmark: the rates are for context only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from sidecar.standins.faults import BatchResult, Rig, cause_of

FAULTS = {  # name -> weight
    "none": 4,
    "prefill_kill_same": 1,
    "prefill_kill_new": 1,
    "daemon_kill": 1,
    "daemon_restart": 1,
    "aborts": 2,
    "sighup": 2,
}


def _growth(samples: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """First and last value of ``key`` in the longest-lived daemon's samples, after its first 20 %."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        by_pid.setdefault(s["daemon_pid"], []).append(s)
    if not by_pid:
        return {}
    longest = max(by_pid.values(), key=lambda ss: ss[-1]["t"] - ss[0]["t"])
    warm = [s for s in longest if s["t"] >= longest[0]["t"] + 0.2 * (longest[-1]["t"] - longest[0]["t"])]
    return {"daemon_pid": longest[0]["daemon_pid"], "span_s": round(longest[-1]["t"] - longest[0]["t"], 1),
            "after_warmup_first": warm[0][key], "after_warmup_last": warm[-1][key],
            "after_warmup_max": max(s[key] for s in warm)}


def soak(work: str, duration_s: float, *, seed: int = 1, batch: int = 32, wave: int = 8,
         log: Any = None, faults_weights: dict[str, int] | None = None) -> dict[str, Any]:
    """Run the soak in ``work`` for ``duration_s`` seconds; returns the report."""
    rng = random.Random(seed)
    rig = Rig(work)
    weights_used = dict(FAULTS if faults_weights is None else faults_weights)
    names, weights = zip(*weights_used.items(), strict=True)
    totals = Counter()
    causes: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    unanswered: list[str] = []
    mismatched: list[str] = []
    recovery: dict[str, list[float]] = {}
    samples: list[dict[str, Any]] = []
    examples: dict[str, list[str]] = {}  # cause -> up to 4 distinct reasons
    t0 = time.monotonic()
    rig.start_emulator()
    rig.start_daemon()
    rig.start_decoder()
    try:
        while time.monotonic() - t0 < duration_s:
            fault = rng.choices(names, weights)[0]
            faults[fault] += 1
            kw: dict[str, Any] = {}
            after = None
            if fault.startswith("prefill_kill"):
                kw["fault"] = rig.kill_emulator
                same = fault == "prefill_kill_same"
                after = lambda same=same: rig.restart_emulator(same=same)  # noqa: E731
            elif fault == "daemon_kill":
                kw["fault"] = rig.kill_daemon
                after = rig.start_daemon
            elif fault == "daemon_restart":
                kw["fault"] = rig.restart_daemon
            elif fault == "aborts":
                kw["abort_fraction"] = 0.3
            elif fault == "sighup":
                kw["between_waves"] = lambda _i: rig.daemon.signal(signal.SIGHUP)
            res: BatchResult = rig.batch(batch, wave=wave, fault_after_wave=2, timeout_s=60, **kw)
            if after is not None:
                after()
            if not rig.wait_ready(30):
                raise RuntimeError(f"decoder not registered again after {fault}: {rig.daemon_log()}")
            totals.update(pulls=batch, ok=res.ok, failed=len(res.failed), aborted=res.aborted)
            for reason in res.failed.values():
                c = cause_of(reason)
                causes[c] += 1
                seen = examples.setdefault(c, [])
                short = re.sub(r"(tcp|ipc)://\S+", "<address>", reason)
                if short not in seen and len(seen) < 4:
                    seen.append(short)
            unanswered += res.unanswered
            mismatched += res.mismatched
            if res.answered_after_fault_s is not None:
                recovery.setdefault(fault, []).append(round(res.answered_after_fault_s, 3))
            st = rig.daemon_stats()
            samples.append({"t": round(time.monotonic() - t0, 2), "daemon_pid": rig.daemon.proc.pid,
                            "pulls": totals["pulls"], **st})
            if log is not None:
                print(json.dumps({"t": samples[-1]["t"], "fault": fault, **res.as_dict(), **st}), file=log,
                      flush=True)
        rig.stop_writers()  # then a late write is caught however late it came
        canary = rig.canary_violations()
    finally:
        rig.close()
    elapsed = time.monotonic() - t0
    return {
        "bench": "soak",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"CPU ({os.cpu_count()} threads), {platform.machine()} (CPU twin: emulator, daemon, "
                  "decoder stand-in)",
        "duration_s": round(elapsed, 1),
        "seed": seed,
        "pulls": totals["pulls"],
        "ok": totals["ok"],
        "aborted": totals["aborted"],
        "failed": totals["failed"],
        "failures_by_cause": dict(causes),
        "failure_examples": examples,
        "unanswered": len(unanswered),
        "unanswered_ids": unanswered[:20],
        "mismatched_blocks": len(mismatched),
        "canary_violations": len(canary),
        "canary_examples": canary[:20],
        "fault_weights": weights_used,
        "faults": dict(faults),
        "answered_after_fault_s": {k: {"max": max(v), "median": sorted(v)[len(v) // 2]}
                                   for k, v in recovery.items()},
        "daemon_rss": _growth(samples, "rss"),
        "daemon_fds": _growth(samples, "fds"),
        "samples": samples,
        "pulls_per_s": round(totals["pulls"] / elapsed, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kv-sidecar bench soak", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="pulls per batch")
    ap.add_argument("--out", help="also write the JSON report here")
    ap.add_argument("--progress", action="store_true", help="one JSON line per batch on stderr")
    ap.add_argument("--faults", default="", help="weights, e.g. 'none=4,aborts=2,sighup=2' (default: "
                    + ",".join(f"{k}={v}" for k, v in FAULTS.items()) + ")")
    args = ap.parse_args(argv)
    weights = None
    if args.faults:
        weights = {k: int(v) for k, v in (item.split("=") for item in args.faults.split(","))}
        unknown = set(weights) - set(FAULTS)
        if unknown:
            ap.error(f"--faults: unknown fault(s) {sorted(unknown)}; known: {sorted(FAULTS)}")
    with tempfile.TemporaryDirectory(prefix="kv-sidecar-soak-") as work:
        report = soak(work, args.duration, seed=args.seed, batch=args.batch,
                      log=sys.stderr if args.progress else None, faults_weights=weights)
    report["command"] = " ".join(["kv-sidecar bench soak", *(argv if argv is not None else sys.argv[1:])])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    held = report["unanswered"] == 0 and report["canary_violations"] == 0 and report["mismatched_blocks"] == 0
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
