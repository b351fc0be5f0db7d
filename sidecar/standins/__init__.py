"""Stand-ins for the real peers: a prefill emulator, a decoder stand-in, the demo that runs them together."""
