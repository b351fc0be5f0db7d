"""The NIXL side: the agent (registration, peers, reads, notifications), remote admission, geometry."""
