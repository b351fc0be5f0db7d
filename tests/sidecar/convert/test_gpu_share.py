"""MPS helper (a fake control command: a unit test of the quit path), CU masks, the daemon's mode line."""

from __future__ import annotations

import os
import stat
import time

import pytest

from sidecar.convert.gpu_share import MpsControl, MpsError, cu_mask_words, mode_line
from sidecar.convert.launch import ConversionLimits, limits_for


def _fake(tmp_path, start_rc=0):
    """A fake nvidia-cuda-mps-control: ``-d`` starts a background sleeper (the 'daemon'); ``quit`` on stdin
    kills it."""
    script = tmp_path / "fake-mps"
    pid = tmp_path / "pid"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "-d" ]; then sleep 60 >/dev/null 2>&1 & echo $! > {pid}; exit {start_rc}; fi
read cmd; [ "$cmd" = quit ] && kill $(cat {pid}) && echo quit >> {tmp_path}/quits
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _gone(pid: int) -> bool:
    for _ in range(50):
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_quits_on_error_inside(tmp_path):
    cmd, pidfile = _fake(tmp_path)
    with pytest.raises(RuntimeError), MpsControl([cmd]) as mps:
        assert mps.env(20)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
        assert os.path.isdir(mps.env()["CUDA_MPS_PIPE_DIRECTORY"])
        raise RuntimeError("bench failed")
    assert _gone(int(pidfile.read_text()))
    assert (tmp_path / "quits").read_text() == "quit\n"
    assert not os.path.exists(mps.root)
    assert mps.quit() is False  # idempotent


def test_failed_start_still_quits(tmp_path):
    cmd, pidfile = _fake(tmp_path, start_rc=3)
    with pytest.raises(MpsError, match="exited 3"):
        MpsControl([cmd]).start()
    assert _gone(int(pidfile.read_text()))


def test_missing_command():
    with pytest.raises(MpsError):
        MpsControl(["/nonexistent/mps-control"]).start()


def test_env_percentage_range():
    m = MpsControl(root="/tmp/x")
    with pytest.raises(ValueError):
        m.env(0)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in m.env()


@pytest.mark.parametrize("total", [1, 31, 32, 33, 64, 304])
@pytest.mark.parametrize("share", [0.001, 0.25, 0.5, 1.0])
def test_cu_mask_words(total, share):
    words = cu_mask_words(total, share)
    bits = [i for i in range(32 * len(words)) if words[i // 32] >> (i % 32) & 1]
    assert len(words) == -(-total // 32)
    assert bits == list(range(max(1, int(total * share))))


def test_mode_line():
    assert "CPU twin" in mode_line(None, gpu=None)
    line = mode_line(limits_for(40, 25), gpu=0, platform="cuda", environ={})
    assert "time-slice" in line and "1000" in line and "low-priority" in line
    assert "MPS client, active thread percentage 20%" in mode_line(
        ConversionLimits(), gpu=0, platform="cuda", environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20"})
    assert "side by side" in mode_line(ConversionLimits(max_ctas=8), gpu=1, platform="rocm", environ={})
