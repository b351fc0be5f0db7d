"""Loaded by every interop engine process (engines.py puts this folder on PYTHONPATH): torch reports no
AMX, so vLLM's CPU attention takes its AVX-512 path.

On a CPU machine of the CI kind seen on 2026-12-02 (a VM whose CPU lists amx_tile), vLLM 0.32's AMX decode
attention died with SIGILL (``Fatal Python error: Illegal instruction`` in ``cpu_attention_with_kv_cache``)
in the TP 2 -> TP 1 test, at this commit and at one that had passed CI the day before; with this, all three
passed. The interop tests check KV transport between real engines, not vLLM's kernels' ISA choice.
"""

try:
    import torch.cpu as _torch_cpu
except ImportError:  # a process without torch: nothing to steer
    pass
else:
    _torch_cpu._is_amx_tile_supported = lambda: False
