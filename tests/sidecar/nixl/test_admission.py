"""Admission (pure): the declared remote format by address, a published tag, the model identity rule."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.nixl.admission import RemoteFormatRule, check_model_identity, resolve_remote_format
from sidecar.nixl.errors import RemoteRefused
from sidecar.wire import prefill as wire
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat

STD = PageFormat(
    kind=STANDARD, layout="LBHNC", dtype="bfloat16", num_heads=2, block_size=16, head_size=64
)
SHUF = PageFormat(
    kind=AITER_SHUFFLED, layout="LHBNC", dtype="bfloat16", num_heads=2, block_size=16, head_size=64
)


def test_remote_format_declaration_by_address():
    other = PageFormat(
        kind=STANDARD, layout="LBHNC", dtype="float16", num_heads=4, block_size=32, head_size=64
    )
    rules = (
        RemoteFormatRule(address="10.0.0.*:5600", format=other),
        RemoteFormatRule(address="*:*", format=STD),
    )
    assert resolve_remote_format("10.0.0.7:5600", rules) == other
    assert resolve_remote_format("10.0.0.7:5601", rules) == STD
    assert (
        resolve_remote_format("prefill-0:5600", rules[:1] + (RemoteFormatRule("prefill-*:56??", other),))
        == other
    )
    with pytest.raises(RemoteRefused) as e:
        resolve_remote_format("10.0.1.7:5600", rules[:1])
    assert e.value.field == "remote page format"
    with pytest.raises(RemoteRefused) as e:
        resolve_remote_format("10.0.0.7:5600", ())
    assert e.value.field == "remote page format"


def test_a_published_tag_wins_and_is_checked():
    tag = msgspec.to_builtins(SHUF)
    assert resolve_remote_format("h:1", (RemoteFormatRule("*:*", STD),), tag) == SHUF
    with pytest.raises(RemoteRefused) as e:
        resolve_remote_format("h:1", (), {**tag, "dtype": "complex"})
    assert e.value.field == "remote page format"



FACTORS = {
    "vllm_version": "0.33.0",
    "nixl_connector_version": 15,
    "model": "m",
    "dtype": "torch.bfloat16",
    "num_kv_heads": 8,
    "head_size": 128,
    "num_hidden_layers": 36,
    "attn_backend_name": "FLASH_ATTN",
    "cache_dtype": "auto",
    "is_hma_enabled": False,
    "speculative_config": None,
    "transfer_mode": "pull",
}


def test_model_identity_sets_the_backend_name_aside():
    remote_hash = wire.compatibility_hash(FACTORS)
    check_model_identity(remote_hash, "FLASH_ATTN", {**FACTORS, "attn_backend_name": "ROCM_AITER_FA"})
    for change in ({"model": "other"}, {"num_hidden_layers": 35}, {"dtype": "torch.float16"}):
        with pytest.raises(RemoteRefused) as e:
            check_model_identity(remote_hash, "FLASH_ATTN", {**FACTORS, **change})
        assert e.value.field == "compatibility_hash"
    with pytest.raises(RemoteRefused) as e:
        check_model_identity(remote_hash, "FLASH_ATTN", None)
    assert e.value.field == "compatibility_hash"


