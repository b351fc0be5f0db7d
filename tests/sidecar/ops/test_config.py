"""Config: defaults, file < variables < flags, errors that name the key, help generated from the Struct."""

import msgspec
import pytest

from sidecar.ops import config as c
from sidecar.ops import settled_file
from sidecar.wire.formats import PageFormat


def test_defaults_are_the_cpu_twin_on_loopback():
    cfg = c.load(environ={})
    assert cfg.gpu is None and cfg.device == "cpu"
    assert cfg.socket_endpoint == "ipc:///run/kv-sidecar/cpu.sock"
    assert cfg.metrics_host == "127.0.0.1" and cfg.metrics_port is None and cfg.http_port == 9464
    assert (cfg.max_inflight, cfg.pull_mode) == (64, "auto")
    assert (cfg.heartbeat_interval_s, cfg.lease_s) == (5.0, 30.0)
    assert cfg.nixl_backends == ["UCX"] and cfg.remotes == []
    gpu = c.load(environ={"KV_SIDECAR_GPU": "3"})
    assert gpu.device == "cuda:3" and gpu.socket_endpoint == "ipc:///run/kv-sidecar/gpu3.sock"
    assert gpu.http_port == 9467  # two daemons of one host never collide by default


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text("""
max_inflight = 8
socket = "ipc:///tmp/from-file.sock"
log_level = "DEBUG"
nixl_backends = ["UCX", "POSIX"]

[[remotes]]
match = "10.0.0.*:5600"
convert = false
page_format = { kind = "standard", layout = "LBHNC", dtype = "bfloat16", num_heads = 8, block_size = 16, \
head_size = 128 }
""")
    env = {"KV_SIDECAR_MAX_INFLIGHT": "16", "KV_SIDECAR_SOCKET_GROUP": "1000", "KV_SIDECAR_LOG_JSON": "yes",
           "PATH": "/bin"}
    cfg = c.load(str(path), environ=env, overrides={"max_inflight": 32})
    assert cfg.max_inflight == 32  # flag over variable over file
    assert cfg.socket == "ipc:///tmp/from-file.sock" and cfg.log_level == "DEBUG"
    assert cfg.socket_group == "1000"  # a str key keeps digits as text
    assert cfg.log_json is True and cfg.nixl_backends == ["UCX", "POSIX"]
    rule = cfg.remotes[0]
    assert rule.match == "10.0.0.*:5600" and rule.convert is False
    assert rule.page_format == PageFormat(kind="standard", layout="LBHNC", dtype="bfloat16", num_heads=8,
                                          block_size=16, head_size=128)
    assert c.load(environ={"KV_SIDECAR_CONFIG": str(path)}).max_inflight == 8


def test_json_values_in_variables():
    cfg = c.load(environ={"KV_SIDECAR_REMOTES": '[{"match": "*:*"}]', "KV_SIDECAR_NIXL_BACKENDS": '["UCX"]',
                          "KV_SIDECAR_DEFAULT_TIMEOUT_S": "2.5", "KV_SIDECAR_GPU": "null"})
    assert cfg.remotes == [c.RemoteRule(match="*:*")] and cfg.default_timeout_s == 2.5 and cfg.gpu is None


@pytest.mark.parametrize(("env", "needle"), [
    ({"KV_SIDECAR_MAX_INFLIGHT": "0"}, "key max_inflight: Expected `int` >= 1"),
    ({"KV_SIDECAR_MAX_INFLIGHT": "lots"}, "value 'lots' for 'max_inflight' is not valid JSON"),
    ({"KV_SIDECAR_MAX_INFLGHT": "3"}, "variable KV_SIDECAR_MAX_INFLGHT: no config key 'max_inflght'"),
    ({"KV_SIDECAR_SOCKET": "tcp://0.0.0.0:5555"}, "must be an ipc:// endpoint"),
    ({"KV_SIDECAR_PULL_MODE": "fast"}, "key pull_mode: Invalid enum value 'fast'"),
    ({"KV_SIDECAR_GPU": "-1"}, "key gpu: Expected `int` >= 0"),
    ({"KV_SIDECAR_METRICS_PORT": "70000"}, "key metrics_port: Expected `int` <= 65535"),
    ({"KV_SIDECAR_REMOTES": '[{"match": "nohost"}]'}, "must be host:port"),
    ({"KV_SIDECAR_REMOTES": '[{"match": "*:*", "colour": 1}]'}, "key remotes[0]: Object contains unknown"),
    ({"KV_SIDECAR_PULL_MODE": "staged"}, "pull_mode 'staged' needs staging_bytes > 0"),
    ({"KV_SIDECAR_LEASE_S": "2"}, "lease_margin_s 2.0 must be below lease_s 2.0"),
    ({"KV_SIDECAR_LOG_LEVEL": "LOUD"}, "key log_level: Invalid enum value 'LOUD'"),
    ({"KV_SIDECAR_METRICS_HOST": ""}, "metrics_host must not be empty"),  # it bound every address
    # renewals that come after the lease they renew ran out: no lease was ever renewed
    ({"KV_SIDECAR_HEARTBEAT_INTERVAL_S": "18"}, "heartbeat_interval_s 18 must be below lease_s * 2 // 3 - "
                                                "lease_margin_s = 18"),
    ({"KV_SIDECAR_LEASE_S": "4"}, "heartbeat_interval_s 5 must be below"),
])
def test_errors_name_the_key(env, needle):
    with pytest.raises(c.ConfigError) as info:
        c.load(environ=env)
    assert needle in str(info.value)


@pytest.mark.parametrize("key", ["shutdown_grace_s", "conversion_max_step_delay_us",
                                 "gil_switch_interval_us"])
def test_no_float_key_takes_inf(tmp_path, key):
    """TOML writes inf; only four keys refused it: a traceback at start (the step delay), a zero GIL
    switch interval, a shutdown waiting out every deadline."""
    path = tmp_path / "kv-sidecar.toml"
    path.write_text(f"{key} = inf\n")
    with pytest.raises(c.ConfigError, match=f"{key} must be finite, got inf"):
        c.load(str(path), environ={})


def test_file_errors(tmp_path):
    with pytest.raises(c.ConfigError, match="config file .*missing.toml: No such file"):
        c.load(str(tmp_path / "missing.toml"), environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("max_inflight = \n")
    with pytest.raises(c.ConfigError, match="invalid TOML"):
        c.load(str(bad), environ={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("max_inflihgt = 3\n")
    with pytest.raises(c.ConfigError, match="unknown field `max_inflihgt`"):
        c.load(str(unknown), environ={})


def test_help_covers_every_key_with_its_description():
    text = c.help_text()
    for field in msgspec.structs.fields(c.Config):
        assert f"  {field.name} (" in text
    docs = {d.name: d for d in c.key_docs()}
    assert set(docs) == set(c.Config.__struct_fields__)
    assert all(d.description for d in docs.values())
    assert docs["pull_mode"].type == "auto|direct|mapped|staged" and docs["nixl_backends"].default == ["UCX"]


def test_reload_splits_live_and_restart_keys():
    old = c.load(environ={})
    new = c.load(environ={"KV_SIDECAR_REMOTES": '[{"match": "*:*"}]', "KV_SIDECAR_GPU": "1",
                          "KV_SIDECAR_LOG_LEVEL": "DEBUG"})
    applied, restart = c.reload_changes(old, new)
    assert sorted(applied) == ["log_level", "remotes"] and restart == ["gpu"]
    assert c.reload_changes(old, old) == ([], [])


def test_a_reload_plan_keeps_restart_keys_and_refuses_what_does_not_hold_together():
    running = c.Config(staging_bytes=0)
    plan = c.plan_reload(running, c.Config(staging_bytes=0, default_timeout_s=20, gpu=1))
    assert (plan.applied, plan.restart, plan.refused) == (["default_timeout_s"], ["gpu"], "")
    assert plan.config.default_timeout_s == 20 and plan.config.gpu == running.gpu
    assert c.plan_reload(running, c.Config(staging_bytes=0, gpu=1)) == c.ReloadPlan(None, [], ["gpu"])
    # pull_mode is live but needs the pool only a restart makes: the file holds together, the merge does not
    clash = c.plan_reload(running, c.Config(staging_bytes=1 << 20, pull_mode="staged"))
    assert clash.config is None and clash.restart == ["staging_bytes"]
    assert clash.refused.startswith("with running staging_bytes: pull_mode 'staged' needs staging_bytes")


def test_poll_busy_window_defaults_by_device_and_can_be_set():
    Config, DEFAULT_POLL_BUSY_S = c.Config, c.DEFAULT_POLL_BUSY_S

    assert Config().poll_busy_window_s == 0.0  # the CPU twin: the timer only
    assert Config(gpu=0).poll_busy_window_s == DEFAULT_POLL_BUSY_S == 0.05
    assert Config(gpu=0, poll_busy_s=0).poll_busy_window_s == 0
    assert Config(poll_busy_s=0.2).poll_busy_window_s == 0.2
    with pytest.raises(msgspec.ValidationError, match="poll_busy_s"):
        msgspec.convert({"poll_busy_s": -1}, Config)


def test_inline_posts_default_by_device_and_can_be_set():
    Config = c.Config

    assert Config().inline_post_limit == 0  # the CPU twin: its transport copies inside the post
    assert Config(gpu=0).inline_post_limit == c.DEFAULT_INLINE_POST_DESCRIPTORS == 128
    assert Config(gpu=0, inline_post_max_descriptors=0).inline_post_limit == 0
    assert Config(inline_post_max_descriptors=40).inline_post_limit == 40
    with pytest.raises(msgspec.ValidationError, match="inline_post_max_descriptors"):
        msgspec.convert({"inline_post_max_descriptors": -1}, Config)
    assert "inline_post_max_descriptors" in c.RELOADABLE


def test_every_kv_sidecar_variable_the_repo_reads_is_a_key_or_set_aside():
    """A KV_SIDECAR_* variable that is not a config key makes `kv-sidecar serve` (and every test that
    spawns it) exit with "no config key": the variables tests, scripts and the shim read must be in
    ENV_NOT_KEYS. (KV_SIDECAR_VLLM_WHEEL_DIR, which two tests tell the developer to export, was not.)"""
    import re
    from pathlib import Path

    import msgspec

    from sidecar.ops import config

    repo = Path(__file__).resolve().parents[3]
    read = re.compile(r"""(?:environ(?:\.get)?[\[(]|getenv\()\s*["'](KV_SIDECAR_[A-Z0-9_]+)""")
    names = {
        m.group(1)
        for top in ("sidecar", "vllm_glue", "tests", "scripts", "bench")
        if (repo / top).is_dir()
        for path in (repo / top).rglob("*")
        if path.suffix in (".py", ".sh") and path.is_file()
        for m in read.finditer(path.read_text(errors="replace"))
    }
    keys = {f.name for f in msgspec.structs.fields(config.Config)}
    assert names, "the scan found no variables"
    stray = sorted(n for n in names if n[len(config.ENV_PREFIX):].lower() not in keys)
    assert set(stray) <= config.ENV_NOT_KEYS, set(stray) - config.ENV_NOT_KEYS
    environ = {name: "x" for name in config.ENV_NOT_KEYS - {"KV_SIDECAR_CONFIG"}}  # that one names a file
    assert config.load(environ=environ) == config.build({})


# ---------------------------------------------------------------------------------------------- settled reads


@pytest.mark.parametrize("text", ["", "\n  \n", "# every key commented out\n# remotes = []\n"])
def test_a_reload_refuses_a_file_without_keys_a_start_takes_it(tmp_path, text):
    """Reloaded, an empty file (a rewrite caught between its truncate and its first write, or a settled
    mistake) set every key back to its default, remotes to none: every pull refused from then on."""
    path = tmp_path / "kv.toml"
    path.write_text(text)
    with pytest.raises(c.ConfigError, match=r"config file .*kv\.toml has no keys \((empty|only comments), "):
        c.load(str(path), environ={}, reloading=True)
    assert c.load(str(path), environ={}) == c.build({})



def test_a_reload_finds_a_file_an_editor_renamed_away_for_a_moment(tmp_path):
    """An editor saving by renaming the old file away, then writing the new one (vim's backup by rename)
    leaves the path missing for a moment: a SIGHUP then was refused with "No such file" although the file was
    back milliseconds later. A reload looks again within the settle bound; a start-up, or a file that stays
    missing, still fails, naming the file."""
    import os
    import threading
    import time

    path = tmp_path / "kv.toml"
    path.write_text("default_timeout_s = 20.0\n")
    os.rename(path, tmp_path / "kv.toml~")

    def save() -> None:
        time.sleep(0.15)
        (tmp_path / "kv.new").write_text("default_timeout_s = 25.0\n")
        os.rename(tmp_path / "kv.new", path)

    editor = threading.Thread(target=save)
    editor.start()
    try:
        assert c.load(str(path), environ={}, reloading=True).default_timeout_s == 25.0
    finally:
        editor.join(5)
    os.remove(path)
    t0 = time.monotonic()
    with pytest.raises(c.ConfigError, match="kv.toml"):
        c.load(str(path), environ={})  # start-up: at once
    assert time.monotonic() - t0 < settled_file.SETTLE_BOUND_S / 2
    with pytest.raises(c.ConfigError, match="kv.toml"):
        c.load(str(path), environ={}, reloading=True)  # missing for the whole bound


def test_a_config_from_a_pipe_is_read_once_as_it_comes(tmp_path):
    """``serve --config FIFO`` (or ``<(render-config)``, an anonymous pipe, whose stamps kernels before 6.8
    update on each write too): the writes during the read changed its stamps, so the settle read opened it
    again, and the start-up hung in that open (a named FIFO, its writer gone) or read it drained and empty (an
    anonymous one: every key at its default, no error). A pipe cannot be rewritten in place nor read twice:
    it is read once, to its end."""
    import os
    import threading
    import time

    fifo = tmp_path / "kv.toml"
    os.mkfifo(fifo)

    def render() -> None:
        with open(fifo, "wb", buffering=0) as f:
            f.write(b"default_timeout_s = 20.0\n")
            time.sleep(0.1)  # while the daemon's read waits for the rest
            f.write(b'log_level = "DEBUG"\n')

    got: list = []
    writer = threading.Thread(target=render)
    reader = threading.Thread(target=lambda: got.append(c.load(str(fifo), environ={})), daemon=True)
    writer.start()
    reader.start()
    writer.join(5)
    reader.join(5)
    if reader.is_alive():  # blocked opening the FIFO again: a writer that closes at once lets it go
        with open(fifo, "wb"):
            pass
    assert not reader.is_alive(), "the read of the FIFO hung"
    assert (got[0].default_timeout_s, got[0].log_level) == (20.0, "DEBUG")


def test_a_file_that_no_longer_holds_together_still_says_where_its_daemon_is(tmp_path):
    """``reload`` and Docker's health check find a running daemon with ``load_to_find``. A file edited since
    the start so that it no longer validates (``pull_mode = "staged"`` without a pool: what a reload refuses)
    still names the daemon's socket and metrics port: dropping the whole file sent ``reload`` to the default
    socket ("does not exist: is kv-sidecar running?", exit 2) instead of the daemon, which would refuse it."""
    path = tmp_path / "kv.toml"
    path.write_text(f'pull_mode = "staged"\nsocket = "ipc://{tmp_path}/cpu.sock"\nmetrics_port = 19464\n')
    cfg, note = c.load_to_find(str(path), environ={})
    assert (cfg.socket_endpoint, cfg.http_port) == (f"ipc://{tmp_path}/cpu.sock", 19464)
    assert "does not load" in note and "staging_bytes" in note
    # variables and flags still win over the file's keys, as for a file that loads
    cfg, _ = c.load_to_find(str(path), environ={"KV_SIDECAR_METRICS_PORT": "19500"}, overrides={"gpu": 1})
    assert (cfg.http_port, cfg.gpu) == (19500, 1)


def test_a_file_whose_finding_keys_are_broken_falls_back_to_variables_and_flags(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('socket = "tcp://nowhere:1"\n')  # the socket itself is what does not load
    cfg, note = c.load_to_find(str(path), environ={}, overrides={"gpu": 2})
    assert cfg.socket_endpoint == "ipc:///run/kv-sidecar/gpu2.sock" and "does not load" in note
