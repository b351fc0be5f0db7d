"""What the parts of ``bench e2e`` share: the device names it accepts and ``--daemon-set``'s settings."""

import pytest

from sidecar.bench import e2e_common


def test_devices_are_checked() -> None:
    assert e2e_common.parse_device("cpu") is None and e2e_common.parse_device("cuda:3") == 3
    for bad in ("gpu", "cuda", "cuda:x"):
        with pytest.raises(e2e_common.BenchError):
            e2e_common.parse_device(bad)


def test_daemon_settings_are_toml_values() -> None:
    assert e2e_common.daemon_settings(["poll_interval_s=0.0002", 'log_level = "DEBUG"']) == {
        "poll_interval_s": "0.0002",
        "log_level": '"DEBUG"',
    }
    with pytest.raises(e2e_common.BenchError, match="KEY=VALUE"):
        e2e_common.daemon_settings(["poll_interval_s"])
    # A bare path is not TOML: refused here, naming the key and the quoting, not as a daemon's exit rc=2.
    refused = r"--daemon-set loop_pieces: '/tmp/p.json' is not a TOML value.*loop_pieces='\"/tmp/p.json\"'"
    with pytest.raises(e2e_common.BenchError, match=refused):
        e2e_common.daemon_settings(["loop_pieces=/tmp/p.json"])
    values = e2e_common.toml_values({"poll_interval_s": "0.0002", "on": "true"})
    assert values == {"poll_interval_s": 0.0002, "on": True}
