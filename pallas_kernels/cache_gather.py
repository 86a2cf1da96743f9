"""Outcome-conditioned speculation-cache lookup (ALGORITHM.md §2, step 4).

After verification each sequence knows its outcome `(k, t*)` (accepted count, bonus token). The
speculation cache holds, per sequence, MQ branches keyed `(j, c)` with their K drafted tokens and
the K proposal rows `[K, V]` those tokens were sampled from. The lookup finds the branch whose key
equals the outcome and returns its tokens and rows - bit for bit, since exactness requires the very
rows that were sampled from (ALGORITHM.md §2). A miss returns index -1 and zeros.

  * `cache_gather_reference` - plain jnp (also the XLA baseline: XLA's gather already reads only
    the selected rows).
  * `cache_gather` - a Pallas (Triton backend) kernel. Triton has no scalar prefetch, so instead of
    choosing the row block in an index map, every program recomputes the match from the tiny key
    array (MQ x 2 int32, a few hundred bytes) and then reads only the matched branch's row slice
    with a data-dependent index: one pass over exactly the bytes that are returned.

Grid (B, K, cdiv(V, block_v)): one program copies `block_v` entries of one proposal row. V (e.g.
151,936) need not be a power of 2: the last block is masked on load and on store. Triton needs
power-of-2 tensors, so the key/valid arrays are padded to MQp = next power of 2 >= MQ in the
wrapper (tiny arrays; the big `rows` array is never padded or copied).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ssd_jax.pallas_kernels._compat import (is_pow2, masked_load, masked_store, next_pow2, require_triton,
                                    triton_params)


@jax.jit
def cache_gather_reference(keys, valid, tokens, rows, outcome):
    """Plain-jnp lookup.

    keys: [B, MQ, 2] int32 branch keys (j, c); valid: [B, MQ] bool; tokens: [B, MQ, K] int32;
    rows: [B, MQ, K, V] float; outcome: [B, 2] int32 realised (k, t*).
    Returns hit [B] bool, index [B] int32 (-1 on a miss), next_tokens [B, K] (0 on a miss),
    next_rows [B, K, V] in rows' dtype (0 on a miss). Keys are unique among valid branches.
    """
    match = valid.astype(bool) & jnp.all(keys == outcome[:, None, :], axis=-1)  # [B, MQ]
    hit = jnp.any(match, axis=-1)
    index = jnp.where(hit, jnp.argmax(match, axis=-1), -1).astype(jnp.int32)
    safe = jnp.maximum(index, 0)
    # per-sequence takes (batching dims): no cross-device gather when the batch is sharded
    pick = jax.vmap(lambda x, i: x[i])
    next_tokens = jnp.where(hit[:, None], pick(tokens, safe), 0).astype(tokens.dtype)
    next_rows = jnp.where(hit[:, None, None], pick(rows, safe), 0).astype(rows.dtype)
    return hit, index, next_tokens, next_rows


def _gather_kernel(outcome_ref, keys_ref, valid_ref, tokens_ref, rows_ref,
                   index_ref, token_ref, out_ref, *, vocab, block_v, mq_pad):
    """One program = (sequence b, drafted position kk, vocab block vb).

    outcome_ref: [2] int32 (k, t*)          keys_ref: [2, MQp] int32 (row 0: j, row 1: c)
    valid_ref:   [MQp] int32 (0 = invalid, also the padding)
    tokens_ref:  [MQ, K] int32              rows_ref: [MQ, block_v] (rows[b, :, kk, block vb])
    index_ref:   [] int32                   token_ref: [] int32     out_ref: [block_v]
    """
    kk = pl.program_id(1)
    vb = pl.program_id(2)
    k_out = outcome_ref[0]
    t_out = outcome_ref[1]
    kj = keys_ref[0, :]
    kc = keys_ref[1, :]
    match = (valid_ref[...] != 0) & (kj == k_out) & (kc == t_out)  # [MQp]
    # Keys are unique among valid branches, so the largest matching position is the match.
    branch = jnp.arange(mq_pad, dtype=jnp.int32)
    index = jnp.max(jnp.where(match, branch, -1))
    hit = index >= 0
    safe = jnp.maximum(index, 0)  # a real branch, so the loads below stay in bounds on a miss
    # Every program of a sequence computes the same index and token; writing them from all programs
    # is a benign duplicate and avoids a second launch or a branch on program ids.
    index_ref[...] = index
    token_ref[...] = jnp.where(hit, tokens_ref[safe, kk], 0)
    cols = vb * block_v + jnp.arange(block_v, dtype=jnp.int32)
    in_vocab = cols < vocab  # the last vocab block is partial
    # On a miss nothing is read from the rows: the masked load yields zeros.
    vals = masked_load(rows_ref.at[safe, :], mask=in_vocab & hit, other=0)
    masked_store(out_ref.at[:], vals.astype(out_ref.dtype), mask=in_vocab)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def cache_gather(keys, valid, tokens, rows, outcome, *, block_v=4096, num_warps=4, num_stages=2,
                 interpret=False):
    """Pallas lookup; same arguments and results as `cache_gather_reference`.

    Static: shapes, block_v (power of 2 >= 16; clipped to the padded vocab), Triton num_warps /
    num_stages, interpret. Only the matched branch's K x V rows are read, in one pass.
    """
    require_triton()
    B, MQ, K, V = rows.shape
    if keys.shape != (B, MQ, 2) or valid.shape != (B, MQ) or tokens.shape != (B, MQ, K):
        raise ValueError(f"inconsistent shapes: keys {keys.shape}, valid {valid.shape}, "
                         f"tokens {tokens.shape}, rows {rows.shape}")
    if outcome.shape != (B, 2):
        raise ValueError(f"outcome must be [B, 2], got {outcome.shape}")
    if not (is_pow2(block_v) and block_v >= 16):
        raise ValueError(f"block_v must be a power of 2 >= 16 (Triton), got {block_v}")
    block_v = min(block_v, max(16, next_pow2(V)))
    n_vb = -(-V // block_v)
    mq_pad = max(16, next_pow2(MQ))
    # Small arrays, padded to a power of 2 for Triton; padding rows are invalid.
    keys_t = jnp.pad(keys.astype(jnp.int32).transpose(0, 2, 1), ((0, 0), (0, 0), (0, mq_pad - MQ)),
                     constant_values=-1)
    valid_p = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, mq_pad - MQ)))
    kernel = functools.partial(_gather_kernel, vocab=V, block_v=block_v, mq_pad=mq_pad)
    index, next_tokens, next_rows = pl.pallas_call(
        kernel,
        grid=(B, K, n_vb),
        in_specs=[
            pl.BlockSpec((None, 2), lambda b, k, v: (b, 0)),
            pl.BlockSpec((None, 2, mq_pad), lambda b, k, v: (b, 0, 0)),
            pl.BlockSpec((None, mq_pad), lambda b, k, v: (b, 0)),
            pl.BlockSpec((None, MQ, K), lambda b, k, v: (b, 0, 0)),
            # All MQ branches of (b, k, vocab block) are addressable; the kernel reads one of them.
            pl.BlockSpec((None, MQ, None, block_v), lambda b, k, v: (b, 0, k, v)),
        ],
        out_specs=[
            pl.BlockSpec((None,), lambda b, k, v: (b,)),
            pl.BlockSpec((None, None), lambda b, k, v: (b, k)),
            pl.BlockSpec((None, None, block_v), lambda b, k, v: (b, k, v)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.ShapeDtypeStruct((B, K), jnp.int32),
            jax.ShapeDtypeStruct((B, K, V), rows.dtype),
        ],
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="ssd_cache_gather",
    )(outcome.astype(jnp.int32), keys_t, valid_p, tokens.astype(jnp.int32), rows)
    return index >= 0, index, next_tokens.astype(tokens.dtype), next_rows


def gather_bytes(batch: int, k: int, vocab: int, itemsize: int) -> int:
    """HBM bytes the lookup must move: read the matched K x V rows and write them once."""
    return 2 * batch * k * vocab * itemsize


__all__ = ["cache_gather", "cache_gather_reference", "gather_bytes"]
