"""The shim's kv_connector_extra_config: defaults, lax JSON values, and a clear refusal naming the key."""

import math

import pytest

from sidecar.daemon.reads import RELEASE_GIVE_UP_S
from vllm_glue.scheduler_book import SchedulerBook
from vllm_glue.settings import MIN_GRACE_S, ShimSettings
from vllm_glue.worker import DEFAULT_GRACE_S, DEFAULT_SOCKET


def test_defaults_and_other_connectors_keys():
    s = ShimSettings.from_extra({"some_other_key": 1})
    assert (s.sidecar_socket, s.sidecar_pull_timeout_s, s.sidecar_grace_s) == (DEFAULT_SOCKET, 60.0,
                                                                              DEFAULT_GRACE_S)
    assert ShimSettings.from_extra(None) == s


def test_values_as_json_or_strings():
    extra = {"sidecar_pull_timeout_s": "90", "sidecar_grace_s": 6, "kv_lease_duration": 60}
    s = ShimSettings.from_extra(extra)
    assert (s.sidecar_pull_timeout_s, s.sidecar_grace_s, s.kv_lease_duration) == (90.0, 6.0, 60)


@pytest.mark.parametrize("lease", [7.5, 45.5])
def test_a_fractional_lease_is_one_stock_vllm_runs_with(lease):
    """vLLM reads kv_lease_duration raw from kv_connector_extra_config (``lease * 2 // 3``, ``lease // 6``):
    a fractional lease works there, and one kv-transfer-config is often shared by prefill and decoder. The
    shim used to int() it; ShimSettings refused it as "Expected `int`, got `float`", stopping vLLM."""
    s = ShimSettings.from_extra({"kv_lease_duration": lease})
    book = SchedulerBook(lease_s=s.kv_lease_duration)
    assert book.heartbeat_interval_s == lease // 6  # stock vLLM's heartbeat period


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("sidecar_pull_timeout_s", 0),
        ("sidecar_pull_timeout_s", -5),
        ("sidecar_pull_timeout_s", math.nan),
        ("sidecar_pull_timeout_s", "soon"),
        ("sidecar_register_timeout_s", 0),
        ("sidecar_grace_s", 1.0),  # shorter than the daemon's give-up after an unstoppable transfer
        ("kv_lease_duration", 0),
        ("sidecar_socket", 5),
    ],
)
def test_a_value_that_cannot_be_used_stops_start_up_naming_its_key(key, value):
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config: .*\$\.{key}"):
        ShimSettings.from_extra({key: value})


def test_the_grace_covers_the_daemons_give_up():
    """After a pull's deadline the daemon keeps trying to stop its transfers for RELEASE_GIVE_UP_S before it
    answers unsafe; a shim handing the blocks back sooner could see them written after."""
    assert MIN_GRACE_S >= RELEASE_GIVE_UP_S and DEFAULT_GRACE_S >= MIN_GRACE_S
