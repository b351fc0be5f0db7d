"""``kv-sidecar demo``: the whole loop on one machine, no GPU, in seconds.

It starts a prefill emulator (stock vLLM's side channel and NIXL agent, standard pages) and the daemon
(``kv-sidecar serve``, CPU twin) as real subprocesses, and acts itself as the decoder: shared-memory K/V
planes in AITER's shuffled layout, driven through the vLLM shim's worker half. Concurrent requests are pulled
end to end; every converted block is checked bit for bit against the reference conversion of the pages the
prefill holds; the prefill must have freed every request's blocks; the daemon's metrics must agree. Exit
status 0 only if all is well. ``--prefill-tp`` / ``--decoder-tp`` run the two sides at unequal TP: the
emulator serves one NIXL agent per prefill rank, and there is one daemon and one stand-in rank per decoder
rank, each holding its head slice.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from typing import TYPE_CHECKING, Any

from sidecar.wire.formats import PageFormat

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.standins.decoder import StandinShape

STAGES = ("queue", "handshake", "transfer", "convert", "end_to_end", "shim_round_trip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--requests", type=int, default=32, help="requests to pull (default %(default)s)")
    a("--concurrency", type=int, default=0, help="pulls in flight at once (default: all)")
    a(
        "--max-tokens",
        type=int,
        default=256,
        help="prompt lengths are drawn from 1..this (default %(default)s)",
    )
    a("--layers", type=int, default=4)
    a("--heads", type=int, default=2, help="the model's KV heads (split over each side's TP)")
    a("--prefill-tp", type=int, default=1, help="prefill TP ranks (default %(default)s)")
    a("--decoder-tp", type=int, default=1, help="decoder TP ranks: one daemon each (default %(default)s)")
    a("--head-size", type=int, default=128, choices=(64, 128, 256))
    a("--block-size", type=int, default=16, choices=(16, 32))
    a("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    a(
        "--pull-mode",
        default="auto",
        choices=("auto", "direct", "staged"),
        help="auto (as deploy/kv-sidecar.toml): staged through a staging pool sized for every request; "
        "direct: half pages into the planes, converted in place; staged: as auto, asked for by name",
    )
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=30.0, help="per-request deadline in seconds")
    a("--json", action="store_true", help="print the summary as one JSON object instead of a table")
    a("--keep", action="store_true", help="keep the work directory (logs, config) for inspection")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    from sidecar.cli import CliError

    started = time.monotonic()
    for side in ("prefill_tp", "decoder_tp"):
        tp = getattr(args, side)
        if tp < 1 or args.heads % tp:
            flag = "--" + side.replace("_", "-")
            print(f"{flag} {tp} must be >= 1 and divide --heads {args.heads}", file=sys.stderr)
            return 2
    work = tempfile.mkdtemp(prefix="kv-sidecar-demo-")
    emulator = None
    daemons: list[Any] = []
    out: dict[str, Any] = {}
    try:
        emulator, daemons = _start(args, work)
        out = _drive(args, emulator, daemons)
    except (CliError, RuntimeError, OSError) as exc:
        out = {"error": str(exc)}
    finally:
        errors = _stop(emulator, *daemons)
        if errors:
            out.setdefault("cleanup_errors", errors)
        if args.keep:
            out["work_dir"] = work
        else:
            shutil.rmtree(work, ignore_errors=True)
    out["wall_s"] = round(time.monotonic() - started, 2)
    ok = _verdict(out)
    out["ok_overall"] = ok
    _print(out, args.json)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# ------------------------------------------------------------------------------------------- processes


def standin_shape(args: argparse.Namespace, num_blocks: int = 256) -> StandinShape:
    """One decoder rank's cache of the demo's model (its share of the heads), ``num_blocks`` blocks."""
    from sidecar.standins.decoder import StandinShape

    return StandinShape(
        layers=args.layers,
        heads=args.heads // getattr(args, "decoder_tp", 1),
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=num_blocks,
        dtype=args.dtype,
    )


def remote_format(args: argparse.Namespace) -> PageFormat:
    """One prefill rank's pages: vLLM's standard LBHNC of the demo's model, its share of the heads."""
    import msgspec

    heads = args.heads // getattr(args, "prefill_tp", 1)
    return msgspec.structs.replace(standin_shape(args).remote_fmt, num_heads=heads)


def daemon_config(args: argparse.Namespace, socket: str, staging_bytes: int) -> str:
    """The daemon's TOML: loopback prefills declared as standard pages (vLLM publishes no page-format tag)."""
    f = remote_format(args)
    lines = [
        f'socket = "{socket}"',
        "metrics_port = 0",
        'log_level = "WARNING"',
        f'pull_mode = "{args.pull_mode}"',
    ]
    if args.pull_mode != "direct":
        lines.append(f"staging_bytes = {staging_bytes}")
    lines += [
        "",
        "[[remotes]]",
        'match = "127.0.0.1:*"',
        f'page_format = {{kind = "{f.kind}", layout = "{f.layout}", dtype = "{f.dtype}", '
        f"num_heads = {f.num_heads}, block_size = {f.block_size}, head_size = {f.head_size}}}",
    ]
    return "\n".join(lines) + "\n"


def _start(args: argparse.Namespace, work: str) -> tuple[Any, list[Any]]:
    """Emulator and daemons (one per decoder rank), started side by side (each imports NIXL: seconds)."""
    from sidecar.cli import spawn_serve
    from sidecar.standins.emulator_control import spawn_emulator

    blocks_per_request = -(-args.max_tokens // args.block_size)
    prefill_blocks = max(64, 2 * args.requests * blocks_per_request)
    page = standin_shape(args).fmt.page_bytes  # staging slots hold one decoder rank's page
    configs = []
    for rank in range(args.decoder_tp):
        configs.append(os.path.join(work, f"kv-sidecar{rank or ''}.toml"))
        with open(configs[-1], "w") as f:
            socket = f"ipc://{work}/cpu{rank or ''}.sock"
            f.write(daemon_config(args, socket, staging_bytes=args.layers * page * prefill_blocks))
    emu_args = [
        "--tp",
        str(args.prefill_tp),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads // args.prefill_tp),
        "--head-size",
        str(args.head_size),
        "--block-size",
        str(args.block_size),
        "--num-blocks",
        str(prefill_blocks),
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
        "--control",
        f"ipc://{work}/emulator.sock",
    ]
    logs = [open(os.path.join(work, f"daemon{r or ''}.log"), "wb") for r in range(args.decoder_tp)]  # noqa: SIM115
    # One host: NIXL over UCX on loopback (tcp + cma), quiet logs.
    env = {
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "error"),
    }
    with concurrent.futures.ThreadPoolExecutor(1 + len(configs)) as pool:
        emu_f = pool.submit(spawn_emulator, emu_args, 60.0, env)
        dmn_fs = [
            pool.submit(spawn_serve, ["--config", c], timeout_s=60.0, env=env, stderr=log)
            for c, log in zip(configs, logs, strict=True)
        ]
        try:
            emulator = emu_f.result()
            daemons = [f.result() for f in dmn_fs]
        except BaseException:
            _stop(_result_or_none(emu_f), *[_result_or_none(f) for f in dmn_fs])
            raise
        finally:
            for log in logs:
                log.close()
    return emulator, daemons


def _result_or_none(fut: concurrent.futures.Future) -> Any:
    try:
        return fut.result()
    except BaseException:
        return None


def _stop(emulator: Any, *daemons: Any) -> list[str]:
    errors = []
    for name, proc in [*(("daemon", d) for d in daemons), ("emulator", emulator)]:
        if proc is None:
            continue
        try:
            proc.stop(10.0)
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            errors.append(f"{name}: {exc}")
    return errors


# ------------------------------------------------------------------------------------------- the loop


def _drive(args: argparse.Namespace, emulator: Any, daemons: list[Any]) -> dict[str, Any]:
    if args.prefill_tp != 1 or args.decoder_tp != 1:
        return _drive_tp(args, emulator, daemons)
    from sidecar.standins.decoder import DecoderStandin, run_session, summarize

    daemon = daemons[0]
    blocks_per_request = -(-args.max_tokens // args.block_size)
    wave = args.concurrency or args.requests
    shape = standin_shape(args, num_blocks=1 + max(64, wave * blocks_per_request))
    with DecoderStandin(
        daemon.socket,
        shape,
        compat_factors=dict(emulator.ready.compat_factors),
        pull_timeout_s=args.timeout,
        seed=args.seed,
    ) as standin:
        if not standin.register():
            raise RuntimeError(
                f"the daemon did not register the decoder's caches: "
                f"{standin.worker.client.status_reason if standin.worker.client else '?'}"
            )
        results = run_session(
            standin,
            emulator.client,
            requests=args.requests,
            seed=args.seed,
            remote_fmt=remote_format(args),
            tokens=(1, args.max_tokens),
            concurrency=args.concurrency,
            timeout_s=args.timeout,
        )
    summary = summarize(results)
    not_freed = []
    for r in results:
        try:
            emulator.client.wait_state(r.remote_request_id, "freed_by_notif", 5.0)
        except Exception as exc:  # noqa: BLE001 - reported, and fails the verdict
            not_freed.append(f"{r.remote_request_id}: {exc}")
    summary["prefill_not_freed"] = not_freed
    summary["metrics"] = metrics_check(daemon.metrics_url, summary)
    return summary


def _drive_tp(args: argparse.Namespace, emulator: Any, daemons: list[Any]) -> dict[str, Any]:
    """Unequal TP: one stand-in rank per daemon, every request pulled by every rank (all at once)."""
    from contextlib import ExitStack

    from sidecar.standins.decoder import DecoderStandin, run_tp_session, summarize

    blocks_per_request = -(-args.max_tokens // args.block_size)
    shape = standin_shape(args, num_blocks=1 + max(64, args.requests * blocks_per_request))
    with ExitStack() as stack:
        standins = []
        for rank, daemon in enumerate(daemons):
            s = stack.enter_context(DecoderStandin(
                daemon.socket, shape, compat_factors=dict(emulator.ready.compat_factors),
                pull_timeout_s=args.timeout, seed=args.seed, worker_rank=rank, tp_size=len(daemons),
            ))
            if not s.register():
                reason = s.worker.client.status_reason if s.worker.client else "?"
                raise RuntimeError(f"daemon {rank} did not register the decoder's caches: {reason}")
            standins.append(s)
        results = run_tp_session(standins, emulator.client, requests=args.requests, seed=args.seed,
                                 remote_fmt=remote_format(args), tokens=(1, args.max_tokens),
                                 timeout_s=args.timeout)
    summary = summarize(results)
    not_freed = []
    for rid in sorted({r.remote_request_id for r in results}):
        try:  # every prefill rank freed it (the emulator frees a request once all its ranks are done)
            emulator.client.wait_state(rid, "freed_by_notif", 5.0)
        except Exception as exc:  # noqa: BLE001 - reported, and fails the verdict
            not_freed.append(f"{rid}: {exc}")
    summary["prefill_not_freed"] = not_freed
    checks = [
        metrics_check(d.metrics_url, summarize([r for r in results if r.req_id.endswith(f"@rank{rank}")]))
        for rank, d in enumerate(daemons)
    ]
    summary["metrics"] = {
        "consistent": all(c["consistent"] for c in checks),
        "problems": [f"daemon {rank}: {p}" for rank, c in enumerate(checks) for p in c["problems"]],
        "per_daemon": checks,
    }
    return summary


# ------------------------------------------------------------------------------------------- metrics


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus /metrics page, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def metrics_check(url: str | None, summary: dict[str, Any]) -> dict[str, Any]:
    """The daemon's own account of the session, and whether it agrees with what the decoder saw."""
    if url is None:
        return {"consistent": False, "problems": ["the daemon's metrics endpoint is disabled"]}
    s = scrape(url)
    got = {
        "ok": sample(s, "kv_sidecar_requests_total", outcome="ok"),
        "failed": sum(
            sample(s, "kv_sidecar_requests_total", outcome=o)
            for o in ("failed", "refused", "aborted", "expired")
        ),
        "bytes": sample(s, "kv_sidecar_bytes_pulled_total"),
        "in_flight": sample(s, "kv_sidecar_requests_in_flight"),
        "handshakes_ok": sample(s, "kv_sidecar_handshakes_total", outcome="ok"),
        "end_to_end_count": sample(s, "kv_sidecar_stage_seconds_count", stage="end_to_end"),
        "read_modes": {m: sample(s, "kv_sidecar_read_modes_total", mode=m) for m in ("staged", "direct")},
        "staging_bytes_in_use": sample(s, "kv_sidecar_staging_bytes_in_use"),
    }
    problems = []
    if got["ok"] != summary["requests"] - summary["failed"]:
        problems.append(
            f"requests_total{{outcome=ok}} {got['ok']:g} != {summary['requests'] - summary['failed']}"
        )
    if got["failed"] != summary["failed"]:
        problems.append(f"failed outcomes {got['failed']:g} != {summary['failed']}")
    if got["bytes"] != summary["bytes"]:
        problems.append(f"bytes_pulled_total {got['bytes']:g} != {summary['bytes']}")
    if got["in_flight"] != 0:
        problems.append(f"requests_in_flight {got['in_flight']:g} after the session")
    if got["staging_bytes_in_use"] != 0:
        problems.append(f"staging_bytes_in_use {got['staging_bytes_in_use']:g} after the session")
    if got["end_to_end_count"] != summary["requests"]:
        problems.append(
            f"stage_seconds_count{{end_to_end}} {got['end_to_end_count']:g} != {summary['requests']}"
        )
    return {**got, "consistent": not problems, "problems": problems}


# ------------------------------------------------------------------------------------------- output


def _verdict(out: dict[str, Any]) -> bool:
    return (
        "error" not in out
        and not out.get("cleanup_errors")
        and out.get("requests", 0) > 0
        and out["ok"] == out["requests"]
        and not out["prefill_not_freed"]
        and out["metrics"]["consistent"]
    )


def _print(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        import json

        print(json.dumps(out))
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich ships with the daemon extra
        import json

        print(json.dumps(out, indent=2))
        return
    console = Console()
    if "error" in out:
        console.print(f"[bold red]demo failed:[/] {out['error']}")
    else:
        head = Table(title="kv-sidecar demo: prefill emulator → kv-sidecar → decoder stand-in (CPU twin)")
        for col in ("requests", "bit-exact", "failed", "wrong bytes", "MiB", "prefill freed", "metrics"):
            head.add_column(col, justify="right")
        m = out["metrics"]
        head.add_row(
            str(out["requests"]),
            str(out["ok"]),
            str(out["failed"]),
            str(out["mismatched"]),
            f"{out['bytes'] / 2**20:.1f}",
            f"{out['requests'] - len(out['prefill_not_freed'])}/{out['requests']}",
            "agree" if m["consistent"] else "[red]disagree[/]",
        )
        console.print(head)
        lat = Table(title="latency per stage (ms)")
        for col in ("stage", "p50", "p99", "n"):
            lat.add_column(col, justify="right")
        stages = out["stages"]
        for name in [*[s for s in STAGES if s in stages], *[s for s in stages if s not in STAGES]]:
            st = stages[name]
            lat.add_row(name, f"{st['p50_ms']:.2f}", f"{st['p99_ms']:.2f}", str(st["n"]))
        console.print(lat)
        for line in out["failures"][:10] + out["prefill_not_freed"][:10] + m["problems"]:
            console.print(f"[red]- {line}[/]")
    for err in out.get("cleanup_errors", []):
        console.print(f"[red]cleanup: {err}[/]")
    if "work_dir" in out:
        console.print(f"work directory kept: {out['work_dir']}")
    verdict = "[bold green]OK[/]" if out["ok_overall"] else "[bold red]FAILED[/]"
    console.print(f"{verdict} in {out['wall_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
