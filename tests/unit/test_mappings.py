"""The warning before XLA:CPU's compiled programs exhaust the process's memory mappings
(ssd_jax/runtime/mappings.py): raised from a real compile at each threshold once, silent below it,
and on for every Engine."""
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

from ssd_jax.runtime import mappings
from ssd_jax.runtime.mappings import MappingLimitWarning

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/maps and vm.max_map_count")


@pytest.fixture
def limit_at(monkeypatch):
    """`limit_at(share)`: the process pretends to hold `share` of its mapping limit (the real
    counts move by dozens with each compile and free, too much for a threshold test), with no
    threshold warned yet; the real limit is left alone (the suite releases programs before it)."""
    monkeypatch.setitem(mappings._state, "warned", set())
    monkeypatch.setattr(mappings, "map_limit", lambda: 10_000)

    def set_share(share: float) -> None:
        monkeypatch.setattr(mappings, "map_count", lambda: int(share * 10_000))
        monkeypatch.setitem(mappings._state, "next", 0.0)  # the next compile checks
    return set_share


def _compile_something_new(i: float) -> None:
    """A compile of a program no cache holds (a new function), which the listener hears."""
    jax.jit(lambda x: jnp.tanh(x) * i + i).lower(jnp.ones(5)).compile()


def _mapping_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, MappingLimitWarning)]


def test_a_compile_past_each_threshold_warns_once_with_the_remedy(limit_at):
    assert mappings.watch_mappings()
    limit_at(0.88)  # between the thresholds
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _compile_something_new(1.5)
        assert mappings.check_mappings() == 0.88  # the same threshold: not again
    got = _mapping_warnings(record)
    assert len(got) == 1, got
    assert "vm.max_map_count" in got[0] and "jax.clear_caches()" in got[0], got[0]
    limit_at(0.97)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _compile_something_new(3.5)
    assert len(_mapping_warnings(record)) == 1  # the last warning (0.95), once


def test_below_the_threshold_a_compile_warns_nothing(limit_at):
    assert mappings.watch_mappings()
    limit_at(0.5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _compile_something_new(4.5)
    assert _mapping_warnings(record) == []
    assert mappings.check_mappings() == 0.5


def test_the_counts_are_this_process_and_the_kernel_setting():
    """What the shares are made of: /proc/self/maps' lines, which a compile's executable adds to,
    and vm.max_map_count."""
    assert 0 < mappings.map_count() < mappings.map_limit()
    start = mappings.map_count()
    held = [jax.jit(lambda x, i=i: jnp.sin(x) * i).lower(jnp.ones(3)).compile() for i in range(20)]
    assert mappings.map_count() > start + 20 and len(held) == 20


def test_the_listener_reads_the_mappings_at_most_every_recheck_interval(limit_at, monkeypatch):
    """Reading /proc/self/maps costs ~1 ms per 1,000 mappings: compiles in quick succession read
    it once, far from the limit it waits longer, and a check is due again after the interval."""
    assert mappings.watch_mappings()
    limit_at(0.6)
    reads = []
    monkeypatch.setattr(mappings, "map_count", lambda: reads.append(1) or 6_000)
    monkeypatch.setattr(mappings, "RECHECK_S", 60.0)
    for i in range(3):
        _compile_something_new(5.5 + i)
    assert len(reads) == 1
    monkeypatch.setitem(mappings._state, "next", 0.0)
    monkeypatch.setattr(mappings, "map_count", lambda: reads.append(1) or 2_000)
    _compile_something_new(9.5)
    assert len(reads) == 2
    assert mappings._state["next"] - mappings.time.monotonic() > mappings.RECHECK_FAR_S - 5


def test_every_engine_watches_the_mappings(monkeypatch):
    """Engine() turns the watch on, once a process: the listener the compiles above reach."""
    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import random_params
    from ssd_jax.runtime.engine import Engine

    monkeypatch.setitem(mappings._state, "watching", False)
    calls = []
    monkeypatch.setattr(jax.monitoring, "register_event_duration_secs_listener", calls.append)
    cfg = tiny_config("llama", vocab_size=23)
    for _ in range(2):
        Engine(Model(cfg, random_params(cfg, 1)), compilation_cache=False)
    assert calls == [mappings._on_event]
