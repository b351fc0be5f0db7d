"""``{gpu}`` in sidecar_socket: the worker's physical GPU index (the daemon's ``--gpu N``), or a refusal.

The shim used to know only ``{rank}``: under ``--data-parallel-size 2 --tensor-parallel-size 2`` both engines'
rank 0 named gpu0.sock, and a TP 2 engine on CUDA_VISIBLE_DEVICES=2,3 named the daemons of GPUs 0 and 1.
"""

import pytest

from vllm_glue.gpu_index import GpuUnresolved, fill_socket, physical_gpu
from vllm_glue.worker import WorkerHalf

# vLLM 0.33 under data parallelism on one host (mp backend) leaves CUDA_VISIBLE_DEVICES alone and gives the
# worker local GPU index tp_rank + dp_local_rank * world_size (ParallelConfig.get_local_gpu_index), then
# cuda:<visible index of it>. No --device-ids: the visible index is that local index.


@pytest.mark.parametrize("runtime", ["cuda", "rocm"])
def test_dp2_tp2_on_four_gpus_each_worker_names_its_own_gpu(runtime):
    template = "ipc:///run/kv-sidecar/gpu{gpu}.sock"
    sockets = {
        (dp, tp): fill_socket(template, rank=tp, gpu=lambda d=tp + dp * 2: physical_gpu({}, d, runtime))
        for dp in range(2)
        for tp in range(2)
    }
    assert sockets == {(0, 0): template.format(gpu=0), (0, 1): template.format(gpu=1),
                       (1, 0): template.format(gpu=2), (1, 1): template.format(gpu=3)}


@pytest.mark.parametrize(
    ("env", "device", "expected"),
    [
        ({}, 0, 0),
        ({}, 3, 3),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, 0, 2),  # a TP 2 engine on GPUs 2 and 3
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, 1, 3),
        ({"CUDA_VISIBLE_DEVICES": "3,1,0,2"}, 1, 1),  # visible order is the list's, not the physical one
        ({"CUDA_VISIBLE_DEVICES": "7"}, 0, 7),
        ({"CUDA_VISIBLE_DEVICES": "10,11"}, 1, 11),
        ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, 6),  # DP 2 x TP 2 over the host's upper four GPUs: engine 1
        ({"CUDA_VISIBLE_DEVICES": "2,3,GPU-0a1b"}, 1, 3),  # entries past the worker's are not read
        ({"CUDA_VISIBLE_DEVICES": "2,3,-1"}, 1, 3),
        # CUDA ignores ROCm's variables
        ({"ROCR_VISIBLE_DEVICES": "GPU-x", "HIP_VISIBLE_DEVICES": "5"}, 1, 1),
        ({"CUDA_VISIBLE_DEVICES": "1,0", "HIP_VISIBLE_DEVICES": "0,1"}, 0, 1),
    ],
)
def test_cuda(env, device, expected):
    assert physical_gpu(env, device, "cuda") == expected


@pytest.mark.parametrize(
    ("env", "device", "expected"),
    [
        ({}, 2, 2),
        ({"HIP_VISIBLE_DEVICES": "2,3"}, 1, 3),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, 0, 2),  # HIP honours CUDA_VISIBLE_DEVICES when HIP's is unset
        ({"HIP_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "2,3"}, 1, 3),  # vLLM copies HIP's to CUDA's
        ({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "6"}, 0, 6),  # empty HIP_VISIBLE_DEVICES: unset
        ({"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": ""}, 0, 3),
        ({"CUDA_VISIBLE_DEVICES": ""}, 1, 1),  # ROCclr reads an empty list as none given
        ({"ROCR_VISIBLE_DEVICES": "4,5,6,7"}, 1, 5),
        ({"ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "2,3"}, 0, 6),  # HIP picks among ROCr's
        ({"ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "3,0"}, 1, 4),
        ({"ROCR_VISIBLE_DEVICES": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "1"}, 0, 5),
        ({"ROCR_VISIBLE_DEVICES": "1,0", "HIP_VISIBLE_DEVICES": "1"}, 0, 0),
        ({"ROCR_VISIBLE_DEVICES": "6,7,GPU-abc"}, 1, 7),
    ],
)
def test_rocm(env, device, expected):
    assert physical_gpu(env, device, "rocm") == expected


@pytest.mark.parametrize(
    ("runtime", "env", "device", "why"),
    [
        ("cpu", {}, None, "no GPU \\(vLLM platform 'cpu'\\)"),  # the CPU engine (the CPU twin's decoder)
        ("cpu", {}, 0, "no GPU"),
        ("xpu", {}, 0, "no GPU \\(vLLM platform 'xpu'\\)"),
        ("cuda", {}, None, "no GPU"),
        ("cuda", {}, -1, "not a GPU's"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "GPU-8a7c1f2e-0000-1111-2222-333344445555"}, 0, "a UUID or MIG id"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "MIG-8a7c1f2e-0000-1111-2222-333344445555"}, 0, "a UUID or MIG id"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "GPU-8a7c,3"}, 1, "'GPU-8a7c' is a UUID"),  # an earlier UUID too
        ("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}, 2, "has no entry 2"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": ""}, 0, "set but empty"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "2, 3"}, 1, "' 3' is not a plain index"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "02"}, 0, "'02' is not a plain index"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "-1,2"}, 1, "'-1' is not a plain index"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "+2"}, 0, "not a plain index"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "2,,3"}, 2, "'' is not a plain index"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "2,2"}, 1, "lists 2 twice"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "٣"}, 0, "not a plain index"),  # a digit, but not one CUDA reads
        ("rocm", {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1,0"}, 0, "differ"),
        ("rocm", {"ROCR_VISIBLE_DEVICES": "GPU-4b2c1a9f8d3e6f7a"}, 0, "ROCR_VISIBLE_DEVICES=.*a UUID"),
        ("rocm", {"ROCR_VISIBLE_DEVICES": "0,GPU-4b2c1a9f8d3e6f7a"}, 1, "a UUID"),
        ("rocm", {"ROCR_VISIBLE_DEVICES": "4,5", "HIP_VISIBLE_DEVICES": "2"}, 0, "ROCR_VISIBLE_DEVICES=.* 2"),
        ("rocm", {"ROCR_VISIBLE_DEVICES": ""}, 0, "ROCR_VISIBLE_DEVICES is set but empty"),
        ("rocm", {"HIP_VISIBLE_DEVICES": "GPU-4b2c1a9f8d3e6f7a"}, 0, "HIP_VISIBLE_DEVICES=.*a UUID"),
        ("rocm", {"HIP_VISIBLE_DEVICES": "1"}, 1, "HIP_VISIBLE_DEVICES='1' has no entry 1"),
    ],
)
def test_what_cannot_be_mapped_for_certain_is_refused(runtime, env, device, why):
    with pytest.raises(GpuUnresolved, match=why):
        physical_gpu(env, device, runtime)


def test_the_refusal_names_sidecar_socket_and_why():
    def gpu():
        return physical_gpu({"CUDA_VISIBLE_DEVICES": "GPU-8a7c"}, 0, "cuda")

    why = (r"^kv_connector_extra_config: sidecar_socket 'ipc:///run/kv-sidecar/gpu\{gpu\}.sock': \{gpu\} "
           r"cannot be resolved: CUDA_VISIBLE_DEVICES='GPU-8a7c': entry 'GPU-8a7c' is a UUID or MIG id.*; "
           r"use \{rank\}")
    with pytest.raises(ValueError, match=why):
        fill_socket("ipc:///run/kv-sidecar/gpu{gpu}.sock", rank=0, gpu=gpu)


def test_rank_alone_never_asks_for_the_gpu():
    def gpu():
        raise AssertionError("{gpu} is not in the socket: nothing to resolve")

    socket = fill_socket("ipc:///run/kv-sidecar/gpu{rank}.sock", rank=1, gpu=gpu)
    assert socket == "ipc:///run/kv-sidecar/gpu1.sock"
    assert fill_socket("ipc:///tmp/d.sock", rank=1, gpu=gpu) == "ipc:///tmp/d.sock"


def test_both_placeholders_every_time_they_appear():
    assert fill_socket("ipc:///run/{gpu}/r{rank}-g{gpu}.sock", rank=1, gpu=lambda: 3) == "ipc:///run/3/r1-g3.sock"


def test_an_unresolved_gpu_never_reaches_a_socket_path():
    """The worker half alone (the decoder stand-in) cannot know the GPU; it refuses the literal path."""
    with pytest.raises(ValueError, match=r"\{gpu\} must be resolved first"):
        WorkerHalf("ipc:///run/kv-sidecar/gpu{gpu}.sock")


# ------------------------------------------------------------------ the connector, on a stand-in for vLLM


@pytest.fixture
def connector(monkeypatch):
    """vllm_glue.connector imported against stub vLLM modules (vLLM is not installed here), with a platform
    the test sets: ``platform.is_cuda``/``is_rocm``/``device_type``, and torch's current device."""
    import enum
    import sys
    import types

    import torch

    class Role(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class Base:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config

    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorBase_V1, base.KVConnectorMetadata, base.KVConnectorRole = Base, object, Role
    base.SupportsHMA = type("SupportsHMA", (), {})
    platform = types.SimpleNamespace(is_cuda=lambda: True, is_rocm=lambda: False, device_type="cuda")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tensor_model_parallel_rank = lambda: 1
    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, platforms.__name__, platforms)
    monkeypatch.setitem(sys.modules, parallel_state.__name__, parallel_state)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    sys.modules.pop("vllm_glue.connector", None)
    import vllm_glue.connector as module

    def make(socket: str, pp: int = 1, role: str = "WORKER"):
        extra = {"sidecar_socket": socket}
        ktc = types.SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_consumer", engine_id="e")
        parallel = types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=pp)
        cfg = types.SimpleNamespace(kv_transfer_config=ktc, parallel_config=parallel)
        return module.SidecarConnector(cfg, Role[role])

    yield platform, make
    sys.modules.pop("vllm_glue.connector", None)


def test_the_connector_fills_gpu_from_the_workers_device(connector, monkeypatch):
    platform, make = connector
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # TP rank 1 on cuda:1, physical GPU 3
    assert make("ipc:///run/kv-sidecar/gpu{gpu}.sock").worker.socket == "ipc:///run/kv-sidecar/gpu3.sock"
    assert make("ipc:///run/kv-sidecar/gpu{rank}.sock").worker.socket == "ipc:///run/kv-sidecar/gpu1.sock"
    platform.is_cuda, platform.is_rocm = (lambda: False), (lambda: True)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "4,5,6,7")
    assert make("ipc:///run/kv-sidecar/gpu{gpu}.sock").worker.socket == "ipc:///run/kv-sidecar/gpu7.sock"


def test_the_cpu_engine_stops_at_start_up_on_gpu(connector):
    platform, make = connector
    platform.is_cuda, platform.device_type = (lambda: False), "cpu"
    why = r"sidecar_socket .*gpu\{gpu\}.*: this worker has no GPU \(vLLM platform 'cpu'\)"
    with pytest.raises(ValueError, match=why):
        make("ipc:///run/kv-sidecar/gpu{gpu}.sock")
    assert make("ipc:///run/kv-sidecar/cpu.sock").worker.socket == "ipc:///run/kv-sidecar/cpu.sock"


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_pipeline_parallel_decoder_stops_at_start_up(connector, role):
    """Each stage registers only its layers: every pull would have been refused on the region count, one
    request at a time, with vLLM up and Ready."""
    _platform, make = connector
    with pytest.raises(ValueError, match="pipeline_parallel_size 2: a decoder with pipeline parallelism"):
        make("ipc:///run/kv-sidecar/gpu{rank}.sock", pp=2, role=role)
