"""deploy/systemd: `systemd-analyze verify` and offline `security`, the hardening that must (not) be there,
the ExecStart wrapper, and the daemon's sd_notify handshake under a real notify socket."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
UNIT = SYSTEMD / "kv-sidecar@.service"
DROPIN = SYSTEMD / "vllm.service.d" / "kv-sidecar.conf"
INSTALLED_BINARY = "/opt/kv-sidecar/bin/kv-sidecar"


def _tool(name: str) -> str:
    """The tool's path; in CI a missing tool fails (it must be installed), elsewhere the test is skipped."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: apt-get install -y --no-install-recommends systemd")
        pytest.skip(f"{name} is not installed (apt-get install -y systemd)")
    return path


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """``{section: [(key, value), ...]}`` in file order, repeated keys kept, comments dropped."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path}: keep each setting on one line: {line!r}"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: {line!r} is not key=value"
        current.append((key.strip(), value.strip()))
    return sections


def _values(unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def _value(unit, section: str, key: str) -> str | None:
    found = _values(unit, section, key)
    return found[-1] if found else None


def _venv_binary() -> str:
    """The kv-sidecar console script of the environment running the tests (what `pip install` put there)."""
    path = Path(sys.executable).parent / "kv-sidecar"
    assert path.is_file() and os.access(path, os.X_OK), (
        f"{path} missing: install the package (pip install -e .) before verifying the unit"
    )
    return str(path)


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The unit and the vLLM drop-in as they would be installed, with the daemon's path pointing at this
    environment's real console script (systemd-analyze verify insists that executables exist)."""
    text = UNIT.read_text()
    assert text.count(INSTALLED_BINARY) == 2, (
        f"ExecStart and ExecReload must run {INSTALLED_BINARY} (the documented install)"
    )
    (tmp_path / UNIT.name).write_text(text.replace(INSTALLED_BINARY, _venv_binary()))
    (tmp_path / "vllm.service.d").mkdir()
    shutil.copy(DROPIN, tmp_path / "vllm.service.d" / DROPIN.name)
    # A stand-in for the operator's vLLM unit, so the drop-in is verified in place.
    (tmp_path / "vllm.service").write_text(
        "[Unit]\nDescription=vLLM decoder\n[Service]\nExecStart=/bin/true\n"
    )
    return tmp_path


def test_systemd_analyze_verify_is_clean(unit_dir: Path):
    tool = _tool("systemd-analyze")
    result = subprocess.run(
        [
            tool,
            "verify",
            "--man=no",
            str(unit_dir / "kv-sidecar@0.service"),
            str(unit_dir / "kv-sidecar@3.service"),
            str(unit_dir / "vllm.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on unknown keys and typos, printing a warning: any output is a failure.
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "" and result.stdout.strip() == "", result.stderr + result.stdout


def test_verify_catches_a_typo(unit_dir: Path):
    """The check above can fail: a misspelt hardening key is reported."""
    tool = _tool("systemd-analyze")
    path = unit_dir / UNIT.name
    path.write_text(path.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict"))
    result = subprocess.run(
        [tool, "verify", "--man=no", str(unit_dir / "kv-sidecar@0.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Unknown key" in result.stderr and "ProtectSytem" in result.stderr


def test_offline_security_exposure_is_low(unit_dir: Path):
    tool = _tool("systemd-analyze")
    result = subprocess.run(
        [
            tool,
            "security",
            "--offline=yes",
            "--threshold=30",
            "--no-pager",
            str(unit_dir / "kv-sidecar@0.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    overall = [ln for ln in result.stdout.splitlines() if "Overall exposure level" in ln]
    assert result.returncode == 0, f"exposure above 3.0: {overall or result.stdout[-2000:]}\n{result.stderr}"
    assert overall, result.stdout[-2000:]


def test_unit_settings_the_gpu_path_needs():
    unit = read_unit(UNIT)
    svc = "Service"
    assert _value(unit, svc, "Type") == "notify"
    assert _value(unit, svc, "NotifyAccess") == "main"
    assert _value(unit, svc, "Restart") == "on-failure"
    assert _value(unit, svc, "ExecReload") == "/opt/kv-sidecar/bin/kv-sidecar reload --gpu %i --pid $MAINPID"
    # The socket directory; shared by every instance, so it must survive one instance stopping.
    assert _value(unit, svc, "RuntimeDirectory") == "kv-sidecar"
    assert _value(unit, svc, "RuntimeDirectoryPreserve") == "yes"
    assert _values(unit, svc, "EnvironmentFile") == [
        "-/etc/kv-sidecar/kv-sidecar.env",
        "-/etc/kv-sidecar/%i.env",
    ]
    assert "KV_SIDECAR_CONFIG=/etc/kv-sidecar/kv-sidecar.toml" in _values(unit, svc, "Environment")
    for key, want in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "LimitMEMLOCK": "infinity",
        "RemoveIPC": "no",
    }.items():
        assert _value(unit, svc, key) == want, key
    assert "vllm.service" in (_value(unit, "Unit", "Before") or "").split()


@pytest.mark.parametrize(
    "key",
    [
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",  # would cut /dev/kfd, /dev/dri, /dev/nvidia*
        "PrivateIPC",
        "PrivatePIDs",
        "PrivateUsers",
        "PrivateNetwork",  # CUDA/HIP IPC and cma need vLLM's namespaces
        "MemoryDenyWriteExecute",
        "ProtectProc",
        "ProcSubset",
        "DynamicUser",
    ],
)
def test_unit_does_not_isolate_what_ipc_and_devices_need(key):
    assert _value(read_unit(UNIT), "Service", key) is None, (
        f"{key}= breaks the GPU/IPC data path (see the unit)"
    )


def test_syscall_filter_keeps_ipc_syscalls():
    """pidfd_getfd and process_vm_readv (IPC fd import, cma) live in @debug/@process: never deny them."""
    filt = _value(read_unit(UNIT), "Service", "SystemCallFilter") or ""
    assert filt.startswith("~"), "only a deny list is safe for the GPU stack"
    denied = set(filt[1:].split())
    assert not denied & {"@debug", "@process", "@privileged", "@resources", "pidfd_getfd", "process_vm_readv"}


def test_dropin_orders_vllm_after_its_sidecars():
    dropin = read_unit(DROPIN)
    wants = set(" ".join(_values(dropin, "Unit", "Wants")).split())
    after = set(" ".join(_values(dropin, "Unit", "After")).split())
    assert wants == after == {"kv-sidecar@0.service", "kv-sidecar@1.service"}
    assert _values(dropin, "Unit", "Requires") == [] and _values(dropin, "Unit", "BindsTo") == []
    env = _values(dropin, "Service", "Environment")
    assert "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1" in env and "VLLM_KV_CACHE_LAYOUT=LHBNC" in env


def _exec_start_argv(instance: str, binary: str) -> list[str]:
    """ExecStart as systemd runs it: specifiers resolved (the unit uses no variable expansion)."""
    line = _value(read_unit(UNIT), "Service", "ExecStart")
    assert line is not None
    assert "$" not in line, "ExecStart must leave the config to the daemon (no shell, no variables)"
    return shlex.split(line.replace("%i", instance).replace(INSTALLED_BINARY, binary))


def _fake_daemon(tmp_path: Path) -> str:
    """A stand-in for the console script that records how it was started (argv and the config file)."""
    fake = tmp_path / "kv-sidecar"
    fake.write_text(
        "#!/bin/sh\n"
        + shlex.join(
            [
                sys.executable,
                "-c",
                "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
                "'config': os.environ.get('KV_SIDECAR_CONFIG')}))",
            ]
        )
        + ' "$@"\n'
    )
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize(
    "instance, toml, env, port",
    [
        ("0", "", {}, 9464),
        ("3", "", {}, 9467),
        ("3", "", {"KV_SIDECAR_METRICS_PORT": "19000"}, 19000),  # an environment file
        ("3", "metrics_port = 9600\n", {}, 9600),  # the TOML file (the unit used to override it)
        ("3", "metrics_port = 9600\n", {"KV_SIDECAR_METRICS_PORT": "19000"}, 19000),  # variables win
    ],
)
def test_exec_start_serves_gpu_i_on_port_9464_plus_i(tmp_path, instance, toml, env, port):
    """kv-sidecar@N runs ``serve --gpu N``; the daemon's config then puts the endpoint on 9464+N unless
    metrics_port is set in the TOML file or an environment file (what ``doctor`` reads too)."""
    from sidecar.ops import config as config_mod

    path = tmp_path / "kv-sidecar.toml"
    path.write_text(toml)
    argv = _exec_start_argv(instance, _fake_daemon(tmp_path))
    base = {"PATH": os.environ["PATH"], "KV_SIDECAR_CONFIG": str(path), **env}
    out = subprocess.run(argv, env=base, capture_output=True, text=True, timeout=30, check=True)
    seen = json.loads(out.stdout)
    assert seen["argv"] == ["serve", "--gpu", instance]
    assert seen["config"] == str(path)
    cfg = config_mod.load(seen["config"], environ=env, overrides={"gpu": int(seen["argv"][2])})
    assert cfg.http_port == port


# ------------------------------------------------------------------------- the daemon's side of Type=notify


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _next_notification(notify: socket.socket, proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The next sd_notify datagram; fails early with the daemon's output if it exits first."""
    deadline = time.monotonic() + timeout_s
    notify.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            return notify.recv(4096).decode()
        except TimeoutError:
            if proc.poll() is not None:
                pytest.fail(
                    f"daemon exited (rc={proc.returncode}) before notifying:\n{log.read_text()[-3000:]}"
                )
    pytest.fail(
        f"no sd_notify message within {timeout_s} s: the daemon must call sidecar.ops.sdnotify.ready()\n"
        f"{log.read_text()[-3000:]}"
    )


@contextlib.contextmanager
def _under_systemd(tmp_path: Path, env: dict[str, str]):
    """`kv-sidecar serve` (CPU twin) started as systemd would, with a real notify socket: (process, notify
    socket, log file); the process is killed on the way out if it still runs."""
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    log = tmp_path / "daemon.log"
    try:
        with open(log, "wb") as out:
            env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), **env}
            proc = subprocess.Popen([_venv_binary(), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc, notify, log
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        notify.close()


def _until_ready(notify: socket.socket, proc: subprocess.Popen, log: Path) -> None:
    while "READY=1" not in _next_notification(notify, proc, log, timeout_s=90).split("\n"):
        pass  # STATUS= lines may come first


@pytest.mark.e2e
def test_daemon_sends_ready_only_with_its_socket_bound_then_stopping(tmp_path):
    """Run `kv-sidecar serve` (CPU twin) as systemd would, with a real notify socket: READY=1 arrives once the
    ipc socket exists and answers a Ping; SIGTERM brings STOPPING=1."""
    from sidecar.wire import protocol

    zmq = pytest.importorskip("zmq")
    sock_path = tmp_path / "run" / "cpu.sock"
    sock_path.parent.mkdir(mode=0o700)
    port = _free_port()
    env = {"KV_SIDECAR_SOCKET": f"ipc://{sock_path}", "KV_SIDECAR_METRICS_PORT": str(port)}
    with _under_systemd(tmp_path, env) as (proc, notify, log):
        _until_ready(notify, proc, log)
        assert sock_path.exists(), "READY=1 was sent before the daemon's socket was bound"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"ipc://{sock_path}")
        dealer.send(protocol.encode(protocol.Ping(nonce=7)))
        assert dealer.poll(10_000), "no Pong within 10 s of READY=1"
        reply = protocol.decode_to_shim(dealer.recv())
        assert isinstance(reply, protocol.Pong) and reply.nonce == 7
        dealer.close()
        ctx.term()
        proc.terminate()
        messages = [_next_notification(notify, proc, log, timeout_s=30)]
        while "STOPPING=1" not in messages[-1].split("\n"):
            messages.append(_next_notification(notify, proc, log, timeout_s=30))
        assert proc.wait(30) == 0, log.read_text()[-3000:]


@pytest.mark.e2e
def test_daemon_feeds_systemds_watchdog_while_healthy(tmp_path):
    """With the unit's WatchdogSec= (WATCHDOG_USEC), the serving daemon sends WATCHDOG=1 every half period
    (a stuck one stops, and systemd restarts it: tests/sidecar/ops/test_sdnotify.py)."""
    unit = (SYSTEMD / "kv-sidecar@.service").read_text()
    assert "\nWatchdogSec=" in unit
    env = {"WATCHDOG_USEC": "200000", "KV_SIDECAR_SOCKET": f"ipc://{tmp_path}/cpu.sock",
           "KV_SIDECAR_METRICS_PORT": "-1"}
    with _under_systemd(tmp_path, env) as (proc, notify, log):
        _until_ready(notify, proc, log)
        start = time.monotonic()
        fed = [_next_notification(notify, proc, log, timeout_s=5) for _ in range(5)]
        assert fed == ["WATCHDOG=1"] * 5 and time.monotonic() - start < 2.0
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()[-3000:]
