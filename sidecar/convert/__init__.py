"""Standard → AITER shuffled KV page conversion: torch reference (any device) and Triton kernels (GPU)."""

from sidecar.convert.api import PlaneSet, convert_layers_standard_to_shuffled, convert_standard_to_shuffled

__all__ = ["PlaneSet", "convert_layers_standard_to_shuffled", "convert_standard_to_shuffled"]
