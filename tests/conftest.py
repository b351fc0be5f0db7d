"""Suite-wide settings: NIXL over UCX on loopback, quiet logs."""

import os

# NIXL/UCX on one host without a GPU: tcp for control, cma for bulk (UCX_TLS unset).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
