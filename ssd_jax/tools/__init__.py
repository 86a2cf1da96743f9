"""User-facing tools: the `ssd-jax` command (fetch, generate, bench) and the benchmark set."""
