"""Tests run on the CPU with two virtual devices (one per mesh) unless a test spawns its own process."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402

# Under pytest-xdist (the README's test command runs `-n 2`; `--dist loadgroup` is in pyproject's
# addopts) each test module runs whole on one worker, so a module's fixtures (models, compiled
# engines) are built once. The modules that hold the real 0.5B / 1.5B weights, or run the CLI on
# them, share one group: they run one after another, never two copies of the pair at once on a
# 24 GiB machine.
REAL_WEIGHT_MODULES = {"test_real_models.py", "test_loading.py", "test_cli.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        group = "real-weights" if name in REAL_WEIGHT_MODULES else str(item.path.relative_to(config.rootpath))
        item.add_marker(pytest.mark.xdist_group(group))
