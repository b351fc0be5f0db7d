"""``kv-sidecar demo``: the whole loop on one machine, no GPU, in seconds.

It starts a prefill emulator (stock vLLM's side channel and NIXL agent, standard pages) and the daemon
(``kv-sidecar serve``, CPU twin) as real subprocesses, and acts itself as the decoder: shared-memory K/V
planes in AITER's shuffled layout, driven through the vLLM shim's worker half. Concurrent requests are pulled
end to end; every converted block is checked bit for bit against the reference conversion of the pages the
prefill holds; the prefill must have freed every request's blocks; the daemon's metrics must agree. Exit
status 0 only if all is well.
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
    a("--heads", type=int, default=2, help="KV heads")
    a("--head-size", type=int, default=128, choices=(64, 128, 256))
    a("--block-size", type=int, default=16, choices=(16, 32))
    a("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    a(
        "--pull-mode",
        default="direct",
        choices=("direct", "staged"),
        help="direct: half pages into the planes, converted in place; staged: whole pages via a staging pool",
    )
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=30.0, help="per-request deadline in seconds")
    a("--json", action="store_true", help="print the summary as one JSON object instead of a table")
    a("--keep", action="store_true", help="keep the work directory (logs, config) for inspection")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    from sidecar.cli import CliError

    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="kv-sidecar-demo-")
    emulator = daemon = None
    out: dict[str, Any] = {}
    try:
        emulator, daemon = _start(args, work)
        out = _drive(args, emulator, daemon)
    except (CliError, RuntimeError, OSError) as exc:
        out = {"error": str(exc)}
    finally:
        errors = _stop(emulator, daemon)
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
    """The decoder's cache of the demo's model, ``num_blocks`` blocks."""
    from sidecar.standins.decoder import StandinShape

    return StandinShape(
        layers=args.layers,
        heads=args.heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=num_blocks,
        dtype=args.dtype,
    )


def remote_format(args: argparse.Namespace) -> PageFormat:
    """The prefill's pages: vLLM's standard LBHNC of the demo's model."""
    return standin_shape(args).remote_fmt


def daemon_config(args: argparse.Namespace, socket: str, staging_bytes: int) -> str:
    """The daemon's TOML: loopback prefills declared as standard pages (vLLM publishes no page-format tag)."""
    f = remote_format(args)
    lines = [
        f'socket = "{socket}"',
        "metrics_port = 0",
        'log_level = "WARNING"',
        f'pull_mode = "{args.pull_mode}"',
    ]
    if args.pull_mode == "staged":
        lines.append(f"staging_bytes = {staging_bytes}")
    lines += [
        "",
        "[[remotes]]",
        'match = "127.0.0.1:*"',
        f'page_format = {{kind = "{f.kind}", layout = "{f.layout}", dtype = "{f.dtype}", '
        f"num_heads = {f.num_heads}, block_size = {f.block_size}, head_size = {f.head_size}}}",
    ]
    return "\n".join(lines) + "\n"


def _start(args: argparse.Namespace, work: str) -> tuple[Any, Any]:
    """Emulator and daemon, started side by side (each imports NIXL: seconds)."""
    from sidecar.cli import spawn_serve
    from sidecar.standins.emulator_control import spawn_emulator

    blocks_per_request = -(-args.max_tokens // args.block_size)
    prefill_blocks = max(64, 2 * args.requests * blocks_per_request)
    page = remote_format(args).page_bytes
    config = os.path.join(work, "kv-sidecar.toml")
    with open(config, "w") as f:
        f.write(
            daemon_config(args, f"ipc://{work}/cpu.sock", staging_bytes=args.layers * page * prefill_blocks)
        )
    emu_args = [
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
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
    log = open(os.path.join(work, "daemon.log"), "wb")  # noqa: SIM115 - the daemon writes it until it stops
    # One host: NIXL over UCX on loopback (tcp + cma), quiet logs (environment.md).
    env = {
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "error"),
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        emu_f = pool.submit(spawn_emulator, emu_args, 60.0, env)
        dmn_f = pool.submit(spawn_serve, ["--config", config], timeout_s=60.0, env=env, stderr=log)
        emulator = daemon = None
        try:
            emulator = emu_f.result()
            daemon = dmn_f.result()
        except BaseException:
            _stop(emulator, daemon if daemon is not None else _result_or_none(dmn_f))
            if emulator is None:
                _stop(_result_or_none(emu_f), None)
            raise
    log.close()
    return emulator, daemon


def _result_or_none(fut: concurrent.futures.Future) -> Any:
    try:
        return fut.result()
    except BaseException:
        return None


def _stop(emulator: Any, daemon: Any) -> list[str]:
    errors = []
    for name, proc in (("daemon", daemon), ("emulator", emulator)):
        if proc is None:
            continue
        try:
            proc.stop(10.0)
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            errors.append(f"{name}: {exc}")
    return errors


# ------------------------------------------------------------------------------------------- the loop


def _drive(args: argparse.Namespace, emulator: Any, daemon: Any) -> dict[str, Any]:
    from sidecar.standins.decoder import DecoderStandin, run_session, summarize

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
