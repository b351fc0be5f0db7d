"""What the parts of ``bench e2e`` share: the device names it accepts."""

import pytest

from sidecar.bench import e2e_common


def test_devices_are_checked() -> None:
    assert e2e_common.parse_device("cpu") is None and e2e_common.parse_device("cuda:3") == 3
    for bad in ("gpu", "cuda", "cuda:x"):
        with pytest.raises(e2e_common.BenchError):
            e2e_common.parse_device(bad)
