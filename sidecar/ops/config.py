"""The daemon's configuration: one msgspec Struct, from a TOML file, then KV_SIDECAR_* variables, then flags.

Every key's help text is its ``description`` in the Struct, so ``kv-sidecar serve --help`` cannot drift from
the code. Errors name the key; a wrong type names its source too (file, variable or flag).
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from sidecar.ops import settled_file
from sidecar.wire.formats import PageFormat

ENV_PREFIX = "KV_SIDECAR_"
# Variables of that prefix that are not config keys.
# KV_SIDECAR_* variables that belong to other tools (tests, benchmarks, the shim), not to the daemon's config.
ENV_NOT_KEYS = frozenset(
    {
        "KV_SIDECAR_CONFIG",
        "KV_SIDECAR_BENCH_OUT",
        "KV_SIDECAR_INTEROP_PYTHON",
        "KV_SIDECAR_INTEROP_START_TIMEOUT",
        "KV_SIDECAR_TINY_MODEL",
        "KV_SIDECAR_SHIM_LOG_LEVEL",
        "KV_SIDECAR_VLLM_WHEEL_DIR",
    }
)
DEFAULT_SOCKET_DIR = "/run/kv-sidecar"
DEFAULT_METRICS_PORT = 9464  # GPU N's daemon serves its endpoint on this + N unless metrics_port is set
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# The keys that say where a running daemon is (load_to_find keeps them from a file that does not load).
FINDING_KEYS = frozenset({"gpu", "socket", "metrics_host", "metrics_port"})
# Keys SIGHUP may change; the others need a restart.
DEFAULT_POLL_BUSY_S = 0.05  # poll_busy_s with a GPU when unset
DEFAULT_INLINE_POST_DESCRIPTORS = 128  # inline_post_max_descriptors with a GPU when unset

RELOADABLE = frozenset(
    {
        "remotes",
        "default_timeout_s",
        "max_timeout_s",
        "heartbeat_interval_s",
        "log_level",
        "pull_mode",
        "verify_model_identity",
        "handshake_timeout_s",
        "conversion_graphs",
        "conversion_gates",
        "mapping_idle_s",
        "inline_post_max_descriptors",
    }
)

PullMode = Literal["direct", "staged", "auto", "mapped"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and where it came from."""


def _doc(text: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)


class RemoteRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the operator declares about the prefills whose side channel matches ``match``."""

    match: Annotated[
        str,
        _doc(
            "host:port of the prefill's side channel, fnmatch wildcards allowed "
            "(e.g. '10.0.0.*:5600', '*:*')",
            min_length=3,
        ),
    ]
    page_format: Annotated[
        PageFormat | None,
        _doc("the page format those prefills publish (vLLM publishes no tag); without it they are refused"),
    ] = None
    convert: Annotated[bool, _doc("allow converting their pages into the decoder's format")] = True
    fp8_lossy_reencode: Annotated[
        bool,
        _doc(
            "accept an e4m3fn -> e4m3fnuz re-encode that can saturate (beyond 240 x scale) or round values; "
            "off: only the exact rule (decoder scale = 2 x prefill scale) is accepted"
        ),
    ] = False

    def __post_init__(self) -> None:
        if ":" not in self.match:
            raise ValueError(f"match {self.match!r} must be host:port (wildcards allowed)")


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """kv-sidecar serve settings."""

    gpu: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _doc("GPU index this daemon serves; unset: the CPU twin (decoder cache in /dev/shm, device cpu)"),
    ] = None
    socket: Annotated[
        str,
        _doc(
            "ZMQ endpoint for the shim, ipc:// only; default ipc:///run/kv-sidecar/gpu{N}.sock (cpu.sock "
            "without a GPU)"
        ),
    ] = ""
    socket_group: Annotated[
        str | None,
        _doc(
            "group (name or gid) allowed to use the socket (0660, dir 0750) when vLLM runs as another user; "
            "unset: owner only (0600, dir 0700)"
        ),
    ] = None
    fast_completions: Annotated[
        bool,
        _doc(
            "offer shims a SOCK_SEQPACKET completion socket beside the ZMQ one (<socket>.done, same "
            "permissions): replies skip ZMQ's I/O threads, about 60 us less per Done here (bench signal)"
        ),
    ] = True
    max_connections: Annotated[
        int,
        _doc(
            "completion-socket connections held at once (a shim needs one per TP rank); more are "
            "refused and counted, long before the process runs out of file descriptors",
            ge=1,
        ),
    ] = 64
    owner_grace_s: Annotated[
        float,
        _doc(
            "how long the caches of a shim whose completion socket closed stay registered, in case it "
            "reconnects; then its pulls fail and the memory is released",
            ge=0,
        ),
    ] = 5.0
    metrics_host: Annotated[str, _doc("address of the Prometheus / health HTTP endpoint")] = "127.0.0.1"
    metrics_port: Annotated[
        Annotated[int, msgspec.Meta(ge=-1, le=65535)] | None,
        _doc(
            "port of /metrics, /healthz, /readyz; unset: 9464 + N for GPU N (9464 without a GPU), so the "
            "daemons of one host never collide; 0 picks a free port, -1 disables the endpoint"
        ),
    ] = None
    max_inflight: Annotated[int, _doc("requests read and converted at the same time", ge=1)] = 64
    max_queued: Annotated[
        int,
        _doc(
            "requests waiting for a slot; beyond it a Pull is answered Done(ok=False, reason='overloaded')",
            ge=0,
        ),
    ] = 256
    default_timeout_s: Annotated[
        float, _doc("deadline of a Pull that carries none (seconds from its arrival)", gt=0)
    ] = 30.0
    max_timeout_s: Annotated[
        float,
        _doc(
            "the longest deadline a Pull may ask for (seconds): longer ones are clamped to it, so a stalled "
            "prefill can hold a request (and its decoder blocks) no longer than this",
            gt=0,
        ),
    ] = 600.0
    handshake_timeout_s: Annotated[float, _doc("side-channel handshake timeout per prefill rank", gt=0)] = 5.0
    pull_mode: Annotated[
        PullMode,
        _doc(
            "auto: staged when there is a pool (waiting for room) and it can hold the request, else direct; "
            "staged: whole pages into a staging pool, converted out of place (a request the pool cannot "
            "hold is refused); direct: half pages straight into the K/V planes, converted in place, two "
            "descriptors per block and layer (no extra memory, but 45-181 x slower than staged on one H200: "
            "README Performance); mapped: the conversion kernel reads the prefill's pages through a mapping "
            "of its memory (one GPU node, NVIDIA; docs/converting-read.md), and a prefill whose pages do not "
            "map is read as auto reads"
        ),
    ] = "auto"
    staging_bytes: Annotated[
        int,
        _doc(
            "size of the registered staging pool in bytes (staged/auto/mapped modes), on the daemon's GPU "
            "beside vLLM's share; 0: no pool. Size it for the pulls in flight: a request takes its KV bytes "
            "(Qwen3-8B: 144 KiB a token, 0.6 GB at 4k tokens)",
            ge=0,
        ),
    ] = 0
    layer_groups: Annotated[
        int,
        _doc(
            "READs per request and prefill rank (layer groups), so conversion can overlap the read; "
            "0 (auto): 4 for a request of at least 1 GiB, else 1 (where the two-H200 runs in "
            "bench/HISTORY.md measured a win: a lone 16k-token Qwen3-8B request, 11.6 -> 9.9 ms; "
            "4k requests were 8-9 % slower with 4 groups)",
            ge=0,
        ),
    ] = 0
    gap_coalescing: Annotated[
        bool,
        _doc(
            "staged reads: also read small gaps between a request's remote blocks into free staging "
            "slots when one more descriptor costs more than the gap's bytes (read_descriptor_us, "
            "read_gbps), so runs merge into fewer descriptors. A gap's bytes are another request's KV "
            "from the same prefill: read into staging only, never converted, never written to decoder memory"
        ),
    ] = True
    read_descriptor_us: Annotated[
        float,
        _doc(
            "cost model of a read: microseconds one more descriptor costs (measure with bench e2e's "
            "read_cost_fit; ~8 us inside NIXL's transfer() on an H200, issue 12)",
            ge=0,
        ),
    ] = 8.0
    read_gbps: Annotated[
        float,
        _doc(
            "cost model of a read: GB/s of a large contiguous read (bench e2e's read_cost_fit); the default "
            "is below the bare contiguous reads on two H200s (207-248 GB/s, bench/HISTORY.md)",
            gt=0,
        ),
    ] = 200.0
    gap_pool_share: Annotated[
        float,
        _doc(
            "the most of the staging pool (a fraction) one request's gap blocks may take; a busy pool is "
            "waited for only when the gaps save more than freeing their slots takes, and at most as long as "
            "they save (the cost model: read_descriptor_us, read_gbps)",
            ge=0,
            le=1,
        ),
    ] = 0.25
    conversion_max_step_delay_us: Annotated[
        float,
        _doc(
            "longest a conversion may hold the GPU at a time, in microseconds (0: no bound). The daemon cuts "
            "each conversion into launches that run at most this long at its measured rate, so a decode "
            "step sharing the GPU waits at most about this long for one; a request's conversion then takes "
            "longer. On an H200 without MPS 50 us slices raised the steps' p99 (x1.061 against x1.044 "
            "unbounded, 4k at 10/s), so leave it 0 there; see README 'Sharing the decoder's GPU'",
            ge=0,
        ),
    ] = 0.0
    conversion_graphs: Annotated[
        bool,
        _doc(
            "GPU: replay each conversion launch from a CUDA graph captured once per size bucket (a "
            "request of m blocks runs the bucket's grid, at most 1/8 more: out of place (staged, mapped) "
            "padding rows convert the request's first block again, in place (direct) they convert "
            "nothing), instead of building its tables and launching in Python; the first request of each "
            "bucket launches the ordinary way, and so do fp8 re-encodes and sliced conversions"
        ),
    ] = True
    conversion_gates: Annotated[
        bool,
        _doc(
            "GPU, with conversion_graphs: queue each layer group's graph launch (staged and direct) while "
            "its bytes still read, held on the GPU behind a gate (a stream memory wait on a word of pinned "
            "host memory), so that once they land the launch is one store to that word. A request whose "
            "bytes never land has its launches pointed at a scratch block before their gates open: they "
            "write nothing of the decoder's. While any gate is closed no CUDA graph is captured or made "
            "(instantiating one waits for the gated work): a size not seen before launches the ordinary "
            "way until one is; should the loop still sit 5 s in a host call that waits for the device, a "
            "guard thread points the gated launches away and opens their gates, and their pulls fail "
            "(logged as an error). Run the daemon with CUDA_MODULE_LOADING=EAGER: with lazy loading a "
            "kernel's first launch while a gate is closed holds every stream's later work behind that gate "
            "(a warning says so). Needs the driver's stream memory waits (cuStreamWaitValue32_v2); without "
            "them a warning, and off"
        ),
    ] = False
    remotes: Annotated[
        list[RemoteRule],
        _doc(
            "declared prefills, first match wins: [[remotes]] match='*:5600' convert=true "
            "page_format={kind='standard', layout='LBHNC', dtype='bfloat16', num_heads=8, block_size=16, "
            "head_size=128}"
        ),
    ] = []
    verify_model_identity: Annotated[
        bool,
        _doc(
            "refuse a prefill whose vLLM compatibility hash differs from the decoder's (recomputed with the "
            "prefill's backend name)"
        ),
    ] = True
    heartbeat_interval_s: Annotated[
        float, _doc("how often in-flight requests' prefill leases are renewed (HB: notifications)", gt=0)
    ] = 5.0
    mapping_idle_s: Annotated[
        float,
        _doc(
            "pull_mode mapped: a prefill rank's mapped pages are let go after this long without a pull (the "
            "next pull maps them again, in milliseconds); a mapping keeps the prefill's GPU memory allocated "
            "even after that prefill exits",
            gt=0,
        ),
    ] = 60.0
    lease_s: Annotated[
        float,
        _doc(
            "the prefills' kv_lease_duration; a request whose lease cannot be vouched for is failed, "
            "not read",
            gt=0,
        ),
    ] = 30.0
    lease_margin_s: Annotated[
        float, _doc("safety margin subtracted from every lease (proxy hop, clock skew)", ge=0)
    ] = 2.0
    nixl_backends: Annotated[list[str], _doc("NIXL backends of the daemon's agent", min_length=1)] = (
        msgspec.field(default_factory=lambda: ["UCX"])
    )
    nixl_progress_thread: Annotated[
        bool,
        _doc(
            "run NIXL's progress thread in the daemon's agent. NIXL's Python API makes it spin without pause "
            "(about half a core even when idle); the daemon only initiates reads and drives them itself by "
            "polling, so it is off by default"
        ),
    ] = False
    nixl_num_threads: Annotated[
        int,
        _doc(
            "UCX worker threads of the daemon's NIXL agent (the UCX backend's num_threads, as vLLM sets it): "
            "with N > 0 a READ's descriptors are posted by N threads in parallel instead of inside the "
            "poster thread's transfer() call; 0 keeps UCX's single worker",
            ge=0,
        ),
    ] = 0
    poll_busy_s: Annotated[
        Annotated[float, msgspec.Meta(ge=0)] | None,
        _doc(
            "while READs or GPU conversions are in flight, poll them pass after pass (yielding to the "
            "loop, no timer) for this long after the last pass that saw one land; then every "
            "poll_interval_s. Costs up to a core while requests are in flight, nothing when idle; 0: "
            "timer only; unset: 0.05 with a GPU, 0 on the CPU twin (there the spinning loop takes the "
            "GIL and cores from the conversion thread and the prefill: slower, measured)"
        ),
    ] = None
    inline_post_max_descriptors: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _doc(
            "a staged read of at most this many descriptors (estimated as layers x runs of consecutive "
            "prefill blocks), when it is the daemon's only pull and the poster thread is idle, is posted on "
            "the event loop itself: it spares the two thread hand-offs of a post (~0.28 ms on the H200 "
            "host) and holds the loop for the post (~0.5 ms at 36 descriptors); 0: always on the poster "
            "thread; unset: 128 with a GPU, 0 on the CPU twin (there the transport copies inside the post)"
        ),
    ] = None
    poll_linger_s: Annotated[
        float,
        _doc(
            "once nothing is in flight, keep the poll loop passing (no sleep) this long after the last "
            "change, so a Pull arriving within it finds the loop's core awake with its caches. On one H200 "
            "host 3 s took a lone 4k pull's daemon time from 1.3 to 0.9-1.07 ms in one run and changed "
            "nothing in another, nor a lone staged pull on an H100 (README). Costs up to a core for that "
            "long after each burst, nothing once idle; 0: sleep at once",
            ge=0,
        ),
    ] = 0.0
    gil_switch_interval_us: Annotated[
        float,
        _doc(
            "the interpreter's GIL switch interval while the daemon runs (CPython's default is 5000): how "
            "long a thread that wants the GIL waits for the one holding it, e.g. the poster thread back from "
            "NIXL's transfer() while the loop polls, or the loop while the poster builds descriptors",
            gt=0,
        ),
    ] = 500.0
    poll_interval_s: Annotated[
        float,
        _doc(
            "how often in-flight NIXL transfers and GPU events are polled once poll_busy_s has passed "
            "without progress (uvloop timers have millisecond resolution)",
            gt=0,
        ),
    ] = 0.001
    shutdown_grace_s: Annotated[
        float, _doc("on SIGTERM/SIGINT, how long in-flight requests may finish before they are failed", ge=0)
    ] = 10.0
    poster_stall_s: Annotated[
        float,
        _doc(
            "/healthz fails once the poster thread has been inside one NIXL call (a post, a release, a "
            "notification) this long: every later pull waits behind it, and only a restart frees it (the "
            "shim fails the loads of a daemon that exits, and nothing can write once its process is gone)",
            gt=0,
        ),
    ] = 60.0
    loop_pieces: Annotated[
        str,
        _doc(
            "a benchmark's diagnostic: a file to write the thread CPU and wall time per call of the "
            "daemon's pieces to (receipt, pairing, the post and its parts, launch and its parts, answer, "
            "notify, poll; sidecar/ops/pieces.py), every 10 s and at exit. Each timed call costs a few µs "
            "more; read at start only; \"\": off"
        ),
    ] = ""
    loop_pieces_slow_us: Annotated[
        float,
        _doc(
            "with loop_pieces: calls and garbage collections of at least this many µs are also kept one by "
            "one, with their start and thread, in the file's .slow.json (what held the loop while a Pull "
            "waited; python -m sidecar.bench.overlay); read at start only",
            gt=0,
        ),
    ] = 500.0
    log_json: Annotated[bool, _doc("log one JSON object per line instead of text")] = False
    log_level: Annotated[LogLevel, _doc("DEBUG, INFO, WARNING or ERROR")] = "INFO"

    @property
    def poll_busy_window_s(self) -> float:
        """``poll_busy_s``, or its default for the device."""
        if self.poll_busy_s is not None:
            return self.poll_busy_s
        return DEFAULT_POLL_BUSY_S if self.gpu is not None else 0.0

    @property
    def inline_post_limit(self) -> int:
        """``inline_post_max_descriptors``, or its default for the device."""
        if self.inline_post_max_descriptors is not None:
            return self.inline_post_max_descriptors
        return DEFAULT_INLINE_POST_DESCRIPTORS if self.gpu is not None else 0

    def __post_init__(self) -> None:
        if self.socket and not self.socket.startswith("ipc://"):
            raise ValueError(f"socket {self.socket!r} must be an ipc:// endpoint (local sockets only)")
        n = len(self.socket_path.encode())
        if n > MAX_UNIX_PATH:
            raise ValueError(f"socket path is {n} bytes, a unix socket path may have at most "
                             f"{MAX_UNIX_PATH}: "
                             f"{self.socket_path}")
        for key in self.__struct_fields__:  # TOML and float() take inf: no key of ours means it
            value = getattr(self, key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} must be finite, got {value}")
        if not self.metrics_host:
            raise ValueError("metrics_host must not be empty (127.0.0.1: loopback; 0.0.0.0: every address)")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(f"default_timeout_s {self.default_timeout_s:g} must not exceed max_timeout_s "
                             f"{self.max_timeout_s:g}")
        if self.lease_margin_s >= self.lease_s:
            raise ValueError(f"lease_margin_s {self.lease_margin_s} must be below lease_s {self.lease_s}")
        # vLLM extends a lease to a heartbeat's arrival + lease_s * 2 // 3; vouched for without the margin, a
        # renewal must come before that runs out, or no lease is ever renewed
        renewed = int(self.lease_s) * 2 // 3 - self.lease_margin_s
        if self.heartbeat_interval_s >= renewed:
            raise ValueError(
                f"heartbeat_interval_s {self.heartbeat_interval_s:g} must be below lease_s * 2 // 3 - "
                f"lease_margin_s = {renewed:g}, or leases lapse between heartbeats"
            )
        if self.pull_mode == "staged" and self.staging_bytes == 0:
            raise ValueError("pull_mode 'staged' needs staging_bytes > 0")

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    @property
    def socket_endpoint(self) -> str:
        if self.socket:
            return self.socket
        name = "cpu" if self.gpu is None else f"gpu{self.gpu}"
        return f"ipc://{DEFAULT_SOCKET_DIR}/{name}.sock"

    @property
    def socket_path(self) -> str:
        return self.socket_endpoint.removeprefix("ipc://")

    @property
    def http_port(self) -> int:
        """``metrics_port``, or its default for this GPU when unset (-1: no endpoint)."""
        if self.metrics_port is not None:
            return self.metrics_port
        return DEFAULT_METRICS_PORT + (self.gpu or 0)

    @property
    def local_metrics_url(self) -> str | None:
        """Where a process on this host reaches the metrics endpoint (None: disabled, or a free port that only
        the daemon's ready line names)."""
        if self.http_port <= 0:
            return None
        loopback = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
        host = loopback.get(self.metrics_host, self.metrics_host)
        return f"http://[{host}]:{self.http_port}" if ":" in host else f"http://{host}:{self.http_port}"


def direct_reads(cfg: Config) -> str | None:
    """Why a GPU daemon with ``cfg`` reads pulls direct, the descriptor-bound way, or None (the CPU twin's
    descriptors are cheap; with a pool, auto and mapped read staged)."""
    if cfg.gpu is None or (cfg.pull_mode != "direct" and cfg.staging_bytes > 0):
        return None
    which = ("pull_mode 'direct'" if cfg.pull_mode == "direct" else
             f"pull_mode {cfg.pull_mode!r} without a staging pool (staging_bytes 0)")
    pulls = "prefills whose pages do not map" if cfg.pull_mode == "mapped" else "every pull"
    return (f"{which}: {pulls} will read direct, two descriptors per block and layer (18,432 for a 4k-token "
            "Qwen3-8B request), 45-181 x slower than staged on one H200 (README Performance); set "
            "staging_bytes and pull_mode 'auto'")


def startup_warnings(cfg: Config) -> list[str]:
    """What the daemon should log at WARNING when it starts with ``cfg``: settings that refuse every pull, or
    that read every pull the slowest way."""
    out = []
    slow = direct_reads(cfg)
    if slow is not None:
        out.append(slow)
    if not cfg.remotes:
        out.append("no [[remotes]] declared: every pull will be refused (declare the prefills, e.g. "
                   "[[remotes]] match='*:5600' page_format={kind='standard', ...})")
    for r in cfg.remotes:
        if r.page_format is None:
            out.append(f"[[remotes]] match={r.match!r} has no page_format: pulls from it will be refused")
    return out


# ------------------------------------------------------------------------------------------------ key docs


class KeyDoc(msgspec.Struct, frozen=True):
    name: str
    type: str
    default: Any
    description: str


def key_docs() -> list[KeyDoc]:
    """Every key of Config with its JSON-schema type, default and description (the help text's source)."""
    schema = msgspec.json.schema(Config)
    props = schema["$defs"]["Config"]["properties"]
    out = []
    for field in msgspec.structs.fields(Config):
        prop = props[field.name]
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        out.append(
            KeyDoc(
                name=field.name,
                type=_schema_type(prop),
                default=msgspec.to_builtins(default),
                description=prop.get("description", ""),
            )
        )
    return out


def _schema_type(prop: Mapping[str, Any]) -> str:
    if "enum" in prop:
        return "|".join(str(v) for v in prop["enum"])
    if "anyOf" in prop:
        return " or ".join(_schema_type(p) for p in prop["anyOf"])
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if prop.get("type") == "array":
        return f"list of {_schema_type(prop.get('items', {}))}"
    return str(prop.get("type", "value"))


def help_text() -> str:
    lines = ["configuration keys (TOML key = KV_SIDECAR_<KEY> variable = --<key-with-dashes> flag):"]
    for d in key_docs():
        default = "unset" if d.default is None else repr(d.default)
        lines.append(f"  {d.name} ({d.type}, default {default})")
        lines.append(f"      {d.description}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ loading


def _field_types() -> dict[str, msgspec.inspect.Type]:
    info = msgspec.inspect.type_info(Config)
    return {f.name: f.type for f in info.fields}  # type: ignore[attr-defined]


def _is_stringy(t: msgspec.inspect.Type) -> bool:
    """Whether a raw string is the value as is (str fields), rather than JSON/TOML text to parse."""
    if isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    if isinstance(t, msgspec.inspect.StrType):
        return True
    if isinstance(t, msgspec.inspect.UnionType):
        return any(_is_stringy(x) for x in t.types)
    return isinstance(t, msgspec.inspect.LiteralType) and all(isinstance(v, str) for v in t.values)


def parse_value(key: str, raw: str, source: str) -> Any:
    """A flag or variable's text as a config value: strings as they are, everything else as JSON."""
    types = _field_types()
    if key not in types:
        raise ConfigError(f"{source}: no config key {key!r}; keys: {', '.join(sorted(types))}")
    if _is_stringy(types[key]):
        return raw
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        lowered = raw.strip().lower()
        if lowered in ("true", "yes", "on"):
            return True
        if lowered in ("false", "no", "off"):
            return False
        raise ConfigError(
            f"{source}: value {raw!r} for {key!r} is not valid JSON "
            f"(lists and tables are written as JSON, e.g. '[\"UCX\"]')"
        ) from None


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_NOT_KEYS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        out[key] = parse_value(key, raw, f"environment variable {name}")
    return out


def file_values(path: str, *, reloading: bool = False, keyless_ok: bool = False) -> dict[str, Any]:
    """The keys of the TOML file ``path``, read once settled (``settled_file.read_settled``). ``reloading``:
    look again for a file missing for a moment, and refuse a file without any key (empty, or only comments),
    unless ``keyless_ok`` (the daemon started from one): what a reload reads mid-rewrite, and never a change
    worth applying live (every key back to its default, ``remotes`` to none)."""
    try:
        data = settled_file.read_settled(path, wait_missing=reloading)
        values = tomllib.loads(data.decode())
    except settled_file.Unsettled as e:
        raise ConfigError(f"config file {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 (TOML is): {e.reason} at byte {e.start}") from None
    if reloading and not keyless_ok and not values:
        what = "empty" if not data.strip() else "only comments"
        raise ConfigError(
            f"config file {path} has no keys ({what}, {len(data)} bytes): a reload does not set every key "
            "back to its default (restart the daemon for that); if it is being rewritten, write it "
            "atomically: write a temp file, then rename it over this one"
        )
    return values


def build(values: Mapping[str, Any], source: str = "config") -> Config:
    try:
        return msgspec.convert(dict(values), Config, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_name_key(str(e))}") from None


def _name_key(text: str) -> str:
    """msgspec says '... - at `$.key`'; lead with the key instead."""
    if " - at `$." in text:
        what, where = text.rsplit(" - at `$.", 1)
        return f"key {where.rstrip('`')}: {what}"
    return text


def load(
    path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    reloading: bool = False,
    keyless_ok: bool = False,
) -> Config:
    """File (``path`` or $KV_SIDECAR_CONFIG), then KV_SIDECAR_* variables, then ``overrides`` (flags).
    ``reloading`` (SIGHUP): a missing file is looked for again, one without any key refused unless
    ``keyless_ok`` (``file_values``)."""
    return load_keyless(
        path, environ=environ, overrides=overrides, reloading=reloading, keyless_ok=keyless_ok
    )[0]


def load_keyless(
    path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    reloading: bool = False,
    keyless_ok: bool = False,
) -> tuple[Config, bool]:
    """``load``'s config, and whether it came with a file that had no key: from the one read of the file
    (a pipe cannot be read twice: the second open of a named FIFO waits for a writer that is gone)."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("KV_SIDECAR_CONFIG") or None
    merged: dict[str, Any] = {}
    sources = []
    keyless = False
    if path:
        values = file_values(path, reloading=reloading, keyless_ok=keyless_ok)
        keyless = not values
        merged.update(values)
        sources.append(f"file {path}")
    env = env_values(environ)
    if env:
        merged.update(env)
        sources.append("KV_SIDECAR_* variables")
    if overrides:
        merged.update(overrides)
        sources.append("flags")
    return build(merged, " + ".join(sources) or "defaults"), keyless


def load_to_find(
    path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Config, str]:
    """``load``'s config, for a tool that only needs to find a running daemon (its socket, its port): when the
    file does not load, the variables and flags over the file's ``FINDING_KEYS`` (when it still parses and
    they hold), with a note saying so. A daemon runs the config it loaded at start, so a file broken since (a
    reload would refuse it) must not hide a healthy daemon."""
    environ = os.environ if environ is None else environ
    try:
        return load(path, environ=environ, overrides=overrides), ""
    except ConfigError as exc:
        bare = {k: v for k, v in environ.items() if k != "KV_SIDECAR_CONFIG"}
        cfg = load(None, environ=bare, overrides=overrides)  # a bad variable or flag still raises
        # A file that still parses may name where the daemon is (socket, metrics_port) while another key
        # keeps it from loading: those keys, under the variables and flags, unless they are the trouble. Only
        # a regular file is read again: a second open of a named FIFO waits for a writer that is gone.
        path = path or environ.get("KV_SIDECAR_CONFIG") or None
        try:
            again = path is not None and os.path.isfile(path)
            found = {k: v for k, v in file_values(path).items() if k in FINDING_KEYS} if again else {}
            if found:
                cfg = build({**found, **env_values(bare), **(overrides or {})})
                kept = ", ".join(sorted(found))
                return cfg, (f"the config file does not load ({exc}); using its {kept} with the KV_SIDECAR_* "
                             "variables and flags")
        except ConfigError:
            pass
        return cfg, f"the config file does not load ({exc}); using the KV_SIDECAR_* variables and flags alone"


def reload_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """(keys SIGHUP applies, keys that changed but need a restart)."""
    applied, restart = [], []
    for field in msgspec.structs.fields(Config):
        if getattr(old, field.name) != getattr(new, field.name):
            (applied if field.name in RELOADABLE else restart).append(field.name)
    return applied, restart


class ReloadPlan(msgspec.Struct, frozen=True):
    """What a SIGHUP does with a newly read config: run ``config`` (None: keep the running one), having
    applied ``applied``; ``restart``: keys that changed but only a restart applies; ``refused``: why the
    running config is kept although live keys changed."""

    config: Config | None
    applied: list[str]
    restart: list[str]
    refused: str = ""


def plan_reload(running: Config, new: Config) -> ReloadPlan:
    """The running config with ``new``'s live keys: restart-only keys keep their running values, and a
    merge that does not hold together (a new live value against a running restart-only one) is refused."""
    applied, restart = reload_changes(running, new)
    if not applied:
        return ReloadPlan(None, [], restart)
    values = msgspec.structs.asdict(running)
    values.update({k: getattr(new, k) for k in applied})
    try:
        merged = Config(**values)
    except ValueError as exc:
        with_what = ", ".join(f"running {k}" for k in restart) or "the running values"
        return ReloadPlan(None, [], restart, f"with {with_what}: {exc}")
    return ReloadPlan(merged, applied, restart)
