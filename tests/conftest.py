"""Tests run on the CPU with two virtual devices (one per mesh) unless a test spawns its own process."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402

# JAX's persistent compilation cache writes an entry in place and reads it without a lock
# (jax/_src/lru_cache.py, unless eviction is on): a process that reads an entry while another
# writes it deserializes half an executable and segfaults (a full run here crashed an xdist
# worker in compilation_cache.get_executable_and_time; the two workers compile many of the same
# small programs). Each worker therefore keeps its own directory; a test's subprocesses inherit it.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "SSD_JAX_COMPILE_CACHE" not in os.environ:
    from ssd_jax.runtime.compile_cache import default_dir  # noqa: E402

    _SHARED = default_dir()
    os.environ["SSD_JAX_COMPILE_CACHE"] = str(_SHARED.with_name(f"{_SHARED.name}-pytest-{_WORKER}"))

# Under pytest-xdist (the README's test command: `-n 2` over everything but the real-weight
# modules; `--dist loadgroup` is in pyproject's addopts) each test module runs whole on one worker,
# so a module's fixtures (models, compiled engines) are built once. The modules that hold the real
# 0.5B / 1.5B weights, or run the CLI or HF's fp32 oracle on them, are marked `real_weights` and
# run after, in one process of their own: beside two workers (5-6 GB each by then) the 1.5B
# oracle's 13 GB did not fit a 24 GiB machine.
REAL_WEIGHT_MODULES = {"test_real_models.py", "test_loading.py", "test_cli.py"}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marker added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in REAL_WEIGHT_MODULES:
            item.add_marker(pytest.mark.real_weights)
        item.add_marker(pytest.mark.xdist_group(str(item.path.relative_to(config.rootpath))))
