"""What the shim imports: the shim<->daemon protocol, vLLM's prefill side channel, page formats and IPC.

Nothing here imports torch or NIXL at module level, so vLLM can load the shim without the daemon's needs.
"""
