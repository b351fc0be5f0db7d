"""When a Pull's time runs out (pure): counted from the shim's send, never from later than the receipt."""

from __future__ import annotations

import pytest

from sidecar.daemon.jobs import JobTable
from tests.sidecar.wire.test_protocol import pull


@pytest.mark.parametrize(
    ("sent_s", "received_s", "timeout_s", "deadline_s"),
    [
        (None, 100.0, 5.0, 105.0),  # no send time: from the receipt
        (99.0, 100.0, 5.0, 104.0),  # in flight 1 s: the shim's clock
        (100.0, 100.0, 5.0, 105.0),  # in flight no time at all
        (101.0, 100.0, 5.0, 105.0),  # "sent" after it arrived: never later than the receipt
        (90.0, 100.0, 5.0, 95.0),  # its time ran out before it arrived
        (95.0, 100.0, 5.0, 100.0),  # ... exactly as it arrived
    ],
)
def test_deadline_for(sent_s, received_s, timeout_s, deadline_s):
    sent_at_ns = 0 if sent_s is None else round(sent_s * 1e9)
    got = JobTable.deadline_for(pull(sent_at_ns=sent_at_ns), received_s, timeout_s)
    assert got == pytest.approx(deadline_s, abs=1e-9)
