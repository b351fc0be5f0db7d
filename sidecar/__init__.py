"""kv-sidecar: pulls standard KV pages from stock vLLM prefills and converts them for an AITER decoder."""

__version__ = "0.1.0"
