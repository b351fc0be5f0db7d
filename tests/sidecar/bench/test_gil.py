"""The GIL bench: every call timed alone and beside a spinning thread; both slot forms checked equal."""

from __future__ import annotations

import json
import sys

from sidecar.bench import gil


def test_it_times_every_call_in_every_setting_and_restores_the_interval(capsys, tmp_path):
    before = sys.getswitchinterval()
    out_file = tmp_path / "gil.json"
    assert gil.main(["--layers", "3", "--blocks", "16", "--reps", "3", "--out", str(out_file)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == out
    assert sys.getswitchinterval() == before
    (run,) = out["runs"]
    for setting in ("alone", "beside_python_daemon_interval", "beside_python_cpython_default"):
        assert set(run[setting]) == set(gil.calls(3, 16))
        assert all(v > 0 for v in run[setting].values())


def test_the_spinner_stops():
    with gil.Spinner() as s:
        assert s._thread.is_alive()  # noqa: SLF001
    assert not s._thread.is_alive()  # noqa: SLF001
