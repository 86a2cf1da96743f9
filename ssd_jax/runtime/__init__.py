"""Devices, processes and rounds: placement and sharding, the draft worker and its transport,
the engine's round loop, per-request state and metrics."""
