"""Issue 15 items 3, 4, 10: start-up failures end in one line naming the key, and the socket directory is
changed only when the daemon created it. Unit tests of sidecar.ops.socket_files / metrics, and the real
``kv-sidecar serve`` for the one-line errors (marker e2e)."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
import subprocess
import sys
import urllib.request

import pytest

from sidecar.daemon.router import Router
from sidecar.ops import config as config_mod
from sidecar.ops.errors import StartupError
from sidecar.ops.metrics import Health, Metrics, MetricsServer
from sidecar.ops.socket_files import secure_socket_dir


def test_shared_sticky_directory_is_left_as_it_is(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert not secure_socket_dir(str(shared / "cpu.sock"), None)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777


def test_existing_own_directory_keeps_its_mode(tmp_path) -> None:
    d = tmp_path / "mine"
    d.mkdir()
    os.chmod(d, 0o755)
    secure_socket_dir(str(d / "cpu.sock"), None)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755


@pytest.mark.parametrize("gid,mode", [(None, 0o700), (os.getgid(), 0o750)])
def test_created_directory_is_private(tmp_path, gid, mode) -> None:
    d = tmp_path / "a" / "b"
    assert secure_socket_dir(str(d / "cpu.sock"), gid)
    assert stat.S_IMODE(os.stat(d).st_mode) == mode


@pytest.fixture
def foreign_gid(monkeypatch) -> int:
    """A group the daemon's user is not in: the kernel refuses a chown to it (EPERM). Root may chown to any
    group, so as root os.chown is made to refuse it as the kernel would for anyone else."""
    if os.geteuid() != 0:
        return max([os.getgid(), *os.getgroups()]) + 1
    gid, chown = 54321, os.chown

    def refusing(path, uid, group, *args, **kwargs):
        if group == gid:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), path)
        return chown(path, uid, group, *args, **kwargs)

    monkeypatch.setattr(os, "chown", refusing)
    return gid


def test_a_group_the_daemon_is_not_in_is_one_clear_error_and_leaves_no_directory(tmp_path, foreign_gid):
    """Main: PermissionError out of start-up (a traceback), and the new directories stayed behind."""
    with pytest.raises(StartupError, match=rf"^socket_group: cannot give {tmp_path}/a/b to group "
                                           rf"{foreign_gid}: Operation not permitted") as e:
        secure_socket_dir(str(tmp_path / "a" / "b" / "cpu.sock"), foreign_gid)
    assert e.value.key == "socket_group"
    assert os.listdir(tmp_path) == []


def test_a_group_the_daemon_is_not_in_fails_binding_in_an_existing_directory(tmp_path, foreign_gid):
    """An existing directory is not chowned, so the socket file is the first: main blamed ``socket``
    ("cannot bind ...: Operation not permitted")."""
    path = str(tmp_path / "cpu.sock")
    assert not secure_socket_dir(path, foreign_gid)

    async def bind() -> None:
        router = Router(Metrics())
        try:
            router.bind(f"ipc://{path}", path, foreign_gid, fast_completions=True, max_connections=4,
                        on_closed=lambda _rid: None)
        finally:
            router.close()

    with pytest.raises(StartupError, match=r"^socket_group: cannot give .*/cpu.sock to group "):
        asyncio.run(bind())
    assert os.listdir(tmp_path) == [], "the socket file stayed behind"


def test_directory_under_a_file_is_one_clear_error(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StartupError, match=r"^socket: cannot create the directory .*/f/d: Not a directory$"):
        secure_socket_dir(str(tmp_path / "f" / "d" / "cpu.sock"), None)
    with pytest.raises(StartupError, match="exists and is not a directory"):
        secure_socket_dir(str(tmp_path / "f" / "cpu.sock"), None)


def test_over_long_socket_path_is_refused_by_config_and_socket_files(tmp_path) -> None:
    long = f"{tmp_path}/{'x' * 120}.sock"
    with pytest.raises(StartupError, match=r"socket: the path is \d+ bytes, .* at most 107"):
        secure_socket_dir(long, None)
    with pytest.raises(config_mod.ConfigError, match="at most 107"):
        config_mod.build({"socket": f"ipc://{long}"})
    edge = "/" + "y" * 106  # exactly 107 bytes: allowed
    assert config_mod.build({"socket": f"ipc://{edge}"}).socket_path == edge


def test_busy_metrics_port_is_one_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(StartupError, match=rf"^metrics_port: cannot serve metrics on 127.0.0.1:{port}: "):
            MetricsServer(Metrics(), Health(), "127.0.0.1", port)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_metrics_serve_on_an_ipv6_address() -> None:
    server = MetricsServer(Metrics(), Health(), "::1", 0)
    try:
        assert server.url == f"http://[::1]:{server.port}"
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"kv_sidecar_" in reply.read()
    finally:
        server.close()


def test_a_metrics_host_not_on_this_host_is_named() -> None:
    with pytest.raises(StartupError, match=r"^metrics_host: cannot serve metrics on 192\.0\.2\.1:0: "):
        MetricsServer(Metrics(), Health(), "192.0.2.1", 0)  # TEST-NET-1: no host has it


def test_max_timeout_s_and_finite_timeouts() -> None:
    assert config_mod.Config().max_timeout_s == 600.0
    assert "max_timeout_s" in config_mod.RELOADABLE
    with pytest.raises(config_mod.ConfigError, match="default_timeout_s 700 must not exceed max_timeout_s"):
        config_mod.build({"default_timeout_s": 700})
    with pytest.raises(config_mod.ConfigError, match="max_timeout_s must be finite"):
        config_mod.build({"max_timeout_s": float("inf")})
    assert any(d.name == "max_timeout_s" and "clamped" in d.description for d in config_mod.key_docs())


def test_startup_warnings_blame_missing_remotes() -> None:
    (w,) = config_mod.startup_warnings(config_mod.Config())
    assert w.startswith("no [[remotes]] declared: every pull will be refused")
    cfg = config_mod.build({"remotes": [{"match": "*:5600"}]})
    assert config_mod.startup_warnings(cfg) == [
        "[[remotes]] match='*:5600' has no page_format: pulls from it will be refused"
    ]


REMOTE = {"match": "*:5600", "page_format": {"kind": "standard", "layout": "LBHNC", "dtype": "bfloat16",
                                            "num_heads": 8, "block_size": 16, "head_size": 128}}


@pytest.mark.parametrize("gpu", [None, 0])
@pytest.mark.parametrize("mode", ["auto", "direct", "mapped", "staged"])
@pytest.mark.parametrize("pool", [0, 1 << 30])
def test_startup_warnings_name_a_gpu_daemon_that_reads_everything_direct(gpu, mode, pool) -> None:
    """On a GPU, every setting that leaves pulls to direct reads is named; the CPU twin (cheap descriptors)
    and a pool that auto, staged or mapped can use are not."""
    settings = {"remotes": [REMOTE], "pull_mode": mode, "staging_bytes": pool}
    if gpu is not None:
        settings["gpu"] = gpu
    if mode == "staged" and not pool:
        with pytest.raises(config_mod.ConfigError, match="needs staging_bytes"):
            config_mod.build(settings)
        return
    warnings = config_mod.startup_warnings(config_mod.build(settings))
    if gpu is None or (mode != "direct" and pool):
        assert warnings == []
        return
    (w,) = warnings
    assert "45-181 x slower than staged" in w and "set staging_bytes and pull_mode 'auto'" in w
    if mode == "direct":
        assert w.startswith("pull_mode 'direct': every pull will read direct")
    elif mode == "mapped":
        assert w.startswith("pull_mode 'mapped' without a staging pool (staging_bytes 0): prefills whose "
                            "pages do not map will read direct")
    else:
        assert w.startswith("pull_mode 'auto' without a staging pool (staging_bytes 0): every pull will read")


def serve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KV_SIDECAR_LOG_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, "-m", "sidecar.cli", "serve", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["long path", "file in the way", "busy metrics port", "staging too large"])
def test_serve_start_failures_are_one_line(tmp_path, case) -> None:
    """Main: the long path hangs in ctx.term() (this times out); the others end in a traceback (a pool that
    cannot be allocated: torch's allocator error, naming no key)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        sock, port = f"{tmp_path}/cpu.sock", "0"
        if case == "long path":
            sock = f"{tmp_path}/{'x' * 120}.sock"
        elif case == "file in the way":
            (tmp_path / "f").write_text("x")
            sock = f"{tmp_path}/f/cpu.sock"
        elif case == "busy metrics port":
            port = str(busy.getsockname()[1])
        pool = str(2**60) if case == "staging too large" else "0"  # beyond any host's address space
        r = serve("--socket", f"ipc://{sock}", "--metrics-port", port, "--staging-bytes", pool)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kv-sidecar: ")]
    assert len(errors) == 1, r.stderr
    key = {"busy metrics port": "metrics_port", "staging too large": "staging_bytes"}.get(case, "socket")
    assert key in errors[0]


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["cpu.sock", "cpu.sock.done"])
def test_serve_never_deletes_a_file_at_its_socket_paths(tmp_path, name) -> None:
    """Main: a regular file at the socket path (a typo in ``socket``) answers connect() with ECONNREFUSED,
    so the daemon took it for a stale socket and deleted it; the completion socket's path was unlinked
    blindly."""
    victim = tmp_path / name
    victim.write_text("someone's notes")
    r = serve("--socket", f"ipc://{tmp_path}/cpu.sock", "--metrics-port", "-1")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kv-sidecar: ")]
    assert errors == [f"kv-sidecar: socket: {victim} exists and is a regular file, not a socket: remove it "
                      "or pick another socket path"], r.stderr
    assert victim.read_text() == "someone's notes"
    assert sorted(os.listdir(tmp_path)) == [name], "the daemon left a socket file behind"


@pytest.mark.e2e
def test_serve_in_a_shared_directory_leaves_it_alone(tmp_path) -> None:
    """Main: the shared 1777 directory is 0700 after the daemon ran."""
    from sidecar import cli

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    proc = cli.spawn_serve(["--socket", f"ipc://{shared}/cpu.sock", "--metrics-port", "-1"],
                           stderr=subprocess.DEVNULL)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(shared / "cpu.sock").st_mode) == 0o600
    assert proc.stop() == 0
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777


@pytest.mark.e2e
def test_a_nixl_backend_without_its_plugin_is_refused_at_start(tmp_path) -> None:
    """Main: NIXL only warns "Skipping backend registration UXC" and the daemon came up ready with an agent
    of no backend; every RegisterCaches then failed (NIXL's KeyError on the missing handle), and /healthz
    said ok."""
    from sidecar import cli

    try:
        proc = cli.spawn_serve(["--socket", f"ipc://{tmp_path}/cpu.sock", "--metrics-port", "-1",
                                "--nixl-backends", '["UXC"]'], stderr=subprocess.PIPE)
    except cli.CliError as exc:
        assert "exited before it was ready (rc=2)" in str(exc)
        return
    proc.stop()
    errors = [line for line in proc.proc.stderr.read().decode().splitlines() if "UXC" in line]
    raise AssertionError(f"serve became ready with nixl_backends ['UXC']: {errors}")
