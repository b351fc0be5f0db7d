"""Prometheus metrics of the daemon and its HTTP endpoint (/metrics, /healthz, /readyz).

The endpoint runs in its own thread, so /healthz can tell a stuck event loop (no tick for ``stall_s``)
from a live one. Names are fixed (docs: common team map); each Metrics owns its registry, so several
daemons (tests) can live in one process.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sidecar import __version__
from sidecar.ops.errors import StartupError

OUTCOMES = ("ok", "failed", "refused", "aborted", "expired")
FP8_REENCODE_KINDS = ("saturated", "nan")
# a GPU conversion launch queued ahead behind a gate, replayed from a CUDA graph, or built in Python
LAUNCH_PATHS = ("gated", "graph", "ordinary")
READ_MODES = ("direct", "staged", "mapped", "plain")  # how a Pull's pages came (daemon/port.py ReadMode)
MAPPING_OUTCOMES = ("mapped", "unavailable")  # a prefill rank's pages mapped here, or not (daemon/mapped.py)
GAP_SPAN_WAIT_OUTCOMES = ("taken", "gave_up")  # a staged pull that waited for its gap span (staging.py)
RELOAD_OUTCOMES = ("applied", "unchanged", "refused")  # a SIGHUP's (daemon/app.py Daemon.reload)
# a handshake admitted, broken (unreachable, timed out, a bad reply, or one the transport cannot load for a
# prefill loaded already in its way: an older registration generation, an agent name taken), or answered but
# refused by this daemon's admission rules (remotes, model identity, format, geometry): an operator's choice,
# not a fault
HANDSHAKE_OUTCOMES = ("ok", "failed", "refused")
# a reply not delivered: the peer left too many unread (daemon/router.py REPLY_BACKLOG), had disconnected, or
# another send error
REPLY_DROP_REASONS = ("backlog", "gone", "error")
STAGES = ("handshake", "queue", "transfer", "convert", "signal", "end_to_end", "delivery")
# 50 µs .. ~100 s, roughly x2.5 per bucket: signal latencies and multi-second pulls both resolve.
BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    100.0,
)


class Metrics:
    """Every metric object of one daemon, registered in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kv_sidecar_requests", "Pulls answered, by outcome", ["outcome"], registry=r)
        self.bytes_pulled = Counter("kv_sidecar_bytes_pulled", "Bytes read from prefills", registry=r)
        self.gap_bytes_read = Counter(
            "kv_sidecar_gap_bytes_read",
            "Bytes of gap blocks (other requests' KV) read into staging only to merge descriptors",
            registry=r,
        )
        self.gap_span_waits = Counter(
            "kv_sidecar_gap_span_waits",
            "Staged pulls that waited for their gap span's staging slots, by outcome: taken (read with its "
            "gaps) or gave_up (the wait reached what the gaps save; read without them)",
            ["outcome"],
            registry=r,
        )
        self.stage_seconds = Histogram(
            "kv_sidecar_stage_seconds", "Seconds per stage of a pull", ["stage"], buckets=BUCKETS, registry=r
        )
        self.in_flight = Gauge(
            "kv_sidecar_requests_in_flight", "Pulls accepted and not yet answered", registry=r
        )
        self.staging_waiting = Gauge(
            "kv_sidecar_staging_waiting",
            "Staged pulls waiting in line for staging slots (served first come, first served)",
            registry=r,
        )
        self.staging_bytes = Gauge(
            "kv_sidecar_staging_bytes", "Size of the staging pool (staging_bytes; 0: none)", registry=r
        )
        self.staging_bytes_in_use = Gauge(
            "kv_sidecar_staging_bytes_in_use",
            "Staging pool bytes lent to pulls now (their pages and gap blocks), read when scraped",
            registry=r,
        )
        self.staging_slots_kept_out = Gauge(
            "kv_sidecar_staging_slots_kept_out",
            "Staging slots kept out of use for good: a READ into them could not be stopped and may still "
            "write (counted in staging_bytes_in_use too); pulls that only they would fit are read direct "
            "(pull_mode auto) or refused (staged). Above 0: restart the daemon to get them back",
            registry=r,
        )
        self.refusals = Counter(
            "kv_sidecar_refusals", "Refusals by the field that refused", ["field"], registry=r
        )
        self.heartbeats_sent = Counter(
            "kv_sidecar_heartbeats_sent", "HB: notifications sent to prefills", registry=r
        )
        self.registered_bytes = Gauge(
            "kv_sidecar_registered_bytes", "Decoder cache bytes imported and registered with NIXL", registry=r
        )
        self.handshakes = Counter(
            "kv_sidecar_handshakes",
            "Side-channel handshakes, by outcome: ok, failed (no reply, a bad one, or one that conflicts "
            "with a prefill loaded already), refused (by this daemon's admission rules)",
            ["outcome"],
            registry=r,
        )
        self.invalid_messages = Counter(
            "kv_sidecar_invalid_messages", "Socket messages that failed validation", registry=r
        )
        self.connections_refused = Counter(
            "kv_sidecar_connections_refused",
            "Completion-socket connections refused (over max_connections, or out of file descriptors)",
            registry=r,
        )
        self.replies_dropped = Counter(
            "kv_sidecar_replies_dropped",
            "Replies to a shim (or a doctor) not delivered, by reason: backlog (it left 16,384 replies "
            "unread: ZMQ's queue for it was full, or its completion socket was closed with those waiting "
            "there), gone (it had disconnected), error (another send error; the log says)",
            ["reason"],
            registry=r,
        )
        self.foreign_messages = Counter(
            "kv_sidecar_foreign_messages",
            "Messages refused because the session did not own what they named (requests, caches)",
            registry=r,
        )
        self.logs_suppressed = Counter(
            "kv_sidecar_logs_suppressed", "Log lines left out by rate limiting", registry=r
        )
        self.ready = Gauge(
            "kv_sidecar_ready", "1 when caches are registered and the NIXL agent is up", registry=r
        )
        self.fp8_reencoded = Counter(
            "kv_sidecar_fp8_reencoded_elements",
            "fp8 elements re-encoded e4m3fn -> e4m3fnuz that did not keep their value: saturated at +-240 x "
            "scale, or NaN in the prefill's page",
            ["kind"],
            registry=r,
        )
        self.conversion_launches = Counter(
            "kv_sidecar_conversion_launches",
            "GPU conversion launches by path: gated (a graph launch queued while its bytes read, let run "
            "when they landed, config conversion_gates), graph (replayed from a CUDA graph when they "
            "landed, config conversion_graphs) or ordinary (tables and launch built in Python: sliced, fp8 "
            "re-encode, a size's first)",
            ["path"],
            registry=r,
        )
        self.read_modes = Counter(
            "kv_sidecar_read_modes",
            "Pulls by how their pages were read: direct, staged, mapped (the conversion kernel read the "
            "prefill's memory itself) or plain (no conversion)",
            ["mode"],
            registry=r,
        )
        self.peer_mappings = Counter(
            "kv_sidecar_peer_mappings",
            "Prefill ranks whose pages pull_mode mapped tried to map, by outcome (unavailable: read the "
            "usual way; the daemon's log says why)",
            ["outcome"],
            registry=r,
        )
        self.mapped_peers = Gauge(
            "kv_sidecar_mapped_peers",
            "Prefill ranks whose pages are mapped now; each mapping keeps that prefill's GPU memory "
            "allocated, even after it exits, until let go (mapping_idle_s)",
            registry=r,
        )
        self.poster_busy = Gauge(
            "kv_sidecar_poster_busy_seconds",
            "How long the poster thread has been inside its NIXL call in progress (a post, a release, a "
            "notification; 0 when idle). Posts take milliseconds: one that keeps growing is a NIXL call that "
            "does not return, and every later pull waits behind it (/healthz fails past poster_stall_s)",
            registry=r,
        )
        self.gates_forced = Counter(
            "kv_sidecar_conversion_gates_forced",
            "Gated conversion launches the gate guard let run disarmed: the loop sat 5 s in a host call that "
            "waited for the GPU while they were held behind gates (config conversion_gates); each one's pull "
            "failed",
            registry=r,
        )
        self.config_reloads = Counter(
            "kv_sidecar_config_reloads",
            "SIGHUP reloads by outcome: applied (live keys changed), unchanged, or refused (the file could "
            "not be read or did not hold together; the running config is kept, the log says why)",
            ["outcome"],
            registry=r,
        )
        self.config_last_reload_ok = Gauge(
            "kv_sidecar_config_last_reload_successful",
            "0 when the latest SIGHUP was refused and the daemon runs an older config than its file; else 1",
            registry=r,
        )
        self.config_last_reload_ok.set(1)
        self.config_last_reload_time = Gauge(
            "kv_sidecar_config_last_reload_timestamp_seconds",
            "When the latest SIGHUP was handled (Unix time; 0: none since start)",
            registry=r,
        )
        self.config_restart_pending = Gauge(
            "kv_sidecar_config_restart_pending",
            "Keys the config file changed, as of the latest SIGHUP, that only a restart applies (the daemon "
            "keeps their running values)",
            registry=r,
        )
        self.build_info = Gauge("kv_sidecar_build_info", "kv-sidecar version", ["version"], registry=r)
        self.build_info.labels(version=__version__).set(1)
        # Pre-create label sets so every series exists (at 0) from the start.
        # Kept, so answering a Pull does no label lookups (about 4 µs each).
        self._requests = {outcome: self.requests.labels(outcome=outcome) for outcome in OUTCOMES}
        self._stages = {stage: self.stage_seconds.labels(stage=stage) for stage in STAGES}
        self._handshakes = {o: self.handshakes.labels(outcome=o) for o in HANDSHAKE_OUTCOMES}
        for kind in FP8_REENCODE_KINDS:
            self.fp8_reencoded.labels(kind=kind)
        self._launches = {path: self.conversion_launches.labels(path=path) for path in LAUNCH_PATHS}
        self._span_waits = {o: self.gap_span_waits.labels(outcome=o) for o in GAP_SPAN_WAIT_OUTCOMES}
        self._read_modes = {m: self.read_modes.labels(mode=m) for m in READ_MODES}
        for outcome in MAPPING_OUTCOMES:
            self.peer_mappings.labels(outcome=outcome)
        for outcome in RELOAD_OUTCOMES:
            self.config_reloads.labels(outcome=outcome)
        self._replies_dropped = {why: self.replies_dropped.labels(reason=why) for why in REPLY_DROP_REASONS}

    def answered(self, outcome: str, timings: dict[str, float] | None = None) -> None:
        """One Pull answered: count its outcome and observe its stage timings."""
        counter = self._requests.get(outcome)
        if counter is None:
            raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
        counter.inc()
        self.observe(timings or {})

    def observe(self, timings: dict[str, float]) -> None:
        """Observe a Pull's stage timings (those not in STAGES are ignored)."""
        stages = self._stages
        for stage, seconds in timings.items():
            child = stages.get(stage)
            if child is not None:
                child.observe(seconds)

    def reply_dropped(self, reason: str, count: int = 1) -> None:
        """``count`` replies not delivered, by ``REPLY_DROP_REASONS`` reason."""
        self._replies_dropped[reason].inc(count)

    def fp8_reencode(self, saturated: int, nan: int) -> None:
        """Count one conversion's flagged elements (``PlaneSet.convert``'s returned (saturated, NaN))."""
        self.fp8_reencoded.labels(kind="saturated").inc(saturated)
        self.fp8_reencoded.labels(kind="nan").inc(nan)

    def launched(self, path: str) -> None:
        """One GPU conversion launch, by ``LAUNCH_PATHS`` path."""
        self._launches[path].inc()

    def gates_forced_open(self, launches: int) -> None:
        """``launches`` gated launches let run disarmed by the gate guard (called on its thread)."""
        self.gates_forced.inc(launches)

    def read_mode(self, mode: str) -> None:
        """One Pull's read posted (or launched, mapped), by ``READ_MODES`` mode."""
        self._read_modes[mode].inc()

    def gap_span_waited(self, outcome: str) -> None:
        """A staged pull waited for its gap span's slots, by ``GAP_SPAN_WAIT_OUTCOMES`` outcome."""
        self._span_waits[outcome].inc()

    def reloaded(self, outcome: str, restart_pending: int, at_unix: float) -> None:
        """One SIGHUP handled, by ``RELOAD_OUTCOMES`` outcome."""
        if outcome not in RELOAD_OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {RELOAD_OUTCOMES}")
        self.config_reloads.labels(outcome=outcome).inc()
        self.config_last_reload_ok.set(0 if outcome == "refused" else 1)
        self.config_last_reload_time.set(at_unix)
        self.config_restart_pending.set(restart_pending)

    def refused(self, field: str) -> None:
        self.refusals.labels(field=field or "unknown").inc()

    def handshake(self, outcome: str) -> None:
        """One side-channel handshake, by ``HANDSHAKE_OUTCOMES`` outcome. Its time is the handshake stage of
        the pulls that waited for it (``observe``): observed here too, a pull that handshook would count twice
        in that stage."""
        self._handshakes[outcome].inc()

    def expose(self) -> bytes:
        return generate_latest(self.registry)


class Health:
    """What /healthz and /readyz report; the event loop calls ``tick`` and sets the readiness parts."""

    def __init__(self, stall_s: float = 5.0) -> None:
        self.stall_s = stall_s
        self.last_tick = time.monotonic()
        self.socket_bound = False
        self.agent_up = False
        self.caches_registered = False
        self.stopping = False
        self.started = False  # the daemon's start has completed: socket bound, its loops running
        self.broken: str | None = None  # a loop the daemon cannot serve without has ended (why)
        self._checks: list[Callable[[], str | None]] = []

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def mark_started(self) -> None:
        """The daemon is up: /healthz stops saying "starting" and reads the tick loop from now on."""
        self.tick()  # the tick loop spawned at the end of start has not run yet
        self.started = True

    async def beat(self, period_s: float = 0.5) -> None:
        """``tick`` every ``period_s`` for as long as the event loop runs it: a loop stuck in a call stops
        ticking (/healthz, and the conversions' gate guard, read ``last_tick``)."""
        while True:
            self.tick()
            await asyncio.sleep(period_s)

    def add_check(self, check: Callable[[], str | None]) -> None:
        """One more liveness condition: ``check`` (called from the HTTP thread) says why the daemon is not
        healthy, or None."""
        self._checks.append(check)

    def healthy(self) -> tuple[bool, str]:
        """Not until ``mark_started``: a startup probe on /healthz must not pass before the socket is bound,
        and no tick comes before the tick loop runs."""
        if self.broken is not None:
            return False, self.broken
        if not self.started:
            return False, "starting"
        age = time.monotonic() - self.last_tick
        if age > self.stall_s:
            return False, f"event loop stalled: no tick for {age:.1f} s"
        for check in self._checks:
            why = check()
            if why is not None:
                return False, why
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        missing = [
            name
            for name, ok in (
                ("socket bound", self.socket_bound),
                ("NIXL agent up", self.agent_up),
                ("caches registered", self.caches_registered),
            )
            if not ok
        ]
        if self.stopping:
            return False, "not ready: shutting down"
        return (not missing), ("ok" if not missing else "not ready, waiting for: " + ", ".join(missing))


class _ThreadingHTTPServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """The HTTP endpoint in a daemon thread; ``port`` is the bound one (useful with port 0)."""

    def __init__(self, metrics: Metrics, health: Health, host: str = "127.0.0.1", port: int = 9464) -> None:
        handler = _handler(metrics, health)
        server = _ThreadingHTTPServer6 if ":" in host else ThreadingHTTPServer  # an IPv6 address
        try:
            self._server = server((host, port), handler)
        except OSError as e:  # a busy port, an address not on this host: the operator fixes the config
            if e.errno == errno.EADDRINUSE:
                raise StartupError("metrics_port", f"cannot serve metrics on {host}:{port}: {e.strerror}. "
                                   "Pick another metrics_port (0: any free port, -1: no endpoint)") from None
            raise StartupError("metrics_host", f"cannot serve metrics on {host}:{port}: {e.strerror or e}. "
                               "Pick an address of this host (127.0.0.1, ::1, 0.0.0.0, ::)") from None
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name="kv-sidecar-metrics",
            kwargs={"poll_interval": 0.1},
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start_http_server(
    metrics: Metrics, health: Health, host: str = "127.0.0.1", port: int = 9464
) -> MetricsServer:
    """Serve /metrics, /healthz and /readyz on ``host:port`` (loopback unless configured)."""
    return MetricsServer(metrics, health, host, port)


def _handler(metrics: Metrics, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = f"kv-sidecar/{__version__}"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, metrics.expose(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, text = health.healthy()
                self._reply(200 if ok else 503, (text + "\n").encode())
            elif path == "/readyz":
                ok, text = health.ready()
                self._reply(200 if ok else 503, (text + "\n").encode())
            else:
                self._reply(404, b"not found: try /metrics, /healthz, /readyz\n")

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:  # scrapes every few seconds: keep quiet
            pass

    return Handler
