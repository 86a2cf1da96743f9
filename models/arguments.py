"""Checks of the public functions' arguments, each a `ValueError` that names the argument.

Shapes and dtypes are static, so they are checked on every call, traced or not. Values (token
ids in range, rows that are probabilities) are checked only where they are known without
tracing (an eager call from a notebook): under `jit` nothing is read back and nothing is added
to the program.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ssd_jax.models.kv_cache import host_value

ROW_SUM_TOLERANCE = 1e-2  # a bf16 row's rounding over 150k entries stays well inside it


def shape(fn: str, name: str, x, ndim: int, layout: str) -> tuple[int, ...]:
    """x's shape, or a ValueError unless it has `ndim` axes (`layout`: e.g. "[B, K]")."""
    s = tuple(jnp.shape(x))
    if len(s) != ndim:
        raise ValueError(f"{fn}: {name} must be {layout}, got shape {s}")
    return s


def same(fn: str, name: str, got: tuple, want: tuple, layout: str) -> None:
    """A ValueError unless shape `got` of `name` is `want` (`layout` says why)."""
    if tuple(got) != tuple(want):
        raise ValueError(f"{fn}: {name} must be {layout} = {list(want)}, got {list(got)}")


def integer(fn: str, name: str, x) -> None:
    """A ValueError unless x is an integer array (token ids, counts, positions)."""
    dt = jnp.result_type(x)
    if not jnp.issubdtype(dt, jnp.integer):
        raise ValueError(f"{fn}: {name} must hold integers, got dtype {dt}")


def floating(fn: str, name: str, x) -> None:
    """A ValueError unless x is a floating-point array (logits, probability rows)."""
    dt = jnp.result_type(x)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{fn}: {name} must be floating point, got dtype {dt}")


def in_range(fn: str, name: str, x, lo: int, hi: int) -> None:
    """Where x's values are known: a ValueError unless every one is in [lo, hi)."""
    h = host_value(x)
    if h is None or h.size == 0:
        return
    if h.min() < lo or h.max() >= hi:
        raise ValueError(f"{fn}: {name} must be in [{lo}, {hi}), got values from {h.min()} to "
                         f"{h.max()}")


def probability_rows(fn: str, name: str, rows) -> None:
    """Where the rows' values are known: a ValueError unless each row [..., V] is finite,
    non-negative and sums to 1 (within ROW_SUM_TOLERANCE)."""
    h = host_value(rows)
    if h is None or h.size == 0:
        return
    h = h.astype(np.float64)
    if not np.all(np.isfinite(h)) or h.min() < 0:
        raise ValueError(f"{fn}: {name} must be probabilities: finite and >= 0, got values from "
                         f"{np.nanmin(h)} to {np.nanmax(h)}")
    sums = h.sum(-1)
    worst = float(np.max(np.abs(sums - 1.0)))
    if worst > ROW_SUM_TOLERANCE:
        raise ValueError(f"{fn}: every row of {name} must sum to 1, got sums from {sums.min():.6g} "
                         f"to {sums.max():.6g} (normalise them first)")
