"""How hard XLA:CPU optimizes what the tests compile.

Most of the suite compiles far more than it runs: tiny models, a few calls per program, and about
two thirds of a worker's time in XLA:CPU's compiler (benchmarks/README.md at 8faea7c, "backup="auto" on the
device loop, and where the suite's time goes"). JAX's `jax_disable_most_optimizations` (LLVM at
-O0, its expensive passes off; XLA's HLO passes still run) compiles those programs in about half the
time. Where a program runs long instead - a statistical case's 100k requests through one compiled
step, the real weights - lean code runs slower, so those keep full optimization: `optimized()`
around the runs, and every `real_weights` test (tests/conftest.py). The figures:
benchmarks/README.md at 8faea7c, "The suite compiled lean".

The switch is read when a program is compiled and is part of the persistent cache's key, so the
two levels never share an executable on disk. It is also exported as JAX's environment variable,
for the processes a test starts.

Whatever the level, XLA:CPU's compile time was mostly spent in its newer fusion emitters (MLIR,
then LLVM), not in the HLO passes; the suite compiles with its classic elemental emitters
(`--xla_cpu_use_fusion_emitters=false` in `XLA_FLAGS`, which XLA reads once, when the CPU client
starts, so for the whole session and the processes its tests start). Three compile-bound modules
ran in 0.6x the time, every test passing, and the statistical cases' runs no slower
(benchmarks/README.md at 8faea7c, "XLA:CPU's classic emitters for the suite"). A session that selects the
real-weight tests (CI's second and third commands) keeps XLA's defaults: its long runs were ~10%
slower with the classic emitters. So do the notebooks' test (as users have them) and
`SSD_JAX_TEST_FULL_OPT=1` (everything fully optimized, XLA's own choices).
"""
from __future__ import annotations

import contextlib
import gc
import os
import re

import jax

from ssd_jax._compat import XLA_CPU_HAS_CLASSIC_EMITTERS
from ssd_jax.runtime.mappings import map_count, map_limit

_FLAG = "jax_disable_most_optimizations"
_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
LEAN_BY_DEFAULT = os.environ.get("SSD_JAX_TEST_FULL_OPT") != "1"
CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
CALLER_XLA_FLAGS: str | None = None  # XLA_FLAGS as the session was started with


def classic_emitters_for(markexpr: str) -> bool:
    """Whether a session run with `-m markexpr` compiles with CLASSIC_EMITTERS: yes, unless
    SSD_JAX_TEST_FULL_OPT=1, the installed jaxlib has no classic emitters (0.11 dropped them and
    their flag: ssd_jax._compat), or the expression selects the real-weight tests (names `real_weights`
    or `alone` other than after `not`), whose fully optimized programs run long and ran ~10%
    slower with them (benchmarks/README.md at 8faea7c, "XLA:CPU's classic emitters for the suite")."""
    if not LEAN_BY_DEFAULT or not XLA_CPU_HAS_CLASSIC_EMITTERS:
        return False
    return all(neg for neg, _ in re.findall(r"(\bnot\b[\s(]*)?\b(real_weights|alone)\b", markexpr))


def use_classic_cpu_emitters(markexpr: str) -> None:
    """Add CLASSIC_EMITTERS to `XLA_FLAGS` if `classic_emitters_for(markexpr)`; call it before
    JAX's CPU client starts (XLA reads the flags then; raises after)."""
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("JAX's CPU client already started: XLA_FLAGS set now would be ignored")
    global CALLER_XLA_FLAGS
    flags = os.environ.get("XLA_FLAGS", "")
    if CALLER_XLA_FLAGS is None:
        CALLER_XLA_FLAGS = flags
    if classic_emitters_for(markexpr) and "xla_cpu_use_fusion_emitters" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CLASSIC_EMITTERS}".strip()  # a caller's own stays


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


def release_executables_near_the_map_limit(share: float) -> bool:
    """Drop JAX's caches (so the compiled executables no test holds go, with their mappings) once
    this process holds `share` of `vm.max_map_count`. True if it did.

    XLA:CPU's JIT maps three pages (code, read-only data, data) per compiled kernel, and JAX's caches
    keep every program a process ever compiled; a test worker compiles thousands, so it reached the
    kernel's default limit of 65,530 mappings (`tests/unit/test_device_loop.py` then
    `tests/unit/test_speculative.py` in one process: 54,714 after 40 tests). Past it LLVM's JIT linker
    cannot map a new section and aborts (`report_fatal_error` in `RuntimeDyldImpl::emitSection`,
    read from a crashed worker's core) or segfaults: the crashes in `backend_compile_and_load`
    that `tests/_crash_rerun.py` kept rerunning."""
    limit = map_limit()
    if not limit or map_count() < share * limit:
        return False
    jax.clear_caches()
    gc.collect()
    return True
