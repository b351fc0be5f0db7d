"""vLLM KV-connector shim that hands remote-prefill loads to a kv-sidecar daemon."""
