"""The daemon: parts that each own their state (see sidecar/README.md for the reading path)."""
