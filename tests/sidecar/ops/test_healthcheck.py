"""Docker's HEALTHCHECK finds the daemon's port as the daemon does, and says why it is unhealthy."""

import socket

import pytest

from sidecar.cli import spawn_serve
from sidecar.ops import healthcheck


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serve_flags_come_from_a_command_line():
    line = b"/opt/kv-sidecar/bin/python\0/opt/kv-sidecar/bin/kv-sidecar\0serve\0--gpu\0001\0"
    assert healthcheck.serve_argv(line) == ["serve", "--gpu", "1"]
    with pytest.raises(ValueError, match="not a kv-sidecar serve command line"):
        healthcheck.serve_argv(b"/pause\0")


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [
        (["serve", "--gpu", "1"], {}, "http://127.0.0.1:9465/healthz"),  # the default for GPU 1, not 9464
        (["serve", "--gpu", "1"], {"KV_SIDECAR_METRICS_PORT": "19000"}, "http://127.0.0.1:19000/healthz"),
        (["serve", "--metrics-port", "9600", "--metrics-host", "::"], {}, "http://[::1]:9600/healthz"),
    ],
)
def test_the_url_is_the_daemons(monkeypatch, argv, env, want):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert healthcheck.health_url(argv) == want


def test_a_free_or_disabled_port_cannot_be_checked():
    for port in ("0", "-1"):
        with pytest.raises(ValueError, match=f"metrics_port = {port}"):
            healthcheck.health_url(["serve", "--metrics-port", port])


def test_a_running_daemon_is_healthy_on_the_port_its_config_file_names(tmp_path, capsys):
    port = _free_port()
    config = tmp_path / "kv-sidecar.toml"
    config.write_text(f"metrics_port = {port}\n")
    endpoint = f"ipc://{tmp_path}/kv.sock"
    with spawn_serve(["--socket", endpoint, "--config", str(config)]) as daemon:
        assert healthcheck.main(pid=daemon.proc.pid) == 0
        assert f"127.0.0.1:{port}/healthz: 200" in capsys.readouterr().out
    assert healthcheck.main(pid=daemon.proc.pid) == 1  # gone: no /proc entry
    assert "unhealthy" in capsys.readouterr().out


def test_a_proxy_in_the_environment_is_not_asked_for_the_local_endpoint(tmp_path, capsys, monkeypatch):
    """Docker passes the client's proxy settings (HTTP_PROXY, ...) into containers; urllib sends every
    request through them unless NO_PROXY names the host, 127.0.0.1 included, so a healthy daemon was
    reported unhealthy (the proxy cannot reach the container's loopback)."""
    port, proxy = _free_port(), _free_port()  # nothing listens on the proxy's port
    config = tmp_path / "kv-sidecar.toml"
    config.write_text(f"metrics_port = {port}\n")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy}")
    with spawn_serve(["--socket", f"ipc://{tmp_path}/kv.sock", "--config", str(config)]) as daemon:
        assert healthcheck.main(pid=daemon.proc.pid) == 0, capsys.readouterr().out
        assert f"127.0.0.1:{port}/healthz: 200" in capsys.readouterr().out


def test_a_config_file_broken_since_start_does_not_make_a_healthy_daemon_unhealthy(tmp_path, capsys):
    """The check loaded today's file: an edit that broke it (which SIGHUP would refuse) made a running daemon
    look unhealthy, and an orchestrator acting on that would restart it into the broken file."""
    port = _free_port()
    config = tmp_path / "kv-sidecar.toml"
    config.write_text("default_timeout_s = 30\n")
    endpoint = f"ipc://{tmp_path}/kv.sock"
    with spawn_serve(["--socket", endpoint, "--config", str(config), "--metrics-port", str(port)]) as daemon:
        config.write_text("default_timeout_s = [\n")
        assert healthcheck.main(pid=daemon.proc.pid) == 0
        out = capsys.readouterr().out
        assert "the config file does not load" in out and f"127.0.0.1:{port}/healthz: 200" in out
