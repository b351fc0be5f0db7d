"""``kv-sidecar doctor``: check a live node end to end and print a pass/fail table (``--json`` for scripts).

Checks, in order: the config loads; the daemon answers Ping on its socket, and over its completion socket;
/healthz and /readyz; vLLM's caches are registered; each prefill's side channel answers vLLM's handshake, and
the page-format negotiation the daemon would make with it (plan or refusal, with the reason); then one test
pull from a prefill emulator (started here unless one is given) by a NIXL agent of our own, with
``UCX_LOG_LEVEL=info`` captured to show which UCX transports carry the bytes (a warning when only tcp does).
The exit code is 1 when any check fails.

Doctor never writes into the decoder's cache: the test pull reads into its own buffer.

Size: one check per function, in the order they run; splitting them would scatter one table's rows. The
test pull's NIXL probe and its subprocess live in ``sidecar.ops.doctor_pull``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import msgspec

from sidecar.ops.doctor_pull import EMULATOR_SPEC, run_probe
from sidecar.wire.formats import PageFormat

Status = Literal["pass", "warn", "fail", "skip"]
SYSTEMD_ENV_FILES = ("/etc/kv-sidecar/kv-sidecar.env", "/etc/kv-sidecar/{gpu}.env")
SYSTEMD_CONFIG = "/etc/kv-sidecar/kv-sidecar.toml"
# UCX transports that move bulk data without the tcp stack.
ZERO_COPY = (
    "cma",
    "knem",
    "xpmem",
    "posix",
    "sysv",
    "cuda_ipc",
    "rocm_ipc",
    "rc",
    "dc",
    "ud",
    "gdr_copy",
    "cuda_copy",
    "rocm_copy",
)


class DoctorCheck(msgspec.Struct, frozen=True):
    """One row of the report."""

    name: str
    status: Status
    detail: str
    data: dict[str, Any] = {}


class DoctorReport(msgspec.Struct, frozen=True):
    checks: list[DoctorCheck]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)


class Target(msgspec.Struct, frozen=True):
    """Where the daemon of one GPU is, and the config it runs with."""

    socket: str
    metrics_url: str | None
    config: Any  # sidecar.ops.config.Config
    no_metrics: str = ""  # why metrics_url is None


# ----------------------------------------------------------------------------------------- pure helpers


def exit_code(report: DoctorReport) -> int:
    return 0 if report.ok else 1


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, blank lines, optional quotes)."""
    out: dict[str, str] = {}
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                continue
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[key.strip()] = value
    return out


class Lane(msgspec.Struct, frozen=True):
    """One line of UCX's endpoint configuration: ``rma_am(tcp/lo) am(tcp/lo cma/memory) ...``."""

    scope: str  # "self", "intra-node", "inter-node" ...
    lanes: dict[str, list[str]]  # lane kind -> transports ("tcp", "cma", "rc_mlx5" ...)


_UCX_CFG = re.compile(r"UCX\s+INFO\s+\S+\s+(?P<scope>[\w-]+)\s+cfg#\d+\s+(?P<lanes>.*)$")
_UCX_LANE = re.compile(r"(\w+)\(([^)]*)\)")


def parse_ucx_lanes(log: str) -> list[Lane]:
    """The endpoint configurations UCX logs at info level (``ucp_worker.c ... cfg#N ...``)."""
    out = []
    for line in log.splitlines():
        m = _UCX_CFG.search(line)
        if m is None:
            continue
        lanes = {
            kind: [t.split("/")[0] for t in body.split()] for kind, body in _UCX_LANE.findall(m["lanes"])
        }
        out.append(Lane(scope=m["scope"], lanes=lanes))
    return out


def judge_transports(lanes: list[Lane]) -> tuple[Status, str]:
    """Warn when the bulk lanes (rma, am) of the peer endpoints move bytes over tcp only."""
    peers = [ln for ln in lanes if ln.scope != "self"]
    if not peers:
        return "warn", "UCX logged no endpoint configuration (UCX_LOG_LEVEL=info had no effect?)"
    shown = "; ".join(
        f"{ln.scope}: " + " ".join(f"{k}({' '.join(v)})" for k, v in ln.lanes.items()) for ln in peers
    )
    bulk = {t for ln in peers for kind, ts in ln.lanes.items() if kind.startswith(("rma", "am")) for t in ts}
    fast = {t for t in bulk if t.startswith(ZERO_COPY)}
    if not fast:
        return "warn", f"tcp fallback: bulk data moves over {sorted(bulk) or 'nothing'} only ({shown})"
    return "pass", f"{', '.join(sorted(fast))} ({shown})"


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition (enough for the gauges doctor reads)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        if "{" in name:
            continue
        try:
            out[name] = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return out


def prefill_addresses(
    explicit: Iterable[str], remotes: Iterable[Any], daemon_peers: Iterable[str]
) -> list[str]:
    """host:port of each prefill to check: given ones, config rules without wildcards, the daemon's peers."""
    out: list[str] = []
    for addr in [
        *explicit,
        *(r.match for r in remotes if not any(c in r.match for c in "*?[")),
        *daemon_peers,
    ]:
        if addr not in out:
            out.append(addr)
    return out


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"prefill address {address!r} must be host:port")
    return host.strip("[]"), int(port)


# ----------------------------------------------------------------------------------------------- checks


def load_target(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[Target | None, DoctorCheck]:
    from sidecar.ops import config as config_mod

    overrides: dict[str, Any] = {} if args.gpu is None else {"gpu": args.gpu}
    if args.socket:
        overrides["socket"] = args.socket
    try:
        cfg = config_mod.load(args.config, environ=environ, overrides=overrides)
    except config_mod.ConfigError as exc:
        return None, DoctorCheck("config", "fail", str(exc))
    url: str | None = None
    no_metrics = ""
    if args.metrics_url:
        url = args.metrics_url.rstrip("/")
    elif cfg.http_port < 0:
        no_metrics = "metrics endpoint disabled (metrics_port = -1)"
    elif cfg.http_port == 0:  # the daemon bound a free port, which only its ready line says
        no_metrics = ("metrics_port = 0: the daemon serves on a free port (its ready line says which); give "
                      "--metrics-url")
    else:
        url = cfg.local_metrics_url  # as the daemon reads it: 9464 + N for GPU N unless metrics_port is set
    target = Target(socket=cfg.socket_endpoint, metrics_url=url, config=cfg, no_metrics=no_metrics)
    where = args.config or environ.get("KV_SIDECAR_CONFIG") or "defaults and KV_SIDECAR_* variables"
    shown = url or ("disabled" if cfg.http_port < 0 else "on a free port")
    return target, DoctorCheck(
        "config",
        "pass",
        f"{where}: socket {target.socket}, metrics {shown}, "
        f"{len(cfg.remotes)} remote rule(s)",
    )


def check_daemon(socket_endpoint: str, timeout_s: float) -> tuple[list[DoctorCheck], Any]:
    """Ping → Pong over the daemon socket, then Status → StatusReply when the protocol has it."""
    from sidecar.ops import control
    from sidecar.wire import protocol

    path = socket_endpoint.removeprefix("ipc://")
    directory = os.path.dirname(path) or "."
    local = socket_endpoint.startswith("ipc://")
    if local and os.path.isdir(directory) and not os.access(directory, os.X_OK):
        return [
            DoctorCheck(
                "daemon",
                "fail",
                f"cannot enter {directory} (permission denied): run doctor as the daemon's user or root",
            )
        ], None
    if local and not os.path.exists(path):
        return [
            DoctorCheck(
                "daemon",
                "fail",
                f"{path} does not exist: is kv-sidecar running for this GPU "
                "(systemctl status kv-sidecar@N / the pod's kv-sidecar container)?",
            )
        ], None
    if local and not os.access(path, os.W_OK):  # ZMQ would retry the refused connect silently
        return [
            DoctorCheck(
                "daemon",
                "fail",
                f"cannot open {path} (permission denied): run doctor as the daemon's user, a member of "
                "its socket_group, or root",
            )
        ], None
    conn = control.DaemonConnection(socket_endpoint)
    try:
        nonce = control.new_nonce()
        t0 = time.perf_counter()
        reply = conn.request(protocol.Ping(nonce=nonce, sent_at_ns=time.monotonic_ns()), timeout_s)
        if not isinstance(reply, protocol.Pong) or reply.nonce != nonce:
            return [DoctorCheck("daemon", "fail", f"{socket_endpoint} answered Ping with {reply!r}")], None
        checks = [
            DoctorCheck(
                "daemon", "pass", f"Pong from {socket_endpoint} in {(time.perf_counter() - t0) * 1e3:.1f} ms"
            )
        ]
        try:
            status = control.ask_status(conn, timeout_s)
        except control.StatusNotServed as exc:
            # a daemon older than Status cannot decode it: the rows that need it skip, as without caches
            why = f"the daemon does not answer Status (older than this doctor): {exc.reason}"
            checks.append(DoctorCheck("daemon status", "skip", why))
            return checks, None
        except control.UnexpectedReply as exc:
            checks.append(DoctorCheck("daemon status", "fail", f"Status answered with {exc.reply!r}"))
            return checks, None
        return checks, status
    except TimeoutError:
        return [
            DoctorCheck(
                "daemon",
                "fail",
                f"no reply from {socket_endpoint} within {timeout_s:g} s: the socket "
                "file exists but no daemon answers (stale socket, or the daemon is stuck)",
            )
        ], None
    except Exception as exc:  # noqa: BLE001 - any failure is a finding, never a crash
        return [DoctorCheck("daemon", "fail", f"{socket_endpoint}: {type(exc).__name__}: {exc}")], None
    finally:
        conn.close()


def check_completion_socket(socket_endpoint: str, timeout_s: float) -> DoctorCheck:
    """Hello as a shim would, bind the completion socket the daemon offers, and get a Pong over it."""
    import socket as socket_mod

    import zmq

    from sidecar.ops.control import new_nonce
    from sidecar.wire import protocol

    name = "completion socket"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    routing_id = b"doctor-" + os.urandom(6).hex().encode()
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    fast = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_SEQPACKET)
    fast.settimeout(timeout_s)
    try:
        sock.connect(socket_endpoint)
        sock.send(protocol.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION,
                                                 package_version="doctor")))
        welcome = _recv(sock, protocol, timeout_s)
        if not isinstance(welcome, protocol.Welcome):
            return DoctorCheck(name, "fail", f"Hello answered with {welcome!r}")
        path = welcome.completion_socket
        if not path:
            return DoctorCheck(name, "skip", "not offered (fast_completions = false): replies go over ZMQ")
        fast.connect(path)
        fast.send(protocol.encode(protocol.BindCompletions(routing_id=routing_id)))
        bound = protocol.decode_to_shim(fast.recv(65536))
        if not isinstance(bound, protocol.CompletionsBound) or not bound.ok:
            return DoctorCheck(
                name, "warn", f"{path} refused the binding ({bound!r}): shims fall back to ZMQ"
            )
        nonce = new_nonce()
        t0 = time.perf_counter()
        sock.send(protocol.encode(protocol.Ping(nonce=nonce)))
        pong = protocol.decode_to_shim(fast.recv(65536))
        if not isinstance(pong, protocol.Pong) or pong.nonce != nonce:
            return DoctorCheck(name, "warn", f"Ping answered over {path} with {pong!r}")
        return DoctorCheck(name, "pass", f"Pong over {path} in {(time.perf_counter() - t0) * 1e3:.2f} ms")
    except (OSError, TimeoutError) as exc:
        # the shim falls back to ZMQ on the same trouble: slower completions, nothing lost
        return DoctorCheck(name, "warn", f"{type(exc).__name__}: {exc}; shims fall back to ZMQ")
    except Exception as exc:  # noqa: BLE001 - any failure is a finding, never a crash
        return DoctorCheck(name, "fail", f"{type(exc).__name__}: {exc}")
    finally:
        fast.close()
        sock.close(0)
        ctx.term()


def _recv(sock: Any, protocol: Any, timeout_s: float) -> Any:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError
    return protocol.decode_to_shim(sock.recv())


def _get(url: str, timeout_s: float) -> tuple[int, str]:
    from sidecar.ops.healthcheck import open_local  # the daemon's own endpoint: never through a proxy

    try:
        with open_local(url, timeout_s) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def check_health(
    url: str | None, timeout_s: float, why_none: str = "metrics endpoint disabled (metrics_port = -1)"
) -> tuple[list[DoctorCheck], dict[str, float]]:
    if url is None:
        return [DoctorCheck("health", "skip", why_none)], {}
    checks, gauges = [], {}
    for path in ("/healthz", "/readyz"):
        try:
            code, body = _get(url + path, timeout_s)
        except OSError as exc:
            checks.append(DoctorCheck(path, "fail", f"{url}{path}: {exc}"))
            continue
        checks.append(DoctorCheck(path, "pass" if code == 200 else "fail", f"{code} {body.strip()}"))
    try:
        _, text = _get(url + "/metrics", timeout_s)
        gauges = parse_metrics(text)
    except OSError:
        pass
    return checks, gauges


def check_caches(status: Any, gauges: dict[str, float]) -> DoctorCheck:
    if status is not None:
        if not status.registered:
            return DoctorCheck(
                "caches",
                "fail",
                "no caches registered: vLLM with the SidecarConnector has not "
                "registered its KV cache with this daemon",
            )
        return DoctorCheck(
            "caches",
            "pass",
            f"{_size(status.registered_bytes)} in {status.num_layers} layers, {_fmt(status.page_format)}",
            {"page_format": msgspec.to_builtins(status.page_format)},
        )
    if "kv_sidecar_registered_bytes" in gauges:
        nbytes = gauges["kv_sidecar_registered_bytes"]
        if nbytes <= 0:
            return DoctorCheck(
                "caches", "fail", "kv_sidecar_registered_bytes is 0: vLLM has not registered its cache"
            )
        return DoctorCheck("caches", "pass", f"{_size(nbytes)} registered (from /metrics)")
    return DoctorCheck(
        "caches", "fail", "cannot tell: the daemon reports no status and /metrics is unreachable"
    )


def check_reload(status: Any) -> DoctorCheck | None:
    """The daemon's latest SIGHUP: a warning when it was refused (the daemon runs an older config than its
    file, and a restart would meet the same file) or left keys that only a restart applies."""
    if status is None or not status.pid:
        return None  # no status, or a daemon older than reload reports
    last = status.reload
    if last is None:
        return DoctorCheck("reload", "pass", f"no SIGHUP since PID {status.pid} started")
    if last.outcome == "refused":
        return DoctorCheck("reload", "warn", f"SIGHUP #{last.count} was refused, the daemon runs its older "
                           f"config: {last.reason}")
    if last.restart_pending:
        return DoctorCheck("reload", "warn", f"{', '.join(last.restart_pending)} changed in the file; only a "
                           "restart applies them")
    done = f"applied {', '.join(last.applied)}" if last.applied else "nothing to apply"
    return DoctorCheck("reload", "pass", f"SIGHUP #{last.count}: {done}")


def check_read_path(cfg: Any) -> DoctorCheck:
    """How the daemon reads pulls with this config: a warning where they read direct on a GPU."""
    from sidecar.ops import config as config_mod

    slow = config_mod.direct_reads(cfg)
    if slow is not None:
        return DoctorCheck("read path", "warn", slow)
    pool = f"a {_size(cfg.staging_bytes)} staging pool" if cfg.staging_bytes else "no staging pool"
    return DoctorCheck("read path", "pass", f"pull_mode {cfg.pull_mode!r}, {pool}")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt(fmt: PageFormat | None) -> str:
    if fmt is None:
        return "no page format"
    return (
        f"{fmt.kind} {fmt.layout} {fmt.dtype} heads={fmt.num_heads} block={fmt.block_size} "
        f"head_size={fmt.head_size}"
    )


class PrefillTP(msgspec.Struct, frozen=True):
    """How this decoder rank reads one prefill, from the daemon's Status: the decoder's TP size and rank
    (its shim's Hello), the prefill's TP size and the ranks of it the daemon has admitted (``ranks`` empty:
    the prefill is not one the daemon lists; then it is checked as a prefill at the decoder's TP)."""

    local_tp: int = 1
    local_rank: int = 0
    remote_tp: int | None = None
    ranks: tuple[int, ...] = ()


def prefill_tp(status: Any) -> tuple[PrefillTP, dict[str, PrefillTP]]:
    """The decoder's TP (for any prefill) and, per address the daemon lists, that prefill's TP and ranks."""
    if status is None:
        return PrefillTP(), {}
    mine = PrefillTP(local_tp=status.tp_size, local_rank=status.tp_rank)
    out: dict[str, PrefillTP] = {}
    for peer in status.peers:
        seen = out.get(peer.address)
        if seen is not None and seen.remote_tp != peer.tp_size:
            continue  # two engines at one address at other TPs: the first listed is checked
        ranks = tuple(sorted({*(seen.ranks if seen else ()), peer.tp_rank}))
        out[peer.address] = msgspec.structs.replace(mine, remote_tp=peer.tp_size, ranks=ranks)
    return mine, out


def check_prefill(
    address: str,
    cfg: Any,
    local: PageFormat | None,
    layers: int,
    factors: Mapping[str, Any] | None,
    timeout_s: float,
    tp: PrefillTP | None = None,
) -> list[DoctorCheck]:
    """vLLM's handshake with one prefill, then the admission the daemon would make of each rank it reads
    (``sidecar.nixl.port.admit_rank``: at another TP, against this decoder rank's head slice). ``factors``:
    the decoder's registered hash factors, None when unknown (no status from the daemon)."""
    from sidecar.daemon.peers import admission_for
    from sidecar.daemon.port import PeerTarget
    from sidecar.nixl import errors
    from sidecar.nixl.port import admit_rank
    from sidecar.wire import prefill as vllm_wire

    tp = tp or PrefillTP()
    remote_tp = tp.local_tp if tp.remote_tp is None else tp.remote_tp
    ranks = tp.ranks or (0,)
    name = f"prefill {address}"
    try:
        host, port = split_address(address)
        replies = vllm_wire.fetch_handshake(host, port, [(0, r) for r in ranks], timeout_s=timeout_s)
    except (vllm_wire.HandshakeTimeout, vllm_wire.HandshakeDropped, vllm_wire.WireError, ValueError) as exc:
        return [DoctorCheck(name, "fail", f"side channel: {exc}")]
    except Exception as exc:  # noqa: BLE001
        return [DoctorCheck(name, "fail", f"side channel: {type(exc).__name__}: {exc}")]
    reply = replies[(0, ranks[0])]
    meta = reply.metadata
    hetero = remote_tp != tp.local_tp
    where = (
        f", ranks {', '.join(map(str, ranks))} of TP {remote_tp} (decoder rank {tp.local_rank} of TP "
        f"{tp.local_tp})"
        if hetero or len(ranks) > 1
        else ""
    )
    checks = [
        DoctorCheck(
            name,
            "pass",
            f"engine {meta.engine_id}, {meta.attn_backend_name}, {meta.kv_cache_layout}, "
            f"block {meta.block_size}, {meta.num_regions} regions, rtt {reply.rtt_s * 1e3:.1f} ms{where}",
        )
    ]
    neg = f"negotiation {address}"
    if local is None:
        return [
            *checks,
            DoctorCheck(
                neg,
                "skip",
                "the decoder's page format is unknown (no caches registered, or the "
                "daemon reports no status; --local-format gives it)",
            ),
        ]
    # The same admission the daemon's handshake makes (sidecar.daemon.peers, sidecar.nixl.port).
    admission = admission_for(cfg, address, local, layers or meta.num_regions, factors or {})
    if factors is None:  # unknown here, not empty: the identity cannot be checked
        admission = msgspec.structs.replace(admission, check_identity=False)
    mem_type = "DRAM" if cfg.gpu is None else "VRAM"
    plan = None
    for rank in ranks:
        target = PeerTarget(
            engine_id=replies[(0, rank)].metadata.engine_id,
            tp_rank=rank,
            host=host,
            port=port,
            remote_tp=remote_tp,
            local_tp=tp.local_tp,
            local_rank=tp.local_rank,
        )
        try:
            plan, _, _ = admit_rank(target, admission, replies[(0, rank)], mem_type)
        except errors.RemoteRefused as exc:
            which = f" (prefill rank {rank})" if len(ranks) > 1 else ""
            return [
                *checks,
                DoctorCheck(
                    neg,
                    "fail",
                    f"refused on {exc.field}: {exc.reason}{which}",
                    {"field": exc.field, "reason": exc.reason, "rank": rank},
                ),
            ]
    assert plan is not None
    what = (
        f"convert {plan.remote.kind} {plan.remote.layout} -> {plan.local.kind} {plan.local.layout}"
        if plan.convert
        else f"plain read of {plan.remote.kind} {plan.remote.layout} pages"
    )
    if hetero:
        what += f" (heads of prefill TP {remote_tp} read by decoder rank {tp.local_rank} of TP {tp.local_tp})"
    note = ""
    if not cfg.verify_model_identity:
        note = " (model identity not checked: verify_model_identity = false)"
    elif not admission.check_identity:
        note = " (model identity not checked: the decoder's hash factors are unknown)"
    return [
        *checks,
        DoctorCheck(
            neg,
            "pass" if admission.check_identity or not cfg.verify_model_identity else "warn",
            what + note,
            {"convert": plan.convert},
        ),
    ]


# --------------------------------------------------------------------------------------------- test pull


def check_test_pull(args: argparse.Namespace, env: Mapping[str, str]) -> list[DoctorCheck]:
    if args.no_pull:
        return [DoctorCheck("test pull", "skip", "--no-pull")]
    emulator = None
    control, spec = args.emulator_control, None
    if not control:
        from sidecar.standins.emulator_control import ControlError, spawn_emulator

        try:
            emulator = spawn_emulator(
                EMULATOR_SPEC.emulator_args(),
                timeout_s=60,
                env=dict(env),
            )
        except ControlError as exc:
            return [DoctorCheck("test pull", "fail", f"could not start the prefill emulator: {exc}")]
        control, spec = emulator.ready.control, EMULATOR_SPEC
    try:
        result, log = run_probe(control, spec, args.timeout, env)
    finally:
        if emulator is not None:
            emulator.stop()
    source = "emulator started by doctor" if emulator is not None else f"emulator at {control}"
    if not result.ok:
        return [DoctorCheck("test pull", "fail", f"{source}: {result.reason}")]
    rate = result.nbytes / result.seconds if result.seconds else 0.0
    verified = "bytes verified" if result.verified else "bytes not verified (emulator's seed unknown)"
    checks = [
        DoctorCheck(
            "test pull",
            "pass",
            f"{source}: {_size(result.nbytes)} in {result.seconds * 1e3:.1f} ms "
            f"({_size(rate)}/s), {verified}, completion notification received",
            {"bytes": result.nbytes, "seconds": result.seconds, "verified": result.verified},
        )
    ]
    status, detail = judge_transports(parse_ucx_lanes(log))
    checks.append(DoctorCheck("UCX transports", status, detail))
    return checks


# ------------------------------------------------------------------------------------------------ driver


def diagnose(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> DoctorReport:
    env = dict(os.environ if environ is None else environ)
    unit_config = getattr(args, "unit_config", None)
    if unit_config is not None:  # the unit's Environment=, which its EnvironmentFile=s override
        env.setdefault("KV_SIDECAR_CONFIG", unit_config)
    checks: list[DoctorCheck] = []
    for path in args.env_file or []:
        try:
            env.update(read_env_file(path))
            checks.append(DoctorCheck(f"env {path}", "pass", "loaded"))
        except OSError as exc:
            checks.append(DoctorCheck(f"env {path}", "fail", str(exc)))
    target, check = load_target(args, env)
    checks.append(check)
    if target is None:
        return DoctorReport(checks)
    daemon_checks, status = check_daemon(target.socket, args.timeout)
    checks += daemon_checks
    if all(c.status == "pass" for c in daemon_checks):
        checks.append(check_completion_socket(target.socket, args.timeout))
    health, gauges = check_health(target.metrics_url, args.timeout, target.no_metrics)
    checks += health
    checks.append(check_caches(status, gauges))
    reloaded = check_reload(status)
    if reloaded is not None:
        checks.append(reloaded)
    checks.append(check_read_path(target.config))
    local = status.page_format if status is not None else None
    if args.local_format:
        local = msgspec.json.decode(args.local_format, type=PageFormat)
    layers = status.num_layers if status is not None else 0
    factors = status.compat_factors if status is not None else None
    peers = [p.address for p in status.peers] if status is not None else []
    mine, listed = prefill_tp(status)
    addresses = prefill_addresses(args.prefill or [], target.config.remotes, peers)
    if not addresses:
        checks.append(
            DoctorCheck(
                "prefills", "skip", "none to check: give --prefill HOST:PORT (config rules are patterns)"
            )
        )
    for address in addresses:
        checks += check_prefill(
            address, target.config, local, layers, factors, args.timeout, listed.get(address, mine)
        )
    checks += check_test_pull(args, env)
    return DoctorReport(checks)


DESCRIPTION = (
    "Check a live node end to end: config, daemon socket, /healthz and /readyz, registered caches, the read "
    "path, each prefill's side channel and the page-format negotiation with it, the UCX transports, and one "
    "test pull from a prefill emulator. Exit code 1 when a check fails."
)
STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def render(report: DoctorReport, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="kv-sidecar doctor", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for c in report.checks:
        table.add_row(c.name, f"[{STYLE[c.status]}]{c.status.upper()}[/]", c.detail)
    console.print(table)
    failed = [c.name for c in report.checks if c.status == "fail"]
    console.print(f"[bold red]FAIL[/]: {', '.join(failed)}" if failed else "[green]all checks passed[/]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--gpu", type=int, default=None, help="GPU whose daemon to check (socket gpuN.sock, metrics 9464+N)")
    a(
        "--config",
        default=None,
        help=f"the daemon's TOML file (default: $KV_SIDECAR_CONFIG; with --gpu, {SYSTEMD_CONFIG} if present)",
    )
    a(
        "--env-file",
        action="append",
        default=None,
        metavar="FILE",
        help="read KEY=VALUE settings as systemd does (default with --gpu N: /etc/kv-sidecar/kv-sidecar.env "
        "and "
        "/etc/kv-sidecar/N.env when present)",
    )
    a("--socket", default="", help="the daemon's socket, e.g. ipc:///run/kv-sidecar/gpu0.sock")
    a("--metrics-url", default="", help="the daemon's HTTP endpoint, e.g. http://127.0.0.1:9464")
    a(
        "--prefill",
        action="append",
        metavar="HOST:PORT",
        help="a prefill's side channel to check (repeatable)",
    )
    a(
        "--local-format",
        default="",
        metavar="JSON",
        help="the decoder's page format, when the daemon cannot report it",
    )
    a(
        "--emulator-control",
        default="",
        metavar="ENDPOINT",
        help="control endpoint of a running prefill emulator for the test pull (default: start one)",
    )
    a("--no-pull", action="store_true", help="skip the test pull")
    a("--timeout", type=float, default=3.0, help="seconds per network step (default %(default)s)")
    a("--json", action="store_true", help="print the report as JSON")


def _default_env_files(gpu: int | None) -> list[str]:
    if gpu is None:
        return []
    return [p.format(gpu=gpu) for p in SYSTEMD_ENV_FILES if os.path.exists(p.format(gpu=gpu))]


def run(args: argparse.Namespace, *, out: Callable[[str], None] | None = None) -> int:
    # With --gpu N on a systemd host, read what kv-sidecar@N reads (deploy/systemd/kv-sidecar@.service).
    if args.env_file is None:
        args.env_file = _default_env_files(args.gpu)
    systemd_host = args.gpu is not None and os.path.exists(SYSTEMD_CONFIG)
    if args.config is None and systemd_host:
        args.unit_config = SYSTEMD_CONFIG
    report = diagnose(args)
    if args.json:
        text = json.dumps({"ok": report.ok, "checks": msgspec.to_builtins(report.checks)}, indent=2)
        (out or print)(text)
    else:
        render(report)
    return exit_code(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-sidecar doctor", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
