"""``kv-sidecar reload``: the wait for a SIGHUP's outcome (fake daemon), and a real daemon end to end."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from sidecar import cli
from sidecar.ops import reload as rl
from sidecar.wire import protocol as p


class FakeDaemon:
    """Answers Status like the daemon: a SIGHUP is counted at once, the outcome of the read it starts shows
    ``lag`` asks later."""

    def __init__(self, pid=41, outcome="applied", lag=2, reload=None):
        self.pid, self.outcome, self.lag, self.reload = pid, outcome, lag, reload
        self.sighups = reload.count if reload else 0
        self.signalled: list[tuple[int, int]] = []
        self.asks = 0

    def kill(self, pid, sig):
        self.signalled.append((pid, sig))
        self.sighups += 1

    def ask(self, endpoint, timeout_s):
        self.asks += 1
        if self.signalled and self.outcome is not None:
            if self.lag > 0:
                self.lag -= 1
            else:
                self.reload = p.ReloadStatus(count=self.sighups, outcome=self.outcome)
                self.outcome = None
        return p.StatusReply(nonce=0, registered=False, pid=self.pid, reload=self.reload,
                             sighups=self.sighups)


def run_fake(fake, pid=None, timeout_s=5.0):
    return rl.reload("ipc:///x", pid, timeout_s, kill=fake.kill, ask=fake.ask)


@pytest.mark.parametrize("outcome", ["applied", "unchanged", "refused"])
def test_waits_for_the_daemons_next_reload(outcome):
    earlier = p.ReloadStatus(count=3, outcome="refused", reason="an older one")
    fake = FakeDaemon(outcome=outcome, reload=earlier)
    got = run_fake(fake)
    assert fake.signalled == [(41, signal.SIGHUP)]
    assert (got.count, got.outcome) == (4, outcome)  # not the earlier refusal still on record
    assert fake.asks == 4  # before, two asks while it lags, the one that sees it


def test_a_read_begun_before_our_sighup_is_not_its_outcome():
    """With a reload in flight (its SIGHUP 4, read before the file was edited), ours is the 5th: the 4th's
    outcome, which ends after our signal, does not answer for the edit."""
    fake = FakeDaemon()
    replies = iter([
        p.StatusReply(nonce=0, registered=False, pid=41, sighups=4, reload=p.ReloadStatus(3, "applied")),
        p.StatusReply(nonce=0, registered=False, pid=41, sighups=5, reload=p.ReloadStatus(4, "refused")),
        p.StatusReply(nonce=0, registered=False, pid=41, sighups=5, reload=p.ReloadStatus(5, "applied")),
    ])
    got = rl.reload("ipc:///x", None, 5.0, kill=fake.kill, ask=lambda e, t: next(replies))
    assert (got.count, got.outcome) == (5, "applied")


def test_a_pid_other_than_the_sockets_is_not_signalled():
    fake = FakeDaemon(pid=41)
    with pytest.raises(rl.ReloadFailed, match="served by PID 41, not PID 7"):
        run_fake(fake, pid=7)
    assert fake.signalled == []


@pytest.mark.parametrize("error", [PermissionError(1, "Operation not permitted"),
                                   ProcessLookupError(3, "No such process")])
def test_a_signal_that_cannot_be_sent_is_exit_2_not_a_traceback(error):
    """socket_group lets another user reach the socket, but not signal the daemon (EPERM); or the daemon
    exited between its Status and the signal (ESRCH). The OSError escaped as a traceback with exit 1, which
    this command's contract keeps for "the daemon refused the file"."""

    def kill(pid, sig):
        raise error

    fake = FakeDaemon(pid=41)
    with pytest.raises(rl.ReloadFailed, match=f"cannot signal PID 41: {error.strerror}"):
        rl.reload("ipc:///x", None, 1.0, kill=kill, ask=fake.ask)


def test_an_older_daemon_without_reloads_is_not_signalled():
    fake = FakeDaemon(pid=0)
    with pytest.raises(rl.ReloadFailed, match="does not report reloads"):
        run_fake(fake)
    assert fake.signalled == []


def test_no_outcome_in_time_is_a_failure_not_a_hang():
    fake = FakeDaemon(lag=10**9)
    with pytest.raises(rl.ReloadFailed, match="took the SIGHUP but reported no outcome within 0.1 s"):
        run_fake(fake, timeout_s=0.1)


def test_a_daemon_shutting_down_is_not_called_busy_or_stuck():
    """A daemon draining its pulls after SIGTERM still answers Status, but ignores SIGHUP: the command said
    "its loop is busy or stuck" of a loop that had just answered it. The SIGHUP count says which it is."""
    fake = FakeDaemon(lag=10**9)
    fake.kill = lambda pid, sig: fake.signalled.append((pid, sig))  # SIG_IGN: not counted
    with pytest.raises(rl.ReloadFailed) as failed:
        run_fake(fake, timeout_s=0.1)
    assert "did not take the SIGHUP within 0.1 s: it is shutting down" in str(failed.value)
    assert "stuck" not in str(failed.value)


def test_a_restarted_daemon_is_not_taken_for_the_reload():
    fake = FakeDaemon(lag=10**9)
    asks = iter([41, 42])

    def ask(endpoint, timeout_s):
        return p.StatusReply(nonce=0, registered=False, pid=next(asks))

    with pytest.raises(rl.ReloadFailed, match="restarted"):
        rl.reload("ipc:///x", None, 1.0, kill=fake.kill, ask=ask)


def test_the_wait_asks_over_one_session(tmp_path):
    """Each Status ask of the wait opened a socket of its own: to the daemon, a new session (routing id) per
    ask, one every 20 ms for up to --timeout, each kept until MAX_SESSIONS pushes the idle ones out."""
    from tests.sidecar.ops.test_control import StatusRouter

    with StatusRouter(f"ipc://{tmp_path}/d.sock", lag=5) as router:
        got = rl.reload(router.endpoint, None, 5.0, kill=router.kill)
    assert (got.count, got.outcome) == (1, "applied")
    assert (len(router.identities), router.sessions) == (7, 1)  # before, five while it lags, the one


def test_another_gpus_daemon_at_the_socket_is_not_signalled(tmp_path):
    """`socket` applies only at a restart: edited in the file to GPU 1's socket, `reload --gpu 0` asked GPU
    1's daemon, sent it the SIGHUP, and the daemon of GPU 0 never read the file."""
    from tests.sidecar.ops.test_control import StatusRouter

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # GPU 1's daemon
    try:
        sock = f"ipc://{tmp_path}/gpu1.sock"
        cfg = tmp_path / "kv.toml"
        cfg.write_text(f'socket = "{sock}"\n')
        args = argparse.Namespace(gpu=0, config=str(cfg), socket="", pid=None, timeout=1.0, json=True)
        out: list[str] = []
        with StatusRouter(sock, pid=other.pid, extra={"device": "cuda:1", "config_file": str(cfg)}):
            rc = rl.run(args, environ={}, out=out.append)
        assert other.poll() is None, "signalled"
        error = json.loads(out[0])["error"]
        assert rc == 2 and f"PID {other.pid}, which serves cuda:1, not GPU 0: not signalled" in error
        assert "`socket`" in error
    finally:
        other.kill()
        other.wait()


def test_a_daemon_reading_no_file_is_not_the_one_a_file_names(tmp_path):
    """A daemon started from no file (variables only) reports config_file "", which was taken for "an older
    daemon, not said": with a.toml edited to its socket, `reload --config a.toml` signalled it, and it re-read
    no file. A daemon that reports its device is new enough to report its file: "" there means none."""
    from tests.sidecar.ops.test_control import StatusRouter

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the file-less daemon
    try:
        sock = f"ipc://{tmp_path}/cpu.sock"
        cfg = tmp_path / "a.toml"
        cfg.write_text(f'socket = "{sock}"\n')
        args = argparse.Namespace(gpu=None, config=str(cfg), socket="", pid=None, timeout=1.0, json=True)
        out: list[str] = []
        with StatusRouter(sock, pid=other.pid, extra={"device": "cpu", "config_file": ""}):
            rc = rl.run(args, environ={}, out=out.append)
        assert other.poll() is None, "signalled"
        error = json.loads(out[0])["error"]
        assert rc == 2 and f"PID {other.pid}, which reads no config file, not {cfg}" in error
    finally:
        other.kill()
        other.wait()
    older = p.StatusReply(nonce=0, registered=False, pid=7)  # neither field: older, not checked
    assert rl.another_daemon(older, 0, str(cfg)) == ""


def test_describe_names_keys_and_reasons():
    applied = p.ReloadStatus(count=1, outcome="applied", applied=["remotes"], restart_pending=["socket"])
    assert rl.describe(applied) == ["reload applied: remotes",
                                    "changed in the file but applied only by a restart: socket"]
    refused = p.ReloadStatus(count=2, outcome="refused", reason="key x: bad")
    assert rl.describe(refused) == ["reload refused, the daemon keeps its running config: key x: bad"]


def test_a_config_file_that_does_not_load_still_finds_the_socket(tmp_path):
    broken = tmp_path / "kv.toml"
    broken.write_text("socket = [\n")
    args = argparse.Namespace(gpu=3, config=None, socket="")
    target = rl.target_of(args, {"KV_SIDECAR_CONFIG": str(broken)})
    assert target.endpoint.endswith("gpu3.sock") and "does not load" in target.note
    assert (target.gpu, target.config_file) == (3, str(broken))


def test_a_newer_daemons_status_fields_are_ignored():
    """doctor and reload may be older than the daemon they ask: an unknown field is not a failed check."""
    newer = {"type": "StatusReply", "nonce": 1, "registered": False, "pid": 5, "from_the_future": [1],
             "reload": {"count": 1, "outcome": "applied", "also_new": True},
             "peers": [{"address": "h:1", "engine_id": "e", "tp_rank": 0, "new_too": 1}]}
    import msgspec

    reply = p.decode_to_shim(msgspec.msgpack.encode(newer))
    assert (reply.pid, reply.reload.outcome, reply.peers[0].address) == (5, "applied", "h:1")


# ---------------------------------------------------------------------------------------------- end to end


def _metrics(url: str) -> dict[str, float]:
    """Every sample, keyed ``name`` or ``name{label="value"}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _reload(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", "reload", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.e2e
def test_reload_reports_what_a_real_daemon_did(tmp_path):
    """A typo in the file was a log line only: `kill -HUP` succeeded and the daemon ran the older config.
    Now the command exits 1 with the daemon's reason, and the metrics say so until a good reload."""
    cfg = tmp_path / "kv.toml"
    cfg.write_text("default_timeout_s = 30\n")
    sock = f"ipc://{tmp_path}/s/cpu.sock"
    with cli.spawn_serve(["--config", str(cfg), "--socket", sock, "--metrics-port", "0"],
                         stderr=subprocess.DEVNULL) as d:
        where = ["--config", str(cfg), "--socket", sock]
        m = _metrics(d.metrics_url)
        assert m["kv_sidecar_config_last_reload_successful"] == 1
        assert m['kv_sidecar_config_reloads_total{outcome="refused"}'] == 0

        cfg.write_text("default_timeout_s = 20\n")
        done = _reload(*where, "--pid", str(d.proc.pid))
        assert (done.returncode, done.stdout) == (0, "reload applied: default_timeout_s\n"), done.stderr

        cfg.write_text("default_timeout_s = 'twenty'\n")
        done = _reload(*where, "--json")
        out = json.loads(done.stdout)
        assert done.returncode == 1 and not out["ok"] and out["outcome"] == "refused", done
        assert "default_timeout_s" in out["reason"] and out["count"] == 2
        m = _metrics(d.metrics_url)
        assert m["kv_sidecar_config_last_reload_successful"] == 0
        assert m['kv_sidecar_config_reloads_total{outcome="refused"}'] == 1
        assert m['kv_sidecar_config_reloads_total{outcome="applied"}'] == 1

        cfg.write_text("default_timeout_s = 20\nmax_inflight = 8\n")
        done = _reload(*where)
        assert done.returncode == 0, done
        assert done.stdout.splitlines() == ["reload: nothing to apply (no live key changed)",
                                            "changed in the file but applied only by a restart: max_inflight"]
        m = _metrics(d.metrics_url)
        assert m["kv_sidecar_config_last_reload_successful"] == 1
        assert m["kv_sidecar_config_restart_pending"] == 1

        done = _reload("--socket", sock, "--pid", "1")
        assert done.returncode == 2 and f"served by PID {d.proc.pid}, not PID 1" in done.stderr
        assert d.proc.poll() is None


@pytest.mark.e2e
def test_a_daemon_started_from_an_empty_file_reloads_it(tmp_path):
    """Settings all in KV_SIDECAR_* variables and an empty TOML file (the unit always names one): every
    `systemctl reload` was refused as "no keys" and the alert fired, though nothing would change."""
    cfg = tmp_path / "kv.toml"
    cfg.write_text("# everything is in /etc/kv-sidecar/kv-sidecar.env\n")
    sock = f"ipc://{tmp_path}/s/cpu.sock"
    with cli.spawn_serve(["--config", str(cfg), "--socket", sock, "--metrics-port", "0"],
                         stderr=subprocess.DEVNULL):
        done = _reload("--config", str(cfg), "--socket", sock)
        assert (done.returncode, done.stdout) == (0, "reload: nothing to apply (no live key changed)\n"), done


@pytest.mark.e2e
def test_a_socket_edited_to_another_daemons_is_not_signalled(tmp_path):
    """Two daemons, each from its own file; A's file now names B's socket (`socket` applies at a restart).
    `reload --config a.toml` asked B, signalled it and printed B's outcome, exit 0: A never re-read its
    file. Now B's Status says it reads b.toml (and serves cpu, not GPU 0), so it is not signalled."""
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a_sock, b_sock = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    a.write_text(f'socket = "{a_sock}"\n')
    b.write_text(f'socket = "{b_sock}"\n')
    with cli.spawn_serve(["--config", str(a), "--metrics-port", "-1"], stderr=subprocess.DEVNULL), \
            cli.spawn_serve(["--config", str(b), "--metrics-port", "0"], stderr=subprocess.DEVNULL) as d:
        a.write_text(f'socket = "{b_sock}"\ndefault_timeout_s = 20\n')
        done = _reload("--config", str(a))
        assert done.returncode == 2, done
        assert f"which reads {b}, not {a}: not signalled" in done.stderr and "`socket`" in done.stderr
        done = _reload("--gpu", "0", "--socket", b_sock)
        assert done.returncode == 2 and "which serves cpu, not GPU 0" in done.stderr, done
        assert _metrics(d.metrics_url)['kv_sidecar_config_reloads_total{outcome="unchanged"}'] == 0
        done = _reload("--config", str(b))  # the daemon meant
        assert (done.returncode, done.stdout) == (0, "reload: nothing to apply (no live key changed)\n"), done
