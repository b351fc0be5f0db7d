"""``SidecarConnector``: the vLLM KV connector (0.32 and 0.33) that hands remote-prefill loads to kv-sidecar.

Enable it with one flag on the decoder::

    --kv-transfer-config '{"kv_connector":"SidecarConnector","kv_connector_module_path":"vllm_glue.connector",
                           "kv_role":"kv_consumer",
                           "kv_connector_extra_config":{"sidecar_socket":"ipc:///run/kv-sidecar/gpu{rank}.sock"}}'

``kv_connector_extra_config`` keys: ``sidecar_socket`` (default ``ipc:///run/kv-sidecar/gpu{rank}.sock``;
``{rank}`` is replaced by the worker's TP rank, ``{gpu}`` by the physical index of its GPU, the N of
``kv-sidecar serve --gpu N``: use ``gpu{gpu}.sock`` with data parallelism or ``CUDA_VISIBLE_DEVICES``;
``vllm_glue.gpu_index``),
``sidecar_pull_timeout_s`` (60), ``sidecar_register_timeout_s`` (30), ``sidecar_grace_s`` (5, at least 4), and
vLLM's own ``kv_lease_duration`` (30; heartbeats every lease // 6 s, as stock vLLM); checked at start-up
(``vllm_glue.settings``).

This is the only module of the package that imports vLLM. The scheduler half is
:class:`vllm_glue.scheduler_book.SchedulerBook`, the worker half :class:`vllm_glue.worker.WorkerHalf`.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_glue.gpu_index import fill_socket, physical_gpu
from vllm_glue.local_format import local_page_format, one_scale, required_layout
from vllm_glue.orders import StepOrders
from vllm_glue.scheduler_book import SchedulerBook
from vllm_glue.settings import ShimSettings
from vllm_glue.worker import WorkerHalf

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM has only get_finished
    KVConnectorTransferResults = None

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm_glue.connector")


def _use_vllm_logging() -> None:
    """Log the shim's lines (vllm_glue.*) through vLLM's handlers, so they appear in the engine's log."""
    ours, theirs = logging.getLogger("vllm_glue"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            # vLLM's handlers carry their own level; ours may be lower (KV_SIDECAR_SHIM_LOG_LEVEL=DEBUG).
            mine = logging.StreamHandler(getattr(handler, "stream", None))
            mine.setFormatter(handler.formatter)
            ours.addHandler(mine)
        ours.setLevel(os.environ.get("KV_SIDECAR_SHIM_LOG_LEVEL", "").upper() or theirs.level)
        ours.propagate = False


_use_vllm_logging()


class SidecarConnectorMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler half to the worker half."""

    def __init__(self, orders: StepOrders | None = None) -> None:
        self.orders = orders or StepOrders()


class SidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """A kv_consumer connector: the decoder's loads are done by its kv-sidecar daemon, never by vLLM itself.

    It declares SupportsHMA like NixlConnector, so vLLM keeps the hybrid KV-cache manager on exactly when a
    stock decoder would: ``is_hma_enabled`` is one of the compatibility-hash factors, and a stock prefill
    hashes True. Models with more than one KV-cache group are still out of scope: their requests are computed
    locally.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        settings = ShimSettings.from_extra(ktc.kv_connector_extra_config)
        pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp_size != 1:
            # A stage registers only its own layers, and the daemon pairs the prefill's layers with the
            # registered ones from the first: every pull would be refused on the region count.
            raise ValueError(f"SidecarConnector: pipeline_parallel_size {pp_size}: a decoder with pipeline "
                             "parallelism is not supported (use tensor parallelism)")
        if ktc.kv_role != "kv_consumer":
            log.warning(
                "SidecarConnector only loads (decoder side); kv_role %r: requests asking it to "
                "serve a remote decode are computed normally",
                ktc.kv_role,
            )
        self.book: SchedulerBook | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.book = SchedulerBook(
                lease_s=settings.kv_lease_duration,
                backoff_tokens=_prefill_backoff(vllm_config, kv_cache_config),
                kv_groups=len(getattr(kv_cache_config, "kv_cache_groups", None) or [None]),
            )
        else:
            rank, tp_size = _tp_rank_and_size(vllm_config)
            self.worker = WorkerHalf(
                fill_socket(settings.sidecar_socket, rank=rank, gpu=_worker_gpu),
                pull_timeout_s=settings.sidecar_pull_timeout_s,
                register_timeout_s=settings.sidecar_register_timeout_s,
                grace_s=settings.sidecar_grace_s,
                worker_rank=rank,
                tp_size=tp_size,
                engine_id=ktc.engine_id or "",
            )
            atexit.register(self.worker.shutdown)

    # ================================================================================== class-level

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No: sleep remaps the KV cache, and the daemon holds its IPC import and NIXL registration of the
        old one (loads after a wake-up would report ok into blocks the daemon no longer reaches)."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LHBNC when the decoder's pages are AITER-shuffled (dense K/V planes); no preference otherwise."""
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        name = getattr(backend, "name", backend)
        return required_layout(backend_name=str(name) if name else None, env=os.environ)

    # ================================================================================== scheduler half

    def on_new_request(self, request: Request) -> None:
        assert self.book is not None
        self.book.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.book is not None
        return self.book.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load restores every transfer group of the request (its own blocks, not a hash-addressed store).
        return tuple(getattr(self._kv_cache_config, "transfer_group_ids", (0,)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.book is not None
        self.book.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.book is not None
        return SidecarConnectorMetadata(self.book.build_step())

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.book is not None
        self.book.update_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.book is not None
        return self.book.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.book is not None
        return self.book.request_finished(request)

    # ================================================================================== worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        fmt, factors = describe_local_caches(self._vllm_config, kv_caches)
        log.info("kv-sidecar shim: local pages %s", fmt)
        self.worker.register(kv_caches, fmt, factors)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, SidecarConnectorMetadata) and not meta.orders.is_empty():
            self.worker.start_step(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: vLLM schedules a request only once it is finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a consumer saves nothing

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        results = self.worker.transfer_results()
        return None, results.finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        assert self.worker is not None
        results = self.worker.transfer_results()
        if KVConnectorTransferResults is None:  # pragma: no cover
            return results
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=results.finished, failed_recving=results.failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


# ====================================================================================== helpers (vLLM-aware)


def describe_local_caches(vllm_config: VllmConfig, kv_caches: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The decoder's PageFormat and its compatibility-hash factors, from what vLLM resolved."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backend_name = get_current_attn_backends(vllm_config)[0].get_name()
    layout = _resolved_layout(vllm_config)
    mc = vllm_config.model_config
    first = next(iter(kv_caches.values()))
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    k_scale = v_scale = 1.0
    if cache_dtype.startswith("fp8"):
        layers = vllm_config.compilation_config.static_forward_context
        k_scale = one_scale(
            "k_scale", {n: float(getattr(layers.get(n), "_k_scale_float", 1.0)) for n in kv_caches}
        )
        v_scale = one_scale(
            "v_scale", {n: float(getattr(layers.get(n), "_v_scale_float", 1.0)) for n in kv_caches}
        )
    fmt = local_page_format(
        backend_name=backend_name,
        layout=layout,
        dtype=str(first.dtype).removeprefix("torch."),
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(),
        layer_shape=list(first.shape),
        env=os.environ,
        cache_dtype=cache_dtype,
        fp8_e4m3_dtype=_platform_fp8_dtype(),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return fmt, compat_factors(vllm_config, backend_name)


def _platform_fp8_dtype() -> str:
    """The e4m3 flavour vLLM stores for --kv-cache-dtype fp8 on this platform (e4m3fnuz on MI300)."""
    from vllm.platforms import current_platform

    return str(current_platform.fp8_dtype()).removeprefix("torch.")


def compat_factors(vllm_config: VllmConfig, backend_name: str) -> dict[str, Any]:
    """The factors of vLLM's NIXL compatibility hash, checked against vLLM's own hash of them.

    The daemon recomputes the hash with each prefill's backend name, so the factors must be exactly vLLM's: a
    vLLM that hashes something else fails here, at startup, instead of refusing every prefill later.
    """
    from vllm import __version__ as vllm_version
    from vllm.config.utils import hash_factors
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as nixl_meta

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    factors = {
        "vllm_version": vllm_version,
        "nixl_connector_version": nixl_meta.NIXL_CONNECTOR_VERSION,
        "model": mc.model,
        "dtype": str(mc.dtype),
        "num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
        "num_hidden_layers": mc.get_total_num_hidden_layers(),
        "attn_backend_name": backend_name,
        "cache_dtype": str(cc.cache_dtype),
        "is_hma_enabled": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "speculative_config": _speculative_factors(nixl_meta, vllm_config),
        "transfer_mode": "pull",
    }
    expected = nixl_meta.compute_nixl_compatibility_hash(vllm_config, backend_name, transfer_mode="pull")
    if hash_factors(factors) != expected:
        raise RuntimeError(
            f"kv-sidecar shim: vLLM {vllm_version} hashes compatibility factors this shim does not "
            f"know (its hash {expected} != ours {hash_factors(factors)}); update vllm_glue"
        )
    return factors


def _resolved_layout(vllm_config: VllmConfig) -> str:
    """The KV-cache layout vLLM resolved (an enum name such as "LBHNC")."""
    getter = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    if getter is not None:
        return getter().name
    from vllm.v1.attention.backends.utils import get_kv_cache_layout  # older vLLM

    return str(getattr(get_kv_cache_layout(), "name", get_kv_cache_layout()))


def _speculative_factors(nixl_meta: Any, vllm_config: VllmConfig) -> Any:
    fn = getattr(nixl_meta, "_get_speculative_compatibility_factors", None)
    return None if fn is None else fn(vllm_config)


def _prefill_backoff(vllm_config: VllmConfig, kv_cache_config: Any) -> int:
    """Trailing prompt tokens the prefill does not compute (stock NixlConnector's _prefill_backoff)."""
    has_mamba = bool(getattr(kv_cache_config, "has_mamba_layers", False))
    bounded_replay = any(
        getattr(g.kv_cache_spec, "prefix_replay_tokens", 0) > 0
        for g in getattr(kv_cache_config, "kv_cache_groups", ())
    )
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1) or 1)
    return max(1 if has_mamba or bounded_replay else 0, lookahead - 1)


def _worker_gpu() -> int:
    """The physical index of this worker's GPU (GpuUnresolved when it has none or it cannot be mapped).

    Called while vLLM builds the worker's connector, after ``init_device`` made the worker's device current.
    """
    from vllm.platforms import current_platform

    runtime = "rocm" if current_platform.is_rocm() else "cuda" if current_platform.is_cuda() else None
    device = None
    if runtime is not None:
        import torch

        device = torch.cuda.current_device()
    return physical_gpu(os.environ, device, runtime or str(current_platform.device_type))


def _tp_rank_and_size(vllm_config: VllmConfig) -> tuple[int, int]:
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), tp_size
    except (AssertionError, RuntimeError, ImportError):
        return 0, tp_size
