"""``kv-sidecar verify``: decode from pages the daemon converted, with readers written from AITER's source.

Golden grid (``golden``), shuffled-page readers (``readers``: torch on any device, ``triton_reader`` on a GPU,
AITER's own kernel on ROCm), node probes (``probes``: IPC, NIXL, vLLM), output (``report``), CLI (``main``).
"""
