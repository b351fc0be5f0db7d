"""Benchmarks behind ``kv-sidecar bench``: each module has ``add_arguments(parser)`` and ``run(args)``."""
