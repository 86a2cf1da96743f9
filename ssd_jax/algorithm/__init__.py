"""The algorithm as pure functions over pytrees: sampling and keys, verification, Saguaro
proposals, the speculation tree and cache, fan-out, backups, the speed-up model and policy, and
the jitted steps (docs/ALGORITHM.md)."""
