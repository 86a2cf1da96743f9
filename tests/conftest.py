"""Tests run on the CPU with two virtual devices (one per mesh) unless a test spawns its own process."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_enable_x64", False)
