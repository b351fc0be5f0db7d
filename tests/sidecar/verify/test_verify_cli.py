"""``kv-sidecar verify`` as a command: exit codes, --json, the help line; and the probes on this host (real
subprocess, real /dev/shm, real NIXL over UCX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sidecar import cli
from sidecar.verify import golden, main, probes

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


def test_help_names_verify_and_what_it_is_for(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "verify" in out and "decodes pages the daemon converts" in out


def test_quick_cpu_run_exits_0_and_writes_json(tmp_path):
    path = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "sidecar.cli", "verify", "--quick", "--no-probes", "--json",
                        str(path)], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "support-matrix row:" in r.stdout and "result: PASS" in r.stdout
    obj = json.loads(path.read_text())
    assert obj["ok"] is True and obj["device"] == "cpu" and obj["platform"] == "CPU"
    names = [c["name"] for c in obj["checks"]]
    assert len(names) == 4 and all(n.startswith("golden N=16 D=128") for n in names)
    assert all(c["status"] == "pass" and c["data"]["readers"] == ["torch"] for c in obj["checks"])


def test_json_to_stdout_only(capsys):
    assert main.main(["--device", "cpu", "--quick", "--no-probes", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True  # nothing but the JSON on stdout


def test_a_wrong_layout_exits_1(monkeypatch, capsys):
    def wrong(k_planes, v_planes, ids, fmt, src):
        golden.daemon_converter(k_planes, v_planes, ids, fmt, src)
        for kp in k_planes:  # exchange the first two blocks' K tiles after a right conversion
            kp[[int(ids[0]), int(ids[1])]] = kp[[int(ids[1]), int(ids[0])]].clone()

    monkeypatch.setattr(golden, "daemon_converter", wrong)
    assert main.main(["--device", "cpu", "--quick", "--no-probes", "--json", "-"]) == 1
    obj = json.loads(capsys.readouterr().out)
    assert obj["ok"] is False and all(c["status"] == "fail" for c in obj["checks"])


def test_usage_errors_exit_2(capsys):
    assert main.main(["--device", "tpu", "--no-probes"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "sidecar.cli", "verify", "--bogus"], env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2


def test_ipc_and_nixl_probe_on_this_host():
    rows = {c.name: c for c in probes.check_ipc_nixl("cpu")}
    assert rows["ipc"].status == "pass", rows["ipc"].detail
    assert rows["nixl"].status == "pass", rows["nixl"].detail
    assert rows["ucx transport"].status == "pass"
    assert rows["ucx transport"].data["transports"]  # which UCX transports it chose, from its own log


def test_vllm_check_skips_without_vllm_and_says_why():
    if probes.importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    c = probes.check_vllm({})
    assert c.status == "skip" and "not importable" in c.detail
