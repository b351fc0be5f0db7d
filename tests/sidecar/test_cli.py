"""The command line: fast help, generated serve flags, dependency and config errors, version."""

import json
import os
import subprocess
import sys

import msgspec
import pytest

from sidecar import cli
from sidecar.ops import config, settled_file
from sidecar.ops.config import Config


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_help_is_light():
    code = ("import sys; from sidecar import cli; cli.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'nixl', 'numpy', 'uvloop', 'prometheus_client') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    top = run("--help")
    assert top.returncode == 0
    for command in ("serve", "bench", "emulate-prefill", "doctor", "demo", "version"):
        assert command in top.stdout


def test_serve_help_documents_every_key():
    out = run("serve", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for name in Config.__struct_fields__:
        assert f"--{name.replace('_', '-')}" in text
        assert f"KV_SIDECAR_{name.upper()}" in text
    assert "requests read and converted at the same time" in text


def test_flags_become_config_values():
    args = cli.build_parser().parse_args(["serve", "--max-inflight", "7", "--log-json", "--remotes",
                                          '[{"match": "*:*"}]', "--socket", "ipc:///tmp/x.sock"])
    over = cli.config_overrides(args)
    assert over == {"max_inflight": 7, "log_json": True, "remotes": [{"match": "*:*"}],
                    "socket": "ipc:///tmp/x.sock"}


def test_serve_reports_bad_config_naming_the_key():
    out = run("serve", "--max-inflight", "0", "--metrics-port", "-1")
    assert out.returncode == 2
    assert "configuration:" in out.stderr and "key max_inflight" in out.stderr


def test_serve_reports_a_config_file_that_is_not_utf8_in_one_line(tmp_path):
    """Main: a Latin-1 comment (an editor's 'café') ended serve in a UnicodeDecodeError traceback; TOML is
    UTF-8, and the file is the operator's to fix like any other config error."""
    toml = tmp_path / "kv.toml"
    toml.write_bytes('log_level = "INFO"  # café\n'.encode("latin-1"))
    out = run("serve", "--config", str(toml), "--metrics-port", "-1", "--socket", f"ipc://{tmp_path}/s.sock")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"kv-sidecar: configuration: config file {toml}: not UTF-8"), out.stderr


def test_missing_dependencies_are_found_without_importing():
    needs = {"numpy": "x", "kv_sidecar_no_such_module": "pip install nothing"}
    assert cli.missing_dependencies(needs) == ["kv_sidecar_no_such_module"]


def test_serve_names_missing_dependencies(monkeypatch, capsys):
    monkeypatch.setattr(cli, "missing_dependencies", lambda: ["nixl"])
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "needs nixl" in err and "pip install 'kv-sidecar[daemon,nixl]'" in err and "ROCm" in err


def test_missing_subcommand_module_is_named(monkeypatch, capsys):
    monkeypatch.setitem(cli.DELEGATED, "doctor", ("sidecar.no_such_doctor", "missing"))
    assert cli.main(["doctor"]) == 2
    assert "sidecar.no_such_doctor is not part of this installation" in capsys.readouterr().err


def test_delegated_subcommand_gets_its_arguments():
    out = run("emulate-prefill", "--help")
    assert out.returncode == 0 and "--num-blocks" in out.stdout


def test_version_json():
    out = run("version", "--json")
    assert out.returncode == 0
    found = json.loads(out.stdout)
    from sidecar import __version__

    assert found["kv-sidecar"] == __version__
    assert found["torch"] and found["pyzmq"] and found["msgspec"] and found["nixl"]
    assert {"vllm", "aiter"} <= set(found)


@pytest.mark.e2e
def test_serve_starts_and_stops_on_sigterm(tmp_path):
    socket = f"ipc://{tmp_path}/s/cpu.sock"
    proc = cli.spawn_serve(["--socket", socket, "--metrics-port", "0", "--log-json"], stderr=subprocess.PIPE)
    assert proc.ready["device"] == "cpu" and proc.ready["socket"].endswith("/s/cpu.sock")
    assert proc.stop() == 0
    lines = proc.proc.stderr.read().decode().splitlines()
    logs = [json.loads(line) for line in lines if line.startswith("{")]
    assert any(rec["msg"].startswith("kv-sidecar") and "serving cpu" in rec["msg"] for rec in logs)
    assert logs[-1]["msg"] == "kv-sidecar stopped"


class _Lines:
    """A subprocess stream read on a thread, so a wait for a line has a bound."""

    def __init__(self, stream) -> None:
        import queue
        import threading

        self.lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in stream:
                self.lines.put(line.decode())
            self.lines.put(None)  # the process closed it: exited

        threading.Thread(target=read, daemon=True).start()

    def until(self, needle: str, timeout_s: float = 60.0) -> str:
        import queue
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {needle!r} within {timeout_s} s") from None
            if line is None:
                raise AssertionError(f"the process exited before a line with {needle!r}")
            if needle in line:
                return line


@pytest.mark.e2e
def test_a_sighup_during_start_up_is_applied_once_serving_not_fatal(tmp_path):
    """A SIGHUP before the loop's handler was in place (the imports, the NIXL agent's seconds-long start)
    took its default action: the daemon died, rc -1. A pod's ConfigMap reload (pkill -HUP) or a
    `systemctl reload` racing a restart hits that window."""
    import signal

    toml = tmp_path / "kv.toml"
    toml.write_text("default_timeout_s = 30.0\n")
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "serve", "--config", str(toml), "--socket",
                             f"ipc://{tmp_path}/s/cpu.sock", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        err, out = _Lines(proc.stderr), _Lines(proc.stdout)
        err.until("metrics on")  # inside the daemon's start, before the socket is bound
        toml.write_text("default_timeout_s = 20.0\n")
        proc.send_signal(signal.SIGHUP)
        try:
            out.until('"event": "ready"')
        except AssertionError:
            raise AssertionError(f"serve exited, rc {proc.wait(10)}") from None
        assert "default_timeout_s" in err.until("SIGHUP: applied")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.e2e
def test_sighups_during_shutdown_do_not_kill_the_daemon(tmp_path):
    """Once the loop closed, SIGHUP had its default action again: a SIGHUP in the last moments of a stop
    killed the daemon by signal (rc -1) instead of its clean exit 0."""
    import signal
    import time

    proc = cli.spawn_serve(["--socket", f"ipc://{tmp_path}/s/cpu.sock", "--metrics-port", "0"],
                           stderr=subprocess.DEVNULL)
    proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while proc.proc.poll() is None and time.monotonic() < deadline:
        try:
            proc.signal(signal.SIGHUP)
        except ProcessLookupError:
            break
        time.sleep(0.005)
    assert proc.stop() == 0


def test_every_command_says_what_it_is_for(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "run sidecar." not in out  # not the module name: what the command is for
    for name, (_module, what) in {**cli.DELEGATED, **cli.BENCHES}.items():
        assert what.split()[0] in out or name in cli.BENCHES, (name, what)


@pytest.fixture
def logging_as_it_was():
    """setup_logging changes the process's root logger: give it back to pytest afterwards."""
    import logging

    root, ours = logging.getLogger(), logging.getLogger("kv_sidecar")
    handlers, root_level, our_level = root.handlers[:], root.level, ours.level
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    ours.setLevel(our_level)


def test_log_level_reaches_the_nixl_agents_lines(capsys, logging_as_it_was):
    """Main: the agent logged as ``sidecar.nixl.agent``, outside ``kv_sidecar`` whose level log_level (and
    SIGHUP) sets: at DEBUG its INFO lines never showed, at ERROR its warnings still did."""
    from sidecar.daemon.app import Daemon
    from sidecar.nixl import reads

    cli.setup_logging("DEBUG", False)
    reads.log.info("agent info line")
    assert "agent info line" in capsys.readouterr().err
    cli.setup_logging("ERROR", False)
    reads.log.warning("agent warning line")
    assert "agent warning line" not in capsys.readouterr().err
    cli.setup_logging("INFO", False)
    daemon = Daemon(Config(), reload=lambda: Config(log_level="ERROR"), bind=False)
    daemon.reload()  # SIGHUP
    reads.log.warning("agent warning after reload")
    assert "agent warning after reload" not in capsys.readouterr().err


def test_every_module_logs_under_kv_sidecar():
    """log_level sets the level of the ``kv_sidecar`` logger only: a module's logger named otherwise (such as
    ``getLogger(__name__)``, ``sidecar.…``) would not follow it."""
    import ast
    from pathlib import Path

    import sidecar

    outside = []
    for path in sorted(Path(sidecar.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger"):
                continue
            name = node.args[0] if node.args else None
            if name is None:
                continue  # the root logger (cli.setup_logging)
            if not (isinstance(name, ast.Constant) and str(name.value).split(".")[0] == "kv_sidecar"):
                outside.append(f"{path.name}:{node.lineno}: {ast.unparse(name)}")
    assert outside == []


@pytest.mark.parametrize("running, in_file", [(1 << 30, 0), (0, 1 << 30)])
def test_a_reloads_warnings_are_about_the_config_that_runs(caplog, running, in_file):
    """Main: SIGHUP warned about the file's values, restart-only ones included: a file with staging_bytes 0
    made a GPU daemon that keeps its 1 GiB pool say every pull will now read direct, and a file with a pool
    kept quiet about a daemon that still has none."""
    import logging

    from sidecar.daemon.app import Daemon
    from sidecar.ops.config import RemoteRule

    rules = [RemoteRule(match="*:5600", page_format=None)]
    daemon = Daemon(Config(gpu=0, staging_bytes=running, remotes=rules), bind=False,
                    reload=lambda: Config(gpu=0, staging_bytes=in_file, remotes=rules, default_timeout_s=20))
    with caplog.at_level(logging.INFO, logger="kv_sidecar"):
        daemon.reload()  # SIGHUP
    lines = [r.getMessage() for r in caplog.records]
    assert "SIGHUP: applied default_timeout_s" in lines
    assert daemon.config.staging_bytes == running
    direct = [line for line in lines if "will read direct" in line]
    assert bool(direct) == (running == 0), lines


def test_status_reports_the_latest_reload():
    """``kv-sidecar reload`` waits for this: each SIGHUP's outcome, counted, with the keys and the reason."""
    from sidecar.daemon.app import Daemon

    files = iter([Config(default_timeout_s=20), ValueError("key x: bad"), Config(default_timeout_s=20)])

    def read() -> Config:
        got = next(files)
        if isinstance(got, Exception):
            raise got
        return got

    daemon = Daemon(Config(), reload=read, bind=False)
    assert daemon._status(1).reload is None and daemon._status(1).pid == os.getpid()
    outcomes = []
    for _ in range(3):
        daemon.reload()  # SIGHUP
        r = daemon._status(1).reload
        outcomes.append((r.count, r.outcome, r.applied, r.reason))
    assert outcomes == [(1, "applied", ["default_timeout_s"], ""), (2, "refused", [], "key x: bad"),
                        (3, "unchanged", [], "")]
    assert daemon.metrics.config_last_reload_ok._value.get() == 1


# --------------------------------------------------------------------------- reloading a file being rewritten


def _rewrite_in_place(path, chunks: list[str], started, stop=None, pause_s: float = 0.005) -> None:
    """An editor saving in place: truncate, then write ``chunks`` with a pause between them; again and again
    until ``stop`` is set (once without one). ``started`` is set once the first chunk is in."""
    import time

    with open(path, "r+b", buffering=0) as f:
        while True:
            f.seek(0)
            f.truncate()
            for i, chunk in enumerate(chunks):
                if i:
                    time.sleep(pause_s)
                f.write(chunk.encode())
                started.set()
            if stop is None or stop.is_set():
                return


_FORMAT = ('page_format = { kind = "standard", layout = "LBHNC", dtype = "bfloat16", num_heads = 8, '
           'block_size = 16, head_size = 128 }\n')


@pytest.mark.parametrize("over_and_over", [False, True], ids=["once", "over-and-over"])
def test_a_reload_mid_rewrite_applies_the_whole_file_or_nothing(tmp_path, caplog, monkeypatch, over_and_over):
    """Main: a SIGHUP while an editor or a config tool rewrote the file in place (truncate, then write) read
    whatever was there: cut at a line it is still TOML, the missing keys took their defaults, and the reload
    applied them to the running daemon (remotes = []: every pull refused). Now a reload reads the file once
    it stays unchanged: rewritten once, the whole new file is applied; rewritten over and over, nothing is,
    and the error names the file."""
    import logging
    import threading
    import tomllib

    from sidecar.daemon.app import Daemon

    path = tmp_path / "kv.toml"
    path.write_text(f'default_timeout_s = 30.0\n[[remotes]]\nmatch = "10.0.0.*:5600"\n{_FORMAT}')
    running = config.load(str(path), environ={})
    chunks = ["default_timeout_s = 20.0\n", '[[remotes]]\nmatch = "10.0.1.*:5600"\n', _FORMAT]
    cuts = [config.build(tomllib.loads("".join(chunks[:i]))) for i in range(len(chunks) + 1)]
    assert len({msgspec.json.encode(cut) for cut in [running, *cuts]}) == 5  # each cut: a config of its own
    daemon = Daemon(running, bind=False, reload=lambda: config.load(str(path), environ={}))  # main's serve's
    # The writer never pauses 50 ms on its own, but a loaded host can stall its thread that long, and the file
    # then looks settled (seen once, run beside a CI run on 2 cores); a 0.25 s stall is far rarer.
    monkeypatch.setattr(settled_file, "SETTLE_S", 0.25)
    started, stop = threading.Event(), threading.Event() if over_and_over else None
    writer = threading.Thread(target=_rewrite_in_place, args=(path, chunks, started, stop))
    writer.start()
    try:
        assert started.wait(5)
        with caplog.at_level(logging.INFO, logger="kv_sidecar"):
            daemon.reload()  # SIGHUP
    finally:
        if stop is not None:
            stop.set()
        writer.join(5)
    if over_and_over:
        assert daemon.config == running, (daemon.config.default_timeout_s, daemon.config.remotes)
        assert "configuration not reloaded: config file" in caplog.text
        assert "changed while being read" in caplog.text and "write it atomically" in caplog.text
    else:
        assert daemon.config == cuts[-1], (daemon.config.default_timeout_s, daemon.config.remotes)


def test_a_reload_of_an_emptied_file_keeps_the_running_config(tmp_path, caplog):
    import logging

    from sidecar.daemon.app import Daemon

    path = tmp_path / "kv.toml"
    path.write_text(f'default_timeout_s = 20.0\n[[remotes]]\nmatch = "10.0.0.*:5600"\n{_FORMAT}')
    running = config.load(str(path), environ={})
    daemon = Daemon(running, bind=False, reload=lambda: config.load(str(path), environ={}, reloading=True))
    path.write_text("")
    with caplog.at_level(logging.INFO, logger="kv_sidecar"):
        daemon.reload()  # SIGHUP
    assert daemon.config == running
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "kv.toml has no keys (empty, 0 bytes)" in errors[0], errors


def test_a_reload_of_an_unreadable_file_keeps_the_restart_still_pending(tmp_path):
    """A reload refused because the file did not load said no restart was pending (Status, the gauge), though
    the restart-only key the last readable file changed still waited for one: that file was not read."""
    from sidecar.daemon.app import Daemon

    path = tmp_path / "kv.toml"
    path.write_text("default_timeout_s = 20.0\n")
    running = config.load(str(path), environ={})
    daemon = Daemon(running, bind=False, reload=lambda: config.load(str(path), environ={}, reloading=True))
    path.write_text("default_timeout_s = 20.0\nmax_inflight = 8\n")
    daemon.reload()  # SIGHUP
    assert (daemon.last_reload.outcome, daemon.last_reload.restart_pending) == ("unchanged", ["max_inflight"])
    path.write_text("default_timeout_s = 'twenty'\nmax_inflight = 8\n")
    daemon.reload()
    assert daemon.last_reload.outcome == "refused" and "default_timeout_s" in daemon.last_reload.reason
    assert daemon.last_reload.restart_pending == ["max_inflight"]
    assert daemon.metrics.config_restart_pending._value.get() == 1  # noqa: SLF001


def test_a_sighup_reads_the_file_off_the_loop_and_applies_it_on_it(tmp_path):
    """The read waits SETTLE_S for the file to settle (up to SETTLE_BOUND_S): in a thread, so the loop keeps
    serving meanwhile. SIGHUPs while it reads make one more read, not one each."""
    import asyncio
    import time

    from sidecar.daemon.app import Daemon

    path = tmp_path / "kv.toml"
    path.write_text("default_timeout_s = 20.0\n")
    reads = []

    def reload():
        reads.append(time.monotonic())
        return config.load(str(path), environ={}, reloading=True)

    daemon = Daemon(Config(), bind=False, reload=reload)

    async def main():
        ticks, deadline = 0, time.monotonic() + 10

        async def until(done) -> None:
            nonlocal ticks
            while not done():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
                ticks += 1

        daemon.on_sighup()
        daemon.on_sighup()  # before the read began: that read covers it
        await until(lambda: reads)
        daemon.on_sighup()  # while it reads
        daemon.on_sighup()
        await until(lambda: daemon._reloading.done())  # noqa: SLF001
        assert ticks >= 10, ticks  # the loop ran all along: two reads wait 2 x SETTLE_S
        assert daemon.config.default_timeout_s == 20.0

    asyncio.run(main())
    assert len(reads) == 2


@pytest.mark.e2e
def test_serve_refuses_to_reload_an_emptied_file_and_reloads_the_next_one(tmp_path):
    """Main: `: > kv.toml` (or a rewrite caught between its truncate and its write), then SIGHUP, set every
    reloadable key of a running daemon back to its default: remotes = [], every pull refused."""
    import signal

    toml = tmp_path / "kv.toml"
    toml.write_text('default_timeout_s = 20.0\n[[remotes]]\nmatch = "*:5600"\n' + _FORMAT)
    proc = cli.spawn_serve(["--config", str(toml), "--socket", f"ipc://{tmp_path}/s/cpu.sock",
                            "--metrics-port", "-1"], stderr=subprocess.PIPE)
    try:
        err = _Lines(proc.proc.stderr)
        toml.write_text("")
        proc.signal(signal.SIGHUP)
        line = err.until("SIGHUP:", timeout_s=10)
        assert "configuration not reloaded" in line and "kv.toml has no keys (empty, 0 bytes)" in line, line
        toml.write_text('default_timeout_s = 25.0\n[[remotes]]\nmatch = "*:5600"\n' + _FORMAT)
        proc.signal(signal.SIGHUP)
        assert err.until("SIGHUP:", timeout_s=10).rstrip().endswith("SIGHUP: applied default_timeout_s")
        assert proc.stop() == 0
    finally:
        proc.proc.kill()
        proc.proc.wait()


@pytest.mark.e2e
def test_a_daemon_started_from_a_keyless_file_finds_it_again_after_a_rename(tmp_path):
    """A daemon started from a key-less file (every key from KV_SIDECAR_* variables) reloaded without the
    wait for a file missing for a moment, the one editors' rename-saves need: its SIGHUP after a
    rename-save was refused with "No such file" although the file was back milliseconds later."""
    import signal
    import time

    toml = tmp_path / "kv.toml"
    toml.write_text("# every key comes from the environment\n")
    proc = cli.spawn_serve(["--config", str(toml), "--socket", f"ipc://{tmp_path}/s/cpu.sock",
                            "--metrics-port", "-1"], env={"KV_SIDECAR_DEFAULT_TIMEOUT_S": "20"},
                           stderr=subprocess.PIPE)
    try:
        err = _Lines(proc.proc.stderr)
        os.rename(toml, tmp_path / "kv.toml~")  # the editor's backup by rename, then its save
        proc.signal(signal.SIGHUP)
        time.sleep(0.15)
        (tmp_path / "kv.new").write_text("# every key comes from the environment, still\n")
        os.rename(tmp_path / "kv.new", toml)
        line = err.until("SIGHUP:", timeout_s=10)
        assert line.rstrip().endswith("SIGHUP: nothing to apply"), line
        assert proc.stop() == 0
    finally:
        proc.proc.kill()
        proc.proc.wait()


def test_serve_reads_a_config_pipe_once(tmp_path):
    """``serve --config FIFO``: start-up read the file a second time to see whether it had keys (a reload of
    a key-less file is refused unless the daemon started from one), after ``load`` had drained the pipe. The
    second open of a named FIFO waits for a writer that is gone: start-up hung before the daemon began (the
    hang fixed in read_settled, back by another way in). The daemon's run is stubbed: start-up only."""
    import threading

    fifo = tmp_path / "kv.toml"
    os.mkfifo(fifo)
    code = ("import sys, uvloop; from sidecar import cli\n"
            "def stub(coro, **kw):\n"
            "    coro.close(); print('serving', flush=True); return 0\n"
            "uvloop.run = stub\n"
            "sys.exit(cli.main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--config", str(fifo), "--socket",
                             f"ipc://{tmp_path}/s/cpu.sock", "--metrics-port", "-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def render() -> None:
        with open(fifo, "wb", buffering=0) as f:
            f.write(b"default_timeout_s = 20.0\n")

    writer = threading.Thread(target=render, daemon=True)
    writer.start()
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"serve --config FIFO still starting after 20 s: {err[-2000:]}")
    assert proc.returncode == 0 and "serving" in out, err[-2000:]


def test_a_sighup_as_the_loop_lets_go_of_it_does_not_kill_the_daemon(tmp_path):
    """At stop, ``run`` took SIGHUP from the loop (which sets its default action back: terminate), then
    ignored it: a SIGHUP between the two killed the daemon by signal on its way out, its shutdown undone.
    Here one comes right after each removal of a loop's signal handler (asyncio's loop), at stop and close."""
    code = f"""
import asyncio, os, signal, sys
from asyncio import unix_events
from sidecar.daemon import app
from sidecar.ops.config import Config
from sidecar.standins.fake_transfer import FakePort

real = unix_events._UnixSelectorEventLoop.remove_signal_handler
def remove(self, sig):
    out = real(self, sig)
    os.kill(os.getpid(), signal.SIGHUP)  # any removal: the loop's own at its close too
    return out
unix_events._UnixSelectorEventLoop.remove_signal_handler = remove
app.Daemon.__init__.__kwdefaults__["make_port"] = lambda _c: FakePort()
cfg = Config(socket="ipc://{tmp_path}/s/cpu.sock", metrics_port=-1)
sys.exit(asyncio.run(app.run(cfg, on_started=lambda d: d.request_stop())))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
