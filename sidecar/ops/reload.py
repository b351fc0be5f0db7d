"""``kv-sidecar reload``: make a running daemon re-read its config (SIGHUP) and say whether it applied.

A bare ``kill -HUP`` cannot fail: a refused reload (a typo in the TOML file, a value that does not hold
together with the running ones) is only a line in the daemon's log while the daemon keeps its older config.
This command asks the daemon's ``Status`` how many SIGHUPs it has had, sends one, and waits until the daemon
reports a reload whose read began after it. It prints the outcome and exits 1 when the reload was refused, 2
when it could not be asked for or confirmed, so ``systemctl reload kv-sidecar@N`` (``ExecReload=``) fails
with why.

The daemon is found as ``serve`` finds its socket: ``--gpu``, ``--config``/``$KV_SIDECAR_CONFIG``, the
``KV_SIDECAR_*`` variables, ``--socket``. A config file that does not load is what a reload would refuse,
so then the socket comes from the variables and flags alone, and the daemon's own answer says why. The
socket and the GPU apply only at a restart, so an edited file may name another daemon's socket: without
``--pid``, the daemon that answers must serve that GPU and read that file (its ``Status`` says), or it is
not signalled.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgspec

from sidecar.wire import protocol as p

POLL_S = 0.02  # between Status asks while waiting for the reload (it runs on the daemon's loop: ms)
RESTART_ONLY = ("if `socket` or `gpu` (which names the default socket) changed since the daemon started, "
                "the socket found is another daemon's: both apply only at a restart; give the daemon's "
                "--socket, or restart it")


class ReloadFailed(Exception):
    """The reload could not be asked for or confirmed; the text says why (exit 2)."""


class ReloadTarget(NamedTuple):
    """The daemon ``reload`` means: where to ask it, and what its ``Status`` must say to be that one."""

    endpoint: str
    gpu: int | None  # the GPU it serves (--gpu, the variables, the file); None: not said
    config_file: str  # the file it reads on SIGHUP (absolute); "": not said
    note: str  # when the config file did not load and was left out


def target_of(args: argparse.Namespace, environ: Mapping[str, str]) -> ReloadTarget:
    from sidecar.ops import config as config_mod

    overrides: dict[str, Any] = {} if args.gpu is None else {"gpu": args.gpu}
    if args.socket:
        overrides["socket"] = args.socket
    try:
        cfg, note = config_mod.load_to_find(args.config, environ=environ, overrides=overrides)
    except config_mod.ConfigError as exc:
        raise ReloadFailed(f"configuration: {exc}") from None
    path = args.config or environ.get("KV_SIDECAR_CONFIG") or ""
    return ReloadTarget(cfg.socket_endpoint, cfg.gpu, os.path.abspath(path) if path else "", note)


def another_daemon(status: p.StatusReply, gpu: int | None, config_file: str) -> str:
    """How the daemon that answered is not the one meant; "" when it is (or it does not say: older). Both
    fields came in one release, so a daemon that says its device says its file too: "" there means none."""
    if gpu is not None and status.device and status.device != f"cuda:{gpu}":
        return f"serves {status.device}, not GPU {gpu}"
    if config_file and status.device and not status.config_file:
        return f"reads no config file, not {config_file}"
    if config_file and status.config_file and not _same_file(config_file, status.config_file):
        return f"reads {status.config_file}, not {config_file}"
    return ""


def _same_file(a: str, b: str) -> bool:
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)  # one path through a symlink, say
    except OSError:
        return False


def ask_status(conn: Any, timeout_s: float) -> p.StatusReply:
    """One ``Status`` → ``StatusReply`` over ``conn`` (a ``control.DaemonConnection``); ReloadFailed when
    none comes."""
    import zmq

    from sidecar.ops import control

    endpoint = conn.endpoint
    path = endpoint.removeprefix("ipc://")
    if endpoint.startswith("ipc://") and not os.path.exists(path):
        raise ReloadFailed(f"{path} does not exist: is kv-sidecar running for this GPU?")
    try:
        return control.ask_status(conn, timeout_s)
    except control.NoReply:
        raise ReloadFailed(f"no reply from {endpoint} within {timeout_s:g} s (a stale socket, or the "
                           "daemon is stuck)") from None
    except p.DecodeError as exc:
        raise ReloadFailed(f"{endpoint} answered with something that is not a StatusReply: {exc}") from None
    except zmq.ZMQError as exc:
        raise ReloadFailed(f"{endpoint}: {exc}") from None
    except control.StatusNotServed as exc:
        raise ReloadFailed("the daemon does not answer Status (older than this command): "
                           f"{exc.reason}") from None
    except control.UnexpectedReply as exc:
        raise ReloadFailed(f"{endpoint} answered Status with {type(exc.reply).__name__}") from None


def reload(
    endpoint: str,
    pid: int | None,
    timeout_s: float,
    *,
    gpu: int | None = None,
    config_file: str = "",
    kill: Callable[[int, int], None] = os.kill,
    ask: Callable[[str, float], p.StatusReply] | None = None,
) -> p.ReloadStatus:
    """SIGHUP the daemon serving ``endpoint`` and wait for its outcome. It must be ``pid`` when given, else
    serve ``gpu`` and read ``config_file`` where both sides say (see ``another_daemon``). Every ``Status`` of
    the wait goes over one socket: the daemon sees one session, not one per ask."""
    meant = (pid, gpu, config_file)
    if ask is not None:
        return _signal_and_wait(endpoint, meant, timeout_s, kill, ask)
    from sidecar.ops import control

    with control.DaemonConnection(endpoint) as conn:
        over_conn = lambda _endpoint, wait_s: ask_status(conn, wait_s)
        return _signal_and_wait(endpoint, meant, timeout_s, kill, over_conn)


def _signal_and_wait(
    endpoint: str,
    meant: tuple[int | None, int | None, str],
    timeout_s: float,
    kill: Callable[[int, int], None],
    ask: Callable[[str, float], p.StatusReply],
) -> p.ReloadStatus:
    before = ask(endpoint, min(timeout_s, 5.0))
    if before.pid == 0:
        raise ReloadFailed("the daemon does not report reloads (older than this command): use kill -HUP and "
                           "read its log")
    pid, gpu, config_file = meant
    if pid is not None and before.pid != pid:
        raise ReloadFailed(f"{endpoint} is served by PID {before.pid}, not PID {pid}: not signalled "
                           f"({RESTART_ONLY})")
    other = another_daemon(before, gpu, config_file) if pid is None else ""  # a PID said which one it is
    if other:
        raise ReloadFailed(f"{endpoint} is served by PID {before.pid}, which {other}: not signalled "
                           f"({RESTART_ONLY})")
    seen = before.sighups  # ours is a later one: wait for an outcome read after it
    try:
        kill(before.pid, signal.SIGHUP)
    except OSError as exc:  # EPERM: another user (socket_group reaches the socket); ESRCH: it just exited
        raise ReloadFailed(f"cannot signal PID {before.pid}: {exc.strerror}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        now = ask(endpoint, max(0.1, deadline - time.monotonic()))
        if now.pid != before.pid:
            raise ReloadFailed(f"the daemon at {endpoint} restarted (PID {before.pid} → {now.pid}) before it "
                               "reported the reload")
        if now.reload is not None and now.reload.count > seen:
            return now.reload
        if time.monotonic() >= deadline:  # its loop answers Status: neither stuck nor too busy for a SIGHUP
            if now.sighups <= seen:
                raise ReloadFailed(f"PID {before.pid} did not take the SIGHUP within {timeout_s:g} s: it is "
                                   "shutting down (SIGHUP is ignored then)")
            raise ReloadFailed(f"PID {before.pid} took the SIGHUP but reported no outcome within "
                               f"{timeout_s:g} s: its read of the config file has not returned, or it is "
                               "shutting down (see its log)")
        time.sleep(POLL_S)


def describe(outcome: p.ReloadStatus) -> list[str]:
    """The lines to print for a reload's outcome."""
    if outcome.outcome == "applied":
        lines = [f"reload applied: {', '.join(outcome.applied)}"]
    elif outcome.outcome == "unchanged":
        lines = ["reload: nothing to apply (no live key changed)"]
    else:
        lines = [f"reload refused, the daemon keeps its running config: {outcome.reason}"]
    if outcome.restart_pending:
        pending = ", ".join(outcome.restart_pending)
        lines.append(f"changed in the file but applied only by a restart: {pending}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--gpu", type=int, default=None, help="GPU whose daemon to reload (socket gpuN.sock)")
    a("--config", default=None, help="the daemon's TOML file (default: $KV_SIDECAR_CONFIG)")
    a("--socket", default="", help="the daemon's socket, e.g. ipc:///run/kv-sidecar/gpu0.sock")
    a("--pid", type=int, default=None,
      help="signal only if this PID serves the socket (systemd: --pid $MAINPID); default: the PID it "
      "reports, when that daemon serves this GPU and reads this config file")
    a("--timeout", type=float, default=10.0, help="seconds to wait for the outcome (default %(default)s)")
    a("--json", action="store_true", help="print the outcome as JSON")


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
        out: Callable[[str], None] = print) -> int:
    """0: applied or nothing to apply; 1: refused; 2: not asked for or not confirmed."""
    env = os.environ if environ is None else environ
    try:
        target = target_of(args, env)
        if target.note:
            print(target.note, file=sys.stderr)
        outcome = reload(target.endpoint, args.pid, args.timeout, gpu=target.gpu,
                         config_file=target.config_file)
    except ReloadFailed as exc:
        if args.json:
            out(json.dumps({"ok": False, "error": str(exc)}))
        else:
            print(f"kv-sidecar reload: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out(json.dumps({"ok": outcome.outcome != "refused", **msgspec.to_builtins(outcome)}))
    else:
        for line in describe(outcome):
            out(line)
    return 1 if outcome.outcome == "refused" else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar reload", description=__doc__.split("\n\n")[1])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
