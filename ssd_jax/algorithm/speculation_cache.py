"""The speculation cache: round T+1 speculations pre-drafted for likely outcomes of round T.

A static-shape pytree. Keys are outcomes `(j, c)`: "j draft tokens accepted, bonus token c".
Lookup by the realised outcome is the outcome-conditioned gather (a Pallas kernel, with its
plain-jnp reference, in `ssd_jax.pallas_kernels.cache_gather`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SpeculationCache:
    keys: jax.Array  # [B, MQ, 2] int32: (j, c)
    tokens: jax.Array  # [B, MQ, K] int32: the speculation each branch drafted
    rows: jax.Array  # [B, MQ, K, V] (row dtype): the exact proposal rows those tokens were drawn from
    valid: jax.Array  # [B, MQ] bool

    @property
    def num_branches(self) -> int:
        return self.keys.shape[1]


def cache_bytes(batch: int, branches: int, k: int, vocab: int, row_dtype) -> int:
    """Bytes of the proposal rows, which dominate the cache (B * MQ * K * V rows)."""
    return batch * branches * k * vocab * jnp.dtype(row_dtype).itemsize


def check_budget(batch: int, branches: int, k: int, vocab: int, row_dtype, budget_bytes: int | None):
    """A clear error (before anything is allocated) when the cache would not fit the user's budget."""
    need = cache_bytes(batch, branches, k, vocab, row_dtype)
    if budget_bytes is not None and need > budget_bytes:
        raise ValueError(
            f"the speculation cache needs {need / 2**20:.1f} MiB (batch {batch} x {branches} branches "
            f"x K {k} x vocab {vocab} x {jnp.dtype(row_dtype).itemsize} B) but the budget is "
            f"{budget_bytes / 2**20:.1f} MiB: lower the fan-out, K or batch, or use row_dtype='bfloat16'")
    return need


def lookup(cache: SpeculationCache, num_accepted: jax.Array, bonus: jax.Array, *,
           kernel: bool = False):
    """Outcome [B] x 2 -> (hit [B] bool, tokens [B, K], rows [B, K, V]); zeros on a miss."""
    from ssd_jax.pallas_kernels.cache_gather import cache_gather, cache_gather_reference

    outcome = jnp.stack([num_accepted, bonus], axis=-1).astype(jnp.int32)
    if kernel:
        fn = lambda *a: cache_gather(*a, interpret=jax.default_backend() == "cpu")  # noqa: E731
    else:
        fn = cache_gather_reference
    hit, _, tokens, rows = fn(cache.keys, cache.valid, cache.tokens, cache.rows, outcome)
    return hit, tokens, rows
