"""kv-sidecar doctor: pure helpers, then the real command against a real daemon and a real prefill
emulator."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from sidecar.ops import doctor
from sidecar.wire import ipc
from sidecar.wire import protocol as p
from sidecar.wire.formats import PageFormat

L, H, N, D, B = 2, 2, 16, 128, 32  # layers, KV heads, block size, head size, decoder blocks
STANDARD = PageFormat(
    kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=H, block_size=N, head_size=D
)
SHUFFLED = PageFormat(
    kind="aiter_shuffled", layout="LHBNC", dtype="bfloat16", num_heads=H, block_size=N, head_size=D
)

# What UCX 1.23 prints at UCX_LOG_LEVEL=info here (a doctor probe against the emulator, UCX_NET_DEVICES=lo).
UCX_CPU_LOG = """\
[1795953512.501066] [vm:14049:0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0 (loaded from libucp.so)
[1795953512.530180] [vm:14049:0]      ucp_worker.c:1997 UCX  INFO    kv-sidecar-dd921ee1 self cfg#0 \
rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
[1795953512.580648] [vm:14049:0]      ucp_worker.c:1997 UCX  INFO    kv-sidecar-dd921ee1 intra-node cfg#1 \
rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)
"""


# -------------------------------------------------------------------------------------------- pure helpers


def test_ucx_lanes_are_read_from_the_info_log():
    lanes = doctor.parse_ucx_lanes(UCX_CPU_LOG)
    assert [ln.scope for ln in lanes] == ["self", "intra-node"]
    assert lanes[1].lanes == {"rma_am": ["tcp"], "amo_am": ["tcp"], "am": ["tcp", "cma"], "ka": ["tcp"]}


def test_cma_bulk_lane_passes():
    status, detail = doctor.judge_transports(doctor.parse_ucx_lanes(UCX_CPU_LOG))
    assert status == "pass" and detail.startswith("cma")


def test_tcp_only_is_a_warning():
    log = UCX_CPU_LOG.replace(" cma/memory", "")
    status, detail = doctor.judge_transports(doctor.parse_ucx_lanes(log))
    assert status == "warn" and "tcp fallback" in detail


def test_rdma_and_gpu_ipc_lanes_pass():
    log = (
        "x UCX  INFO    agent inter-node cfg#2 rma(rc_mlx5/mlx5_0:1)  am(rc_mlx5/mlx5_0:1)\n"
        "x UCX  INFO    agent intra-node cfg#3 rma(cuda_ipc/cuda) am(tcp/lo)\n"
    )
    status, detail = doctor.judge_transports(doctor.parse_ucx_lanes(log))
    assert status == "pass" and "cuda_ipc" in detail and "rc_mlx5" in detail


def test_no_endpoint_lines_is_a_warning():
    assert doctor.judge_transports(doctor.parse_ucx_lanes("nothing here"))[0] == "warn"
    only_self = "\n".join(ln for ln in UCX_CPU_LOG.splitlines() if "intra-node" not in ln)
    assert doctor.judge_transports(doctor.parse_ucx_lanes(only_self))[0] == "warn"


def test_env_file_reads_like_systemd(tmp_path):
    f = tmp_path / "0.env"
    f.write_text(
        "# comment\n\nKV_SIDECAR_METRICS_PORT=9470\nUCX_NET_DEVICES='mlx5_0:1'\n; also a comment\n"
        'KV_SIDECAR_LOG_LEVEL="DEBUG"\n'
    )
    assert doctor.read_env_file(str(f)) == {
        "KV_SIDECAR_METRICS_PORT": "9470",
        "UCX_NET_DEVICES": "mlx5_0:1",
        "KV_SIDECAR_LOG_LEVEL": "DEBUG",
    }


@pytest.mark.parametrize(
    "toml, env, url",
    [
        ("", {}, "http://127.0.0.1:9465"),  # kv-sidecar@1's default
        ("metrics_port = 9600\n", {}, "http://127.0.0.1:9600"),  # the TOML file's, as the daemon reads it
        ("metrics_port = 9600\n", {"KV_SIDECAR_METRICS_PORT": "19000"}, "http://127.0.0.1:19000"),
        ("metrics_port = -1\n", {}, None),
        ("metrics_port = 0\n", {}, None),  # a free port picked at start: not port 0
        ('metrics_host = "::"\n', {}, "http://[::1]:9465"),  # an IPv6 wildcard is asked on its loopback
    ],
)
def test_the_metrics_endpoint_is_where_the_daemon_serves_it(tmp_path, toml, env, url):
    path = tmp_path / "kv-sidecar.toml"
    path.write_text(toml)
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    target, check = doctor.load_target(parser.parse_args(["--gpu", "1", "--config", str(path)]), env)
    assert check.status == "pass", check
    assert target is not None and target.metrics_url == url


def test_a_free_metrics_port_is_asked_for_not_probed_at_port_0(tmp_path):
    """metrics_port = 0: the daemon picked a free port; doctor cannot know it and must say so, not fail
    /healthz and /readyz against port 0."""
    path = tmp_path / "kv-sidecar.toml"
    path.write_text("metrics_port = 0\n")
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    target, _ = doctor.load_target(parser.parse_args(["--config", str(path)]), {})
    assert target is not None
    checks, gauges = doctor.check_health(target.metrics_url, 0.5, target.no_metrics)
    assert [(c.name, c.status) for c in checks] == [("health", "skip")] and gauges == {}
    assert "--metrics-url" in checks[0].detail and "metrics_port = 0" in checks[0].detail


def test_gpu_n_reads_the_config_an_env_file_names_as_kv_sidecar_at_n_does(tmp_path, monkeypatch):
    """kv-sidecar@N's Environment=KV_SIDECAR_CONFIG=/etc/kv-sidecar/kv-sidecar.toml is overridden by its
    EnvironmentFile=s (systemd: "settings from these files override settings made with Environment="), so a
    per-GPU N.env may point the daemon at another file; doctor --gpu N must check that one."""
    shared, own = tmp_path / "kv-sidecar.toml", tmp_path / "gpu1.toml"
    shared.write_text("metrics_port = 9600\n")
    own.write_text("metrics_port = 9700\n")
    (tmp_path / "1.env").write_text(f"KV_SIDECAR_CONFIG={own}\n")
    monkeypatch.setattr(doctor, "SYSTEMD_CONFIG", str(shared))
    env_files = (str(tmp_path / "kv-sidecar.env"), str(tmp_path / "{gpu}.env"))
    monkeypatch.setattr(doctor, "SYSTEMD_ENV_FILES", env_files)
    monkeypatch.delenv("KV_SIDECAR_CONFIG", raising=False)
    out: list[str] = []
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    args = parser.parse_args(["--gpu", "1", "--no-pull", "--json", "--timeout", "0.2",
                              "--socket", f"ipc://{tmp_path}/gpu1.sock"])
    doctor.run(args, out=out.append)
    config = _by_name(json.loads(out[0]))["config"]
    assert config["status"] == "pass" and config["detail"].startswith(f"{own}:"), config
    assert "http://127.0.0.1:9700" in config["detail"], config


def test_metrics_text_gauges():
    text = (
        "# HELP kv_sidecar_ready x\n# TYPE kv_sidecar_ready gauge\nkv_sidecar_ready 1.0\n"
        'kv_sidecar_registered_bytes 4.194304e+06\nkv_sidecar_requests_total{outcome="ok"} 3.0\n'
    )
    assert doctor.parse_metrics(text) == {"kv_sidecar_ready": 1.0, "kv_sidecar_registered_bytes": 4194304.0}


def test_prefill_addresses_skip_patterns_and_repeats():
    class Rule(msgspec.Struct):
        match: str

    got = doctor.prefill_addresses(
        ["10.0.0.1:5600"],
        [Rule("*:5600"), Rule("10.0.0.2:5600"), Rule("10.0.0.[3]:1")],
        ["10.0.0.1:5600", "10.0.0.4:5600"],
    )
    assert got == ["10.0.0.1:5600", "10.0.0.2:5600", "10.0.0.4:5600"]


@pytest.mark.parametrize("bad", ["nohost", ":5600", "host:", "host:port"])
def test_split_address_names_the_problem(bad):
    with pytest.raises(ValueError, match="host:port"):
        doctor.split_address(bad)


def test_ipv6_address():
    assert doctor.split_address("[fd00::1]:5600") == ("fd00::1", 5600)


def test_exit_code_fails_only_on_fail():
    ok = doctor.DoctorReport(
        [
            doctor.DoctorCheck("a", "pass", ""),
            doctor.DoctorCheck("b", "warn", ""),
            doctor.DoctorCheck("c", "skip", ""),
        ]
    )
    assert doctor.exit_code(ok) == 0
    assert doctor.exit_code(doctor.DoctorReport([*ok.checks, doctor.DoctorCheck("d", "fail", "x")])) == 1


@pytest.mark.parametrize(
    ("settings", "status", "detail"),
    [
        ({}, "pass", "pull_mode 'auto', no staging pool"),  # the CPU twin: its descriptors are cheap
        ({"gpu": 0, "staging_bytes": 4 << 30}, "pass", "pull_mode 'auto', a 4.0 GiB staging pool"),
        ({"gpu": 0, "pull_mode": "mapped", "staging_bytes": 1 << 20}, "pass",
         "pull_mode 'mapped', a 1.0 MiB staging pool"),
        ({"gpu": 0}, "warn", "pull_mode 'auto' without a staging pool (staging_bytes 0): every pull will"),
        ({"gpu": 1, "pull_mode": "direct", "staging_bytes": 1 << 30}, "warn",
         "pull_mode 'direct': every pull will read direct"),
    ],
)
def test_the_read_path_warns_where_a_gpu_daemon_reads_direct(settings, status, detail):
    from sidecar.ops import config

    check = doctor.check_read_path(config.build(settings))
    assert (check.name, check.status) == ("read path", status)
    assert check.detail.startswith(detail), check.detail


def test_missing_socket_is_a_clear_failure(tmp_path):
    checks, status = doctor.check_daemon(f"ipc://{tmp_path}/gpu0.sock", 0.5)
    assert status is None and checks[0].status == "fail" and "does not exist" in checks[0].detail


def test_stale_socket_file_is_reported(tmp_path):
    """A socket file nobody serves: the Ping times out with a reason, nothing hangs."""
    path = tmp_path / "gpu0.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{path}")
    router.close(0)  # leaves no server; recreate a plain file where the socket was
    path.touch()
    ctx.term()
    checks, _ = doctor.check_daemon(f"ipc://{path}", 0.5)
    assert checks[0].status == "fail" and "no reply" in checks[0].detail


def test_a_socket_doctor_may_not_open_is_not_called_stale():
    """A live daemon's socket that doctor's user cannot write (0600, doctor not its owner): connecting is
    refused, and saying "stale socket, or the daemon is stuck" would have the operator restart a healthy
    daemon. Run as nobody when the tests run as root (root may open anything)."""
    import shutil
    import socket as socket_mod
    import tempfile

    as_other = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot test as another user")
        as_other = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        os.chmod(d, 0o755)  # enterable: only the socket itself is out of reach
        path = f"{d}/gpu0.sock"
        listener = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen()
            os.chmod(path, 0o000 if not as_other else 0o600)
            code = (
                "import json, sys, msgspec; from sidecar.ops import doctor; "
                "print(msgspec.json.encode(doctor.check_daemon(sys.argv[1], 0.5)[0]).decode())"
            )
            repo = str(Path(__file__).resolve().parents[3])
            out = subprocess.run(
                [*as_other, sys.executable, "-c", code, f"ipc://{path}"],
                capture_output=True, text=True, timeout=60, cwd=d,
                env={**os.environ, "PYTHONPATH": repo},
            )
        finally:
            listener.close()
    assert out.returncode == 0, out.stderr[-2000:]
    (check,) = json.loads(out.stdout)
    assert check["status"] == "fail"
    assert "permission denied" in check["detail"] and "stale" not in check["detail"], check


# ------------------------------------------------------------------------------------------------ e2e


class DoctorDecoder:
    """A decoder's K/V planes in /dev/shm and the shim's DEALER that registers them with the daemon."""

    def __init__(
        self, endpoint: str, factors: dict, fmt: PageFormat = SHUFFLED, tp: tuple[int, int] = (0, 1)
    ) -> None:
        heads = fmt.num_heads
        plane = N * heads * D
        self.shm = ipc.create_shm_buffer(L * B * fmt.page_bytes)
        layers = [
            ipc.LayerView(
                name=f"model.layers.{i}.self_attn.attn",
                buffer_index=0,
                offset_bytes=i * B * fmt.page_bytes,
                shape=[B, 2, N, heads * D],
                strides=[plane, B * plane, heads * D, 1],
                dtype="bfloat16",
            )
            for i in range(L)
        ]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        hello = p.Hello(protocol_version=p.PROTOCOL_VERSION, package_version="test", worker_rank=tp[0],
                        tp_size=tp[1])
        assert isinstance(self._ask(hello), p.Welcome)
        reply = self._ask(
            p.RegisterCaches(
                buffers=[self.shm.description], layers=layers, page_format=fmt, compat_factors=factors
            )
        )
        assert isinstance(reply, p.Registered), reply

    def pull(self, kv: dict, remote_tp: int) -> p.Done:
        """One block of the prefill, as vLLM's shim asks it (the prefill's TP from kv_transfer_params)."""
        return self._ask(
            p.Pull(req_id=kv["remote_request_id"], remote_engine_id=kv["remote_engine_id"],
                   remote_host=kv["remote_host"], remote_port=kv["remote_port"],
                   remote_request_id=kv["remote_request_id"],
                   remote_block_ids=p.pack_block_ids(kv["remote_block_ids"][0]),
                   local_block_ids=p.pack_block_ids([1]), timeout_s=20.0, remote_tp_size=remote_tp,
                   remote_registration_generation=kv.get("remote_registration_generation", 0))
        )

    def _ask(self, msg):
        self.sock.send(p.encode(msg))
        assert self.sock.poll(30_000), f"no reply to {type(msg).__name__}"
        return p.decode_to_shim(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.shm.close()


def _node(
    tmp_path: Path, factors: dict | None = None, prefill_tp: int = 1, decoder: tuple[int, int] = (0, 1)
):
    """A prefill emulator, a CPU-twin daemon declaring it, and a decoder that registered its caches (with
    ``factors`` as its hash factors when given). The model has H KV heads, split over the prefill's
    ``prefill_tp`` ranks and the decoder's TP (``decoder``: its rank and TP size)."""
    from sidecar.cli import spawn_serve
    from sidecar.standins.emulator_control import spawn_emulator

    emu = spawn_emulator(
        [
            "--layers",
            str(L),
            "--heads",
            str(H // prefill_tp),
            "--tp",
            str(prefill_tp),
            "--head-size",
            str(D),
            "--block-size",
            str(N),
            "--attn-backend",
            "CPU_ATTN",
            "--no-progress-thread",
        ]
    )
    cfg = tmp_path / "kv-sidecar.toml"
    declared = msgspec.structs.replace(STANDARD, num_heads=H // prefill_tp)
    rule = {"match": "127.0.0.1:*", "convert": True, "page_format": msgspec.to_builtins(declared)}
    cfg.write_text(
        "verify_model_identity = true\n[[remotes]]\n"
        + "".join(
            f"{k} = {json.dumps(v) if not isinstance(v, dict) else _inline(v)}\n" for k, v in rule.items()
        )
    )
    sock = f"ipc://{tmp_path}/cpu.sock"
    try:
        daemon = spawn_serve(
            ["--config", str(cfg), "--socket", sock, "--metrics-port", "0"],
            env={"KV_SIDECAR_LOG_LEVEL": "WARNING"},
        )
    except BaseException:
        emu.stop()  # a daemon that failed to start must not leave the emulator running
        raise
    # The decoder's hash factors: the prefill's, with the decoder's own backend name.
    if factors is None:
        factors = {**emu.ready.compat_factors, "attn_backend_name": "ROCM_AITER_FA"}
    local = msgspec.structs.replace(SHUFFLED, num_heads=H // decoder[1])
    decoder = DoctorDecoder(sock, factors, local, decoder)
    info = {
        "decoder": decoder,
        "emulator": emu,
        "daemon": daemon,
        "config": str(cfg),
        "socket": sock,
        "metrics": daemon.metrics_url,
        "prefill": f"127.0.0.1:{emu.ready.side_channel_port}",
    }
    try:
        yield info
    finally:
        decoder.close()
        daemon.stop()
        if emu.proc.poll() is None:
            emu.stop()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """Shared by the tests that leave the node as it is."""
    yield from _node(tmp_path_factory.mktemp("node"))


@pytest.fixture
def own_node(tmp_path):
    """For a test that stops a part of the node."""
    yield from _node(tmp_path)


def _inline(d: dict) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + " }"


def _doctor(node: dict, *extra: str) -> tuple[int, dict]:
    """doctor in its own process (``python -m sidecar.ops.doctor``), against the node's daemon and prefill."""
    argv = [
        sys.executable,
        "-m",
        "sidecar.ops.doctor",
        "--json",
        "--timeout",
        "2",
        "--config",
        node["config"],
        "--socket",
        node["socket"],
        "--metrics-url",
        node["metrics"],
        "--prefill",
        node["prefill"],
        *extra,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=os.environ.copy())
    assert out.stdout.strip(), out.stderr[-3000:]
    return out.returncode, json.loads(out.stdout)


def _by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.e2e
def test_doctor_passes_on_a_healthy_node(node):
    rc, report = _doctor(node, "--emulator-control", node["emulator"].ready.control)
    checks = _by_name(report)
    assert rc == 0 and report["ok"], json.dumps(report, indent=1)
    for name in (
        "config",
        "daemon",
        "/healthz",
        "/readyz",
        "caches",
        "read path",
        f"prefill {node['prefill']}",
        f"negotiation {node['prefill']}",
        "test pull",
        "UCX transports",
    ):
        assert checks[name]["status"] in ("pass", "warn"), (name, checks[name])
    assert checks["daemon"]["status"] == "pass" and checks["caches"]["status"] == "pass"
    # from the daemon's Status: its registered caches' format and hash factors, no --local-format needed
    assert checks["caches"]["data"]["page_format"] == msgspec.to_builtins(SHUFFLED), checks["caches"]
    assert "model identity not checked" not in checks[f"negotiation {node['prefill']}"]["detail"]
    # the CPU twin reads direct, and its descriptors are cheap: no warning
    read_path = checks["read path"]
    assert (read_path["status"], read_path["detail"]) == ("pass", "pull_mode 'auto', no staging pool")
    assert checks["completion socket"]["status"] == "pass", checks["completion socket"]
    assert checks["completion socket"]["detail"].startswith(f"Pong over {node['socket'][6:]}.done")
    assert (
        "convert standard LBHNC -> aiter_shuffled LHBNC" in checks[f"negotiation {node['prefill']}"]["detail"]
    )
    assert "completion notification received" in checks["test pull"]["detail"]
    assert checks["UCX transports"]["status"] == "pass"  # tcp + cma on loopback here


@pytest.mark.e2e
def test_a_proxy_in_the_environment_is_not_asked_for_the_local_endpoints(node, monkeypatch):
    """/healthz, /readyz and /metrics are the daemon's own, on this host: asked through $http_proxy (which
    urllib honours unless NO_PROXY names the host), a healthy daemon failed both rows and its gauges were
    lost. The container's HEALTHCHECK had the same bug (test_healthcheck.py)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: the proxy
        s.bind(("127.0.0.1", 0))
        proxy = s.getsockname()[1]
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy}")
    checks, gauges = doctor.check_health(node["metrics"], 2.0)
    assert [(c.name, c.status) for c in checks] == [("/healthz", "pass"), ("/readyz", "pass")], checks
    assert gauges.get("kv_sidecar_registered_bytes", 0) > 0, gauges


@pytest.mark.e2e
def test_a_missing_completion_socket_is_a_warning_not_a_failure(own_node):
    os.unlink(own_node["socket"].removeprefix("ipc://") + ".done")  # shims fall back to ZMQ
    check = doctor.check_completion_socket(own_node["socket"], 2.0)
    assert check.status == "warn" and "fall back to ZMQ" in check.detail, check


@pytest.mark.e2e
def test_doctor_fails_with_reasons_when_the_emulator_is_stopped(own_node):
    node = own_node
    control = node["emulator"].ready.control
    node["emulator"].stop()
    rc, report = _doctor(node, "--emulator-control", control)
    checks = _by_name(report)
    assert rc == 1 and not report["ok"]
    prefill = checks[f"prefill {node['prefill']}"]
    assert prefill["status"] == "fail"
    assert f"no handshake reply from tcp://{node['prefill']}" in prefill["detail"]
    assert (
        checks["test pull"]["status"] == "fail"
        and f"emulator control {control}" in checks["test pull"]["detail"]
    )
    assert checks["daemon"]["status"] == "pass"  # the rest of the node is still reported healthy


@pytest.mark.e2e
def test_doctor_refusal_names_the_field(node, tmp_path):
    """A prefill declared with another block size: negotiation fails with the field and the reason."""
    cfg = Path(node["config"]).read_text().replace("block_size = 16", "block_size = 32")
    other = tmp_path / "other.toml"
    other.write_text(cfg)
    rc, report = _doctor({**node, "config": str(other)}, "--no-pull")
    neg = _by_name(report)[f"negotiation {node['prefill']}"]
    assert rc == 1 and neg["status"] == "fail"
    assert neg["detail"].startswith("refused on block_size:")


@pytest.mark.e2e
def test_no_local_hash_factors_fail_as_the_daemon_refuses(tmp_path):
    """verify_model_identity = true and a registration without hash factors: the daemon refuses every
    prefill ("no local model identity"), so doctor must fail the negotiation too, not pass it with a
    warning and exit 0 on a node that serves no pull."""
    for node in _node(tmp_path, factors={}):
        rc, report = _doctor(node, "--no-pull")
        neg = _by_name(report)[f"negotiation {node['prefill']}"]
        assert rc == 1 and neg["status"] == "fail", neg
        assert neg["detail"].startswith("refused on compatibility_hash: no local model identity"), neg


def test_unknown_hash_factors_are_a_warning_not_a_refusal(monkeypatch):
    """A daemon that reports no status (older than Status; --local-format gives the format): its hash
    factors are unknown, not empty, so doctor cannot check the identity and says so."""
    from sidecar.ops import config

    _fake_prefill(monkeypatch, STANDARD.page_bytes)
    rule = {"match": "10.0.0.1:5600", "page_format": msgspec.to_builtins(STANDARD)}
    cfg = config.build({"verify_model_identity": True, "remotes": [rule]})
    neg = {c.name: c for c in doctor.check_prefill("10.0.0.1:5600", cfg, STANDARD, 2, None, 1.0)}
    neg = neg["negotiation 10.0.0.1:5600"]
    assert neg.status == "warn" and "model identity not checked" in neg.detail, neg


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("prefill_tp", "decoder", "ranks"),
    [(2, (0, 1), "0, 1"), (1, (1, 2), "0")],
    ids=["prefill-tp2", "decoder-rank1-of-tp2"],
)
def test_a_prefill_at_another_tp_is_negotiated_as_the_daemon_reads_it(tmp_path, prefill_tp, decoder, ranks):
    """Heterogeneous TP: the daemon reads this decoder rank's head slice of one prefill rank (decoder TP
    larger) or gathers heads from several (prefill TP larger), and serves the pull; doctor negotiated the
    prefill rank's whole pages against the decoder's and failed "refused on num_heads ... heterogeneous
    TP is not supported" on a working node. It must apply the daemon's slicing (the TPs from Status)."""
    for node in _node(tmp_path, prefill_tp=prefill_tp, decoder=decoder):
        kv = node["emulator"].client.new_request(num_tokens=N).kv_transfer_params
        done = node["decoder"].pull(kv, prefill_tp)
        assert done.ok, done  # the daemon serves this pairing
        rc, report = _doctor(node, "--no-pull")
        checks = _by_name(report)
        neg = checks[f"negotiation {node['prefill']}"]
        assert rc == 0 and neg["status"] == "pass", json.dumps(report, indent=1)
        assert neg["detail"].startswith("convert standard LBHNC -> aiter_shuffled LHBNC"), neg
        prefill = checks[f"prefill {node['prefill']}"]["detail"]
        assert prefill.endswith(f"ranks {ranks} of TP {prefill_tp} (decoder rank {decoder[0]} of TP "
                                f"{decoder[1]})"), prefill


@pytest.mark.e2e
def test_doctor_starts_its_own_emulator_and_checks_every_byte(node):
    rc, report = _doctor(node)
    pull = _by_name(report)["test pull"]
    assert pull["status"] == "pass" and "emulator started by doctor" in pull["detail"]
    assert pull["data"]["verified"] is True and pull["data"]["bytes"] > 0


@pytest.mark.e2e
def test_kv_sidecar_doctor_without_a_daemon_fails_and_says_where_it_looked(tmp_path):
    """Through the console script, as an operator types it."""
    argv = [
        str(Path(sys.executable).parent / "kv-sidecar"),
        "doctor",
        "--json",
        "--no-pull",
        "--timeout",
        "1",
        "--socket",
        f"ipc://{tmp_path}/gpu3.sock",
        "--metrics-url",
        "http://127.0.0.1:9",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr[-2000:]
    report = json.loads(out.stdout)
    checks = _by_name(report)
    assert out.returncode == 1
    assert (
        checks["daemon"]["status"] == "fail"
        and f"{tmp_path}/gpu3.sock does not exist" in checks["daemon"]["detail"]
    )
    assert checks["/healthz"]["status"] == "fail"


def test_table_output_names_the_failed_checks():
    from rich.console import Console

    console = Console(record=True, width=200)
    doctor.render(
        doctor.DoctorReport(
            [doctor.DoctorCheck("daemon", "fail", "gone"), doctor.DoctorCheck("config", "pass", "ok")]
        ),
        console,
    )
    text = console.export_text()
    assert "FAIL" in text and "PASS" in text and "FAIL: daemon" in text


# ------------------------------------------------------------------------------- negotiation as the daemon


FP8_GEOMETRY = dict(num_heads=2, block_size=16, head_size=64)
FP8_PREFILL = PageFormat(kind="standard", layout="LBHNC", dtype="float8_e4m3fn", **FP8_GEOMETRY)
# 1.0 is not twice the prefill's 1.0: the e4m3fn -> e4m3fnuz re-encode can saturate or round
FP8_DECODER = PageFormat(kind="aiter_shuffled", layout="LHBNC", dtype="float8_e4m3fnuz", **FP8_GEOMETRY)


def _fake_prefill(monkeypatch, page_bytes: int) -> None:
    """vLLM's handshake reply of a prefill with 2 layers of ``page_bytes`` pages, without a network."""
    from types import SimpleNamespace

    from sidecar.wire import prefill as vllm_wire
    from tests.sidecar.nixl.test_geometry import RemoteMem

    meta = RemoteMem(2, 8, block_len=page_bytes).meta
    meta.num_regions = 2
    reply = SimpleNamespace(metadata=meta, compatibility_hash=None, rtt_s=0.001)
    monkeypatch.setattr(vllm_wire, "fetch_handshake", lambda *a, **k: {(0, 0): reply})


@pytest.mark.parametrize("lossy_ok, status", [(True, "pass"), (False, "fail")])
def test_negotiation_honours_the_rules_fp8_lossy_reencode(monkeypatch, lossy_ok, status):
    """The daemon admits a lossy e4m3fn -> e4m3fnuz prefill when its [[remotes]] rule opts in
    (fp8_lossy_reencode); doctor must say the same, not "refused on local.k_scale"."""
    from sidecar.ops import config

    _fake_prefill(monkeypatch, FP8_PREFILL.page_bytes)
    cfg = config.build(
        {
            "verify_model_identity": False,
            "remotes": [
                {
                    "match": "10.0.0.1:5600",
                    "page_format": msgspec.to_builtins(FP8_PREFILL),
                    "fp8_lossy_reencode": lossy_ok,
                }
            ],
        }
    )
    checks = doctor.check_prefill("10.0.0.1:5600", cfg, FP8_DECODER, 2, {}, 1.0)
    neg = {c.name: c for c in checks}["negotiation 10.0.0.1:5600"]
    assert neg.status == status, neg
    if not lossy_ok:
        assert neg.detail.startswith("refused on local.k_scale:"), neg


@pytest.mark.parametrize("reload, status, detail", [
    (None, "pass", "no SIGHUP since PID 7 started"),
    (p.ReloadStatus(count=2, outcome="applied", applied=["remotes"]), "pass", "SIGHUP #2: applied remotes"),
    (p.ReloadStatus(count=1, outcome="unchanged"), "pass", "SIGHUP #1: nothing to apply"),
    (p.ReloadStatus(count=3, outcome="refused", reason="key x: bad"), "warn",
     "SIGHUP #3 was refused, the daemon runs its older config: key x: bad"),
    (p.ReloadStatus(count=1, outcome="applied", applied=["remotes"], restart_pending=["gpu"]), "warn",
     "gpu changed in the file; only a restart applies them"),
])
def test_the_latest_reload_is_a_row(reload, status, detail):
    reply = p.StatusReply(nonce=1, registered=False, pid=7, reload=reload)
    assert doctor.check_reload(reply) == doctor.DoctorCheck("reload", status, detail)
    assert doctor.check_reload(p.StatusReply(nonce=1, registered=False)) is None  # a daemon older than it
