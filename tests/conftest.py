"""Tests run on the CPU with two virtual devices (one per mesh) unless a test spawns its own process."""
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# The package's pytest plugin (pyproject's pytest11 entry point) imported jax before this file ran,
# so JAX read no JAX_PLATFORMS: set it as a config. It matters where JAX's CUDA plugin is
# installed (the `inspect` extra): a backend start that tries the GPU unregisters the plugin,
# and with it the deviceless compiler the `gpu_aot` tests use.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402

# JAX's persistent compilation cache is off in the xdist workers. Its entries are written in place
# and read without a lock (jax/_src/lru_cache.py, unless eviction is on), and full runs here
# segfaulted twice reading one back (compilation_cache.get_executable_and_time, both times
# draft_tree's executable): once with the two workers sharing a directory, once with a directory
# each, so it is not only the race. pytest-xdist 3.8.0 could then hang replacing the worker. The
# tests that check the cache give it their own directories.
if os.environ.get("PYTEST_XDIST_WORKER") and "SSD_JAX_COMPILE_CACHE" not in os.environ:
    os.environ["SSD_JAX_COMPILE_CACHE"] = "0"

from ssd_jax.runtime.defaults import describe  # noqa: E402  (after the cache setting)

from _compile_level import (  # noqa: E402
    LEAN_BY_DEFAULT, release_executables_near_the_map_limit, set_lean, use_classic_cpu_emitters)

from _cli_models import pair  # noqa: E402,F401 - the `ssd-jax` tests' tiny HF folders, a fixture

# a test whose worker dies of a signal runs once more (tests/_crash_rerun.py says why and how)
from _crash_rerun import (  # noqa: E402,F401
    pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary)

# Under pytest-xdist (the README's test command: `-n 2` over everything but the real-weight
# modules) tests are spread over the workers as they free up (xdist's default `load`), so a
# module's fixtures are built in each worker that runs one of its tests. Modules whole on one
# worker (`--dist loadgroup`, marked here until 2026-12) were never what ran: pytest 9.2 derives
# `nodeid` from a structured id and xdist 3.8.0's loadgroup still renames `item._nodeid`, so
# every test was its own group (pytest-dev/pytest-xdist#1386); every CI time on record is of
# this spread, which keeps both workers busy to the end. The modules that hold the real 0.5B /
# 1.5B weights, or run the CLI or HF's fp32 oracle on them, are marked `real_weights` and run
# after, in two workers of their own (peak 8.6 GB used for both; 266 s against 390 s in one
# process, benchmarks/README.md at 8faea7c, "The test suite's time"), except the test marked `alone`: its
# 1.5B fp32 HF oracle takes 13 GB, which beside two workers (5-6 GB each by then) did not fit a
# 24 GiB machine, so it runs last, in a process of its own.
REAL_WEIGHTS = Path(__file__).resolve().parent / "real_weights"  # the folder of those modules


def pytest_configure(config):
    """XLA:CPU's classic emitters for a session that does not select the real-weight tests
    (tests/_compile_level.py says why); before any test or collected module starts JAX's CPU
    client."""
    use_classic_cpu_emitters(config.getoption("markexpr") or "")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marker added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().parent == REAL_WEIGHTS:
            item.add_marker(pytest.mark.real_weights)


# marker -> (the modules its tests import, the extra that installs them)
NEEDS = {"oracle": (("torch", "transformers"), "oracle"),
         "gpu_aot": (("jax_plugins.xla_cuda12", "libtpu"), "inspect")}


def _missing(marker: str) -> str | None:
    """What of a marker's modules (NEEDS) cannot be imported, or None."""
    import importlib.util
    mods, _ = NEEDS[marker]
    missing = []
    for m in mods:
        try:
            if importlib.util.find_spec(m) is None:
                missing.append(m)
        except ModuleNotFoundError:  # a parent package is missing
            missing.append(m)
    return ", ".join(missing) or None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test compiles lean (tests/_compile_level.py says why) unless it runs the real weights.
    Set before the test's fixtures, module-scoped ones included, and again for every test, so one
    that changed the level cannot pass it on.

    A test marked `oracle` (HF transformers on torch) or `gpu_aot` (JAX's CUDA plugin) fails
    without what it needs, never skips: a session without it deselects them by name
    (`-m "not oracle"`)."""
    for marker, (_, extra) in NEEDS.items():
        if item.get_closest_marker(marker) is not None and (missing := _missing(marker)):
            pytest.fail(f"{item.nodeid} needs {missing}, which is not installed: `pip install -e "
                        f".[{extra}]`, or deselect it with -m \"not {marker}\"", pytrace=False)
    set_lean(LEAN_BY_DEFAULT and item.get_closest_marker("real_weights") is None)


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Compiled programs are released before the process runs out of memory mappings
    (tests/_compile_level.py, `release_executables_near_the_map_limit`, says why): between modules
    from 40% of the limit on (a finished module's programs are rarely needed again), inside one
    from 75% (a recompile is cheaper than a crash)."""
    boundary = nextitem is None or nextitem.path != item.path
    release_executables_near_the_map_limit(0.4 if boundary else 0.75)


# read once, at start-up: a failing test may have changed SSD_JAX_CPU_ISA by the time it reports
_MACHINE = f"cpu: {describe()}; {os.cpu_count()} cores; jax {jax.__version__}"


def _xla_flags() -> str:
    return f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"  # set in pytest_configure


def pytest_report_header(config):
    """The CPU every figure and failure came from (machines here differ: AVX-512 BF16 / VNNI or AVX2
    only), so that a CI log says which kernel paths ran."""
    return f"{_MACHINE}; {_xla_flags()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure's report names the CPU too: CI shows the end of the log, not its header."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("machine", f"{_MACHINE}; {_xla_flags()}"))
