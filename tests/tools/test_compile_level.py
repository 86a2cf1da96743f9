"""The suite's compile level (tests/_compile_level.py): lean for ordinary tests, full inside
`optimized()` and for the real-weight modules, and never leaked from one test to the next."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from _compile_level import LEAN_BY_DEFAULT, is_lean, optimized, set_lean

pytestmark = pytest.mark.skipif(not LEAN_BY_DEFAULT, reason="SSD_JAX_TEST_FULL_OPT=1: no lean level")


def test_an_ordinary_test_compiles_lean_here_and_in_its_subprocesses():
    assert is_lean()
    assert os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1"


def test_optimized_compiles_fully_inside_and_restores_after():
    with optimized():
        assert not is_lean() and "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ
        # a program compiled here still computes what a lean one does
        full = jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.arange(12.0).reshape(3, 4) / 7)
    assert is_lean() and os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1"
    lean = jax.jit(lambda x: jnp.tanh(x) @ x.T + 0)(jnp.arange(12.0).reshape(3, 4) / 7)
    assert jnp.allclose(full, lean, rtol=1e-6)
    with pytest.raises(RuntimeError), optimized():
        raise RuntimeError
    assert is_lean()


class _Item:
    """What the setup hook reads of a test item."""

    def __init__(self, *markers):
        self.markers = markers

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_the_setup_hook_sets_the_level_for_every_test():
    import conftest  # tests/conftest.py: the hook pytest runs before each test's fixtures

    set_lean(False)  # as a test that changed the level and did not restore it
    conftest.pytest_runtest_setup(_Item())
    assert is_lean()
    conftest.pytest_runtest_setup(_Item("real_weights"))
    assert not is_lean()
    conftest.pytest_runtest_setup(_Item("slow"))
    assert is_lean()


def test_the_session_compiles_with_xlas_classic_cpu_emitters_unless_it_runs_real_weights(request):
    """Set in XLA_FLAGS (which a test's subprocess inherits) before JAX's CPU client started, for
    a session whose `-m` does not select the real-weight tests; refused once the client runs."""
    from jax._src import xla_bridge
    import _compile_level
    from _compile_level import CLASSIC_EMITTERS, classic_emitters_for, use_classic_cpu_emitters
    own = [f for f in (_compile_level.CALLER_XLA_FLAGS or "").split()
           if "xla_cpu_use_fusion_emitters" in f and f != CLASSIC_EMITTERS]
    if own:  # xdist's workers inherit the controller's CLASSIC_EMITTERS: that one is ours
        pytest.skip(f"XLA_FLAGS chose the emitters itself: {_compile_level.CALLER_XLA_FLAGS!r}")
    expected = classic_emitters_for(request.config.getoption("markexpr") or "")
    assert (CLASSIC_EMITTERS in os.environ.get("XLA_FLAGS", "").split()) == expected
    jax.devices()
    assert xla_bridge.backends_are_initialized()
    with pytest.raises(RuntimeError, match="already started"):
        use_classic_cpu_emitters("")


@pytest.mark.parametrize("markexpr,classic", [
    ("", True), ("not real_weights", True), ("not slow", True), ("not slow and not alone", True),
    ("real_weights and not alone", False), ("alone", False), ("real_weights", False),
    ("slow or real_weights", False), ("not(real_weights)", True)])
def test_which_sessions_get_the_classic_emitters(markexpr, classic):
    """By the session's `-m`, where the installed XLA has the classic emitters; never where it
    does not (jaxlib 0.11 dropped them and their flag, which would abort the CPU client)."""
    from _compile_level import classic_emitters_for
    from ssd_jax._compat import XLA_CPU_HAS_CLASSIC_EMITTERS
    assert classic_emitters_for(markexpr) == (classic and XLA_CPU_HAS_CLASSIC_EMITTERS)


def test_the_classic_emitters_flag_is_known_exactly_where_it_is_set():
    """`XLA_CPU_HAS_CLASSIC_EMITTERS` says what the installed XLA accepts: a process started with
    the flag comes up where it is True and aborts on the unknown flag where it is False."""
    from _compile_level import CLASSIC_EMITTERS
    from ssd_jax._compat import XLA_CPU_HAS_CLASSIC_EMITTERS
    env = dict(os.environ, XLA_FLAGS=CLASSIC_EMITTERS, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode == 0) == XLA_CPU_HAS_CLASSIC_EMITTERS, r.stderr[-2000:]
    if not XLA_CPU_HAS_CLASSIC_EMITTERS:
        assert "xla_cpu_use_fusion_emitters" in r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_releasing_the_executables_gives_their_memory_mappings_back():
    """XLA:CPU maps pages per compiled kernel and JAX's caches keep the programs alive, so a test
    worker ran out of mappings (`release_executables_near_the_map_limit` says how); dropping the
    caches past the threshold gives them back, and below it nothing is dropped."""
    from _compile_level import release_executables_near_the_map_limit
    from ssd_jax.runtime.mappings import map_count, map_limit
    assert map_limit() > 0
    fns = [jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x - i)) for i in range(60)]
    start = map_count()
    for f in fns:  # alive, so only the caches' references keep their executables
        f(jnp.ones(3)).block_until_ready()
    held = map_count()
    assert held > start + 60, (start, held)
    assert not release_executables_near_the_map_limit(2.0) and map_count() >= held
    assert release_executables_near_the_map_limit(0.0)
    assert map_count() < held - 60, (start, held, map_count())
