"""How hard XLA:CPU optimizes what the tests compile.

Most of the suite compiles far more than it runs: tiny models, a few calls per program, and about
two thirds of a worker's time in XLA:CPU's compiler (benchmarks/README.md, "backup="auto" on the
device loop, and where the suite's time goes"). JAX's `jax_disable_most_optimizations` (LLVM at
-O0, its expensive passes off; XLA's HLO passes still run) compiles those programs in about half the
time. Where a program runs long instead - a statistical case's 100k requests through one compiled
step, the real weights - lean code runs slower, so those keep full optimization: `optimized()`
around the runs, and every `real_weights` test (tests/conftest.py). The figures:
benchmarks/README.md, "The suite compiled lean".

The switch is read when a program is compiled and is part of the persistent cache's key, so the
two levels never share an executable on disk. It is also exported as JAX's environment variable,
for the processes a test starts. `SSD_JAX_TEST_FULL_OPT=1` runs the whole suite fully optimized.
"""
from __future__ import annotations

import contextlib
import os

import jax

_FLAG = "jax_disable_most_optimizations"
_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
LEAN_BY_DEFAULT = os.environ.get("SSD_JAX_TEST_FULL_OPT") != "1"


def set_lean(lean: bool) -> None:
    """Compile from now on with most optimizations off (True) or fully (False), here and in the
    processes started from here."""
    jax.config.update(_FLAG, bool(lean))
    if lean:
        os.environ[_ENV] = "1"
    else:
        os.environ.pop(_ENV, None)


def is_lean() -> bool:
    return bool(jax.config.read(_FLAG))


@contextlib.contextmanager
def optimized():
    """Programs compiled inside are fully optimized (for code that runs long); the level before
    comes back after."""
    was = is_lean()
    set_lean(False)
    try:
        yield
    finally:
        set_lean(was)
