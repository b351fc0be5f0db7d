"""The /dev/shm reaper: the files go when their owner dies, even by SIGKILL, and not before."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from vllm_glue.shm_reaper import unlink_when_gone


def test_files_are_unlinked_after_the_owner_is_killed() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    paths = [f"/dev/shm/kv-sidecar-reaper-test-{uuid.uuid4().hex}" for _ in range(2)]
    try:
        for p in paths:
            with open(p, "wb") as f:
                f.write(b"x" * 4096)
        unlink_when_gone(owner.pid, paths)
        time.sleep(0.3)  # the reaper must hold off while the owner lives
        assert all(os.path.exists(p) for p in paths)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(os.path.exists(p) for p in paths)
    finally:
        owner.kill()
        owner.wait()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_decoder_standin_files_go_when_it_is_killed(tmp_path) -> None:
    """Issue 15 item 6. Main: the stand-in's /dev/shm file stays after SIGKILL (not reaped)."""
    code = (
        "import sys, time\n"
        "from sidecar.standins.decoder import DecoderStandin, StandinShape\n"
        "s = DecoderStandin('ipc:///nonexistent/x.sock', StandinShape(layers=1, num_blocks=4),"
        " compat_factors={})\n"
        "print(s.buffer.path, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    path = ""
    try:
        path = proc.stdout.readline().strip()
        assert path.startswith("/dev/shm/") and os.path.exists(path)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not os.path.exists(path)
    finally:
        proc.kill()
        proc.wait()
        if path and os.path.exists(path):
            os.unlink(path)
