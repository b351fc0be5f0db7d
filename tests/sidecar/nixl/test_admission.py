"""Admission (pure): the declared remote format by address, a published tag, fp8 scales, model identity."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from sidecar.nixl.admission import (
    AdmissionRules,
    RemoteFormatRule,
    admit_remote,
    check_model_identity,
    resolve_remote_format,
)
from sidecar.nixl.errors import RemoteRefused
from sidecar.wire import prefill as wire
from sidecar.wire.formats import AITER_SHUFFLED, STANDARD, PageFormat
from tests.sidecar.nixl.test_geometry import RemoteMem, std

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


@pytest.mark.parametrize("remote_k,local_k,allow,field", [
    (1e200, 1e200, False, "local.k_scale"),  # ratio 1 saturates (the parent raised: 1e200 x 1e200 = inf)
    (1e306, 4e306, True, "remote.k_scale"),  # 448 x 1e306 is past float64: no byte can be computed
])
def test_fp8_scales_of_any_size_are_refused_by_field(remote_k, local_k, allow, field):
    """A declared fp8 scale negotiate cannot use is a RemoteRefused naming it (the prefill is then told),
    never another exception."""
    geometry = dict(num_heads=2, block_size=16, head_size=64)
    remote = PageFormat(kind=STANDARD, layout="LBHNC", dtype="float8_e4m3fn", k_scale=remote_k, **geometry)
    local = PageFormat(
        kind=AITER_SHUFFLED, layout="LHBNC", dtype="float8_e4m3fnuz", k_scale=local_k, v_scale=2.0, **geometry
    )
    rules = AdmissionRules(remote_formats=(RemoteFormatRule("*:*", remote),), allow_lossy_fp8=allow)
    with pytest.raises(RemoteRefused) as e:
        admit_remote(SimpleNamespace(engine_id="e", page_format=None), address="h:1", local_format=local,
                     layers=2, rules=rules, check_identity=False)
    assert e.value.field == field


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


def test_a_huge_logical_block_is_refused_at_admission_naming_the_field():
    """physical_blocks_per_logical_kv_block is the prefill's word: each Pull expands its ids by it."""
    rules = AdmissionRules(remote_formats=(RemoteFormatRule(address="*:*", format=std()),))
    rmem = RemoteMem(2, 8)
    ratio = 4096
    rmem.meta.physical_blocks_per_logical_kv_block = ratio
    rmem.meta.num_blocks, rmem.meta.region_num_blocks = ratio, [ratio, ratio]
    with pytest.raises(RemoteRefused) as e:
        admit_remote(rmem.meta, address="10.0.0.1:5600", local_format=std(), layers=2, rules=rules,
                     remote_mem_type="DRAM", check_identity=False)
    assert e.value.field == "physical_blocks_per_logical_kv_block", e.value
    rmem.meta.physical_blocks_per_logical_kv_block = 16
    _plan, regions = admit_remote(rmem.meta, address="10.0.0.1:5600", local_format=std(), layers=2,
                                  rules=rules, remote_mem_type="DRAM", check_identity=False)
    assert regions.blocks_per_logical == 16
