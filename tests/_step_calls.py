"""Counting how often the engine calls its jitted steps (`ssd_jax.algorithm.steps`), for the tests
that assert which prefill path a batch took (tests/unit/test_shared_prefill.py, tests/unit/test_own_model.py)."""
from __future__ import annotations

from ssd_jax.algorithm import steps


def count_step_calls(monkeypatch, names) -> dict[str, int]:
    """Wrap each `steps.<name>` (for the test, through `monkeypatch`) to count its calls; returns
    the counts by name, updated as the engine runs."""
    seen = {name: 0 for name in names}
    for name in seen:
        def counted(*a, _real=getattr(steps, name), _name=name, **k):
            seen[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(steps, name, counted)
    return seen
