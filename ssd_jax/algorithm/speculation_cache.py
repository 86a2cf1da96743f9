"""The speculation cache: round T+1 speculations pre-drafted for likely outcomes of round T.

A static-shape pytree. Keys are outcomes `(j, c)`: "j draft tokens accepted, bonus token c".
Lookup by the realised outcome is the outcome-conditioned gather (a Pallas kernel, with its
plain-jnp reference, in `ssd_jax.pallas_kernels.cache_gather`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models import arguments as args
from ssd_jax.models.ops import XLA, Ops


@struct.dataclass
class SpeculationCache:
    """MQ pre-drafted speculations per sequence, keyed by outcome (a pytree; docs/ALGORITHM.md §2).

    keys `[B, MQ, 2]` int32: the outcome (j, c) each branch assumed; tokens `[B, MQ, K]` int32: the
    K tokens it drafted; rows `[B, MQ, K, V]` (the row dtype): the proposal rows those tokens were
    drawn from; valid `[B, MQ]` bool: whether the branch holds a speculation (inactive rows do not).

    one_hot_vocab (static): 0, or V when every proposal row is the one-hot row of V entries at its
    token (a greedy draft, Saguaro's scaling or not): rows are then `[B, MQ, K, 0]`, implicit in the
    tokens, and `lookup` builds the V-wide rows of the one branch it takes. A tree writing MQ x K
    one-hot rows that only a hit reads, and only one branch's, was most of what SSD's round moved
    beyond the weights (at the default pair's batch 16, 350 MB of fp32 rows a round, copied twice).
    """

    keys: jax.Array  # [B, MQ, 2] int32: (j, c)
    tokens: jax.Array  # [B, MQ, K] int32: the speculation each branch drafted
    rows: jax.Array  # [B, MQ, K, V] (row dtype): the exact proposal rows those tokens were drawn from
    valid: jax.Array  # [B, MQ] bool
    one_hot_vocab: int = struct.field(pytree_node=False, default=0)

    @property
    def num_branches(self) -> int:
        """MQ, the branches per sequence."""
        return self.keys.shape[1]


def cache_bytes(batch: int, branches: int, k: int, vocab: int, row_dtype,
                draft_greedy: bool = False) -> int:
    """Bytes of the proposal rows `[B, MQ, K, V]` in `row_dtype`, which dominate the cache
    (batch = B, branches = MQ, k = K, vocab = V); 0 for a greedy draft (`draft_greedy`), whose
    rows are implicit in its tokens (`SpeculationCache.one_hot_vocab`)."""
    if draft_greedy:
        return 0
    return batch * branches * k * vocab * jnp.dtype(row_dtype).itemsize


def check_budget(batch: int, branches: int, k: int, vocab: int, row_dtype, budget_bytes: int | None,
                 draft_greedy: bool = False):
    """A clear ValueError (before anything is allocated) when the cache rows `[B, MQ, K, V]` would
    not fit `budget_bytes` (None: no budget); otherwise returns their bytes (`cache_bytes`)."""
    need = cache_bytes(batch, branches, k, vocab, row_dtype, draft_greedy)
    if budget_bytes is not None and need > budget_bytes:
        raise ValueError(
            f"the speculation cache needs {need / 2**20:.1f} MiB (batch {batch} x {branches} branches "
            f"x K {k} x vocab {vocab} x {jnp.dtype(row_dtype).itemsize} B) but the budget is "
            f"{budget_bytes / 2**20:.1f} MiB: lower the fan-out, K or batch, or use row_dtype='bfloat16'")
    return need


def lookup(cache: SpeculationCache, num_accepted: jax.Array, bonus: jax.Array, *,
           ops: Ops = XLA):
    """The speculation for the realised outcome: num_accepted `[B]`, bonus `[B]` ->
    (hit `[B]` bool, tokens `[B, K]` int32, rows `[B, K, V]` in the cache's row dtype); zeros on a miss.

    The gather is `ops.cache_gather` (`ssd_jax.models.ops.Ops`): the plain-jnp reference, or the
    Pallas kernel of the `pallas` backend; both give the same result.

    A `ValueError` naming the argument, before anything is traced: num_accepted or bonus not
    integer `[B]` of the cache's B, and, where their values are known, num_accepted outside
    [0, K] or bonus outside [0, V). An outcome no branch assumed is a miss, not an error.
    """
    fn = "lookup"
    B, MQ, K = args.shape(fn, "cache.tokens", cache.tokens, 3, "[B, MQ, K]")
    if cache.one_hot_vocab:
        V = cache.one_hot_vocab
        args.same(fn, "cache.rows", jnp.shape(cache.rows), (B, MQ, K, 0),
                  "[B, MQ, K, 0] (one_hot_vocab: rows implicit in the tokens)")
    else:
        V = jnp.shape(cache.rows)[-1]
        args.same(fn, "cache.rows", jnp.shape(cache.rows), (B, MQ, K, V), "[B, MQ, K, V]")
    args.same(fn, "cache.keys", jnp.shape(cache.keys), (B, MQ, 2), "[B, MQ, 2]")
    for name, x, hi in (("num_accepted", num_accepted, K + 1), ("bonus", bonus, V)):
        args.integer(fn, name, x)
        args.same(fn, name, jnp.shape(x), (B,), "[B] (the cache's batch)")
        args.in_range(fn, name, x, 0, hi)
    outcome = jnp.stack([num_accepted, bonus], axis=-1).astype(jnp.int32)
    if cache.one_hot_vocab:
        # no rows to gather: the keys and tokens are a few bytes a branch, the plain gather's work
        hit, _, tokens, _ = XLA.cache_gather(cache.keys, cache.valid, cache.tokens, cache.rows,
                                             outcome)
        return hit, tokens, jnp.where(hit[:, None, None],
                                      jax.nn.one_hot(tokens, V, dtype=cache.rows.dtype), 0)
    hit, _, tokens, rows = ops.cache_gather(cache.keys, cache.valid, cache.tokens, cache.rows, outcome)
    return hit, tokens, rows
