"""Attention of a few new tokens over the KV cache, with the cache write, in one kernel: the GPU's
`attend` (decode, the K+1-token verify, the draft chain's steps).

The reference is `ssd_jax.models.ops.xla_attend`: write the new K/V rows at their positions, then
attend each query over the slots s <= its position (and s < window). Compiled for an H100, that
reference is per layer two cache updates, two batched dots, the softmax's two reductions and a
convert, and a transpose of the output; at batch > 1 XLA also transposes each cache whole, because
a cache stored `[B, S, KVH, D]` has its batch axes (B, KVH) apart (`ssd-jax inspect`).

This kernel reads the cache as stored: program (b, h, split) loads the rows of (sequence b,
kv head h) as strided blocks. It needs what `forward` always passes: the T new tokens of a row sit
at consecutive positions `start[b] + t`. Then query t sees

  * the prefix: cache slots `0 .. start[b] - 1` (and < window), read from the cache, and
  * the new tokens `0 .. t` (those at slots < window), read from `k_new` / `v_new`,

so the prefix it reads and the slots it writes (`start[b] .. start[b] + T - 1`, dropped past the
cache's end) never overlap, and the write is done in the same launch: the caches are aliased to the
outputs (in place where the caller donates them, as the engine's steps do). Split-k over the live
prefix as in `tree_attention` (the GQA group and the T queries folded into the rows of one block);
the last split also takes the new tokens; XLA merges the splits by log-sum-exp.

Numerics: fp32 logits scaled by D^-0.5, an online fp32 softmax, the unnormalised probabilities
rounded to the cache dtype for p @ v, summed in fp32 (the reference rounds the normalised ones):
equal to the reference within the cache dtype's rounding, not bit for bit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ssd_jax.pallas_kernels._compat import (is_pow2, masked_store, next_pow2, require_triton,
                                            triton_params)
from ssd_jax.pallas_kernels.splitk import (merge_splits, online_step, pack_rows, rows_for,
                                           split_outputs, tiling, walk_prefix, write_split)

_HIGHEST = lax.Precision.HIGHEST
MAX_ROWS = 128  # query rows one program holds (registers); more (a prefill): the reference


def serves(q, k_cache) -> bool:
    """Whether the kernel takes this call: at most MAX_ROWS query rows per kv head (T x G, padded),
    D a power of 2 >= 16 (Triton), q and cache of one float dtype."""
    B, T, H, D = q.shape
    G = H // k_cache.shape[2]
    return (rows_for(T, G) <= MAX_ROWS and is_pow2(D) and D >= 16 and q.dtype == k_cache.dtype
            and q.dtype in (jnp.float32, jnp.bfloat16))


def _kernel(q_ref, start_ref, kn_ref, vn_ref, k_ref, v_ref, o_ref, lse_ref, k_out, v_out, *,
            scale, block_s, num_splits, window, tokens, group, precision):
    """One program = one (sequence b, kv head h, split).

    q_ref:  [R, D]  the T x G queries of kv head h, row r = t * G + g (rows past T x G zero)
    start_ref: [Tp] int32, every entry start[b] (the first new token's slot)
    kn_ref, vn_ref: [Tp, D]  the new K / V rows of (b, h) (rows past T zero)
    k_ref, v_ref: [S_blk, D] the cache of (b, h); only the live prefix is read
    o_ref: [R, D] this split's output normalised by its own sum; lse_ref: [R] its log-sum-exp
    k_out, v_out: the same caches (aliased): the last split writes the new rows
    """
    split = pl.program_id(2)
    q = q_ref[...]
    rows = q.shape[0]
    start = jnp.max(start_ref[...])
    live = jnp.minimum(start, window)  # prefix slots every query sees
    carry = walk_prefix(q, k_ref, v_ref, live, live, split=split, num_splits=num_splits,
                        block_s=block_s, scale=scale, precision=precision)

    # The new tokens, in the last split: query t sees new token u <= t at a slot < window.
    last = split == num_splits - 1
    kn, vn = kn_ref[...], vn_ref[...]
    u = lax.broadcasted_iota(jnp.int32, (rows, kn.shape[0]), 1)
    t = lax.broadcasted_iota(jnp.int32, (rows, kn.shape[0]), 0) // group
    seen = last & (u <= t) & (u < tokens) & (start + u < window)
    s = lax.dot_general(q, kn, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    write_split(o_ref, lse_ref, online_step(carry, jnp.where(seen, s, -jnp.inf), vn, precision),
            jnp.ones((rows,), jnp.bool_))

    # The write: slots start .. start + T - 1, those inside the cache, by the last split only.
    slot = start + lax.broadcasted_iota(jnp.int32, (kn.shape[0],), 0)
    write = (last & (slot < k_out.shape[0]) & (slot - start < tokens))[:, None]
    masked_store(k_out.at[pl.ds(start, kn.shape[0]), :], kn, mask=write)
    masked_store(v_out.at[pl.ds(start, kn.shape[0]), :], vn, mask=write)


@functools.partial(jax.jit, static_argnames=("window", "block_s", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def cache_attention(q, k_new, v_new, positions, k_cache, v_cache, *, window=None, block_s=None,
                    num_splits=None, num_warps=None, num_stages=2, interpret=False):
    """`xla_attend` as one Pallas (Triton) kernel: q [B, T, H, D] at positions [B, T] =
    start[b] + t (consecutive, as `forward` passes them), k_new / v_new [B, T, KVH, D], caches
    [B, S, KVH, D]; window (static) the slots attended (default S). Returns (out [B, T, H * D] in
    q's dtype, k_cache, v_cache with the new rows written; rows past S dropped).

    Static: block_s (power of 2 >= 16), num_splits (split-k over the live prefix), Triton
    num_warps / num_stages, interpret (the Pallas interpreter, e.g. on the CPU); None picks
    `tree_attention`'s defaults."""
    require_triton()
    B, T, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    if (k_cache.shape != (B, S, KVH, D) or v_cache.shape != k_cache.shape or H % KVH
            or k_new.shape != (B, T, KVH, D) or v_new.shape != k_new.shape
            or positions.shape != (B, T)):
        raise ValueError(f"cache_attention: inconsistent shapes: q {q.shape}, k_new {k_new.shape}, "
                         f"v_new {v_new.shape}, positions {positions.shape}, caches "
                         f"{k_cache.shape}, {v_cache.shape}")
    if not serves(q, k_cache):
        raise ValueError(f"cache_attention takes T x G <= {MAX_ROWS} query rows, a head dim that is "
                         f"a power of 2 >= 16 and q of the caches' float dtype; got q {q.shape} "
                         f"{q.dtype}, caches {k_cache.dtype} with {KVH} kv heads")
    W = S if window is None else int(window)
    if not 1 <= W <= S:
        raise ValueError(f"window {W} must be in [1, {S}]")
    G = H // KVH
    R = rows_for(T, G)
    Tp = max(16, next_pow2(T))
    block_s, num_warps, num_splits, s_blk = tiling(R, D, B, KVH, W, S, block_s, num_warps,
                                                   num_splits)
    dt = k_cache.dtype
    rows, new_row = pack_rows(q, k_new, v_new, R, Tp, dt)  # rows t * G + g
    # start broadcast to [B, Tp]: no scalars in Triton blocks
    start = jnp.broadcast_to(positions[:, :1].astype(jnp.int32), (B, Tp))

    kernel = functools.partial(_kernel, scale=float(D ** -0.5), block_s=block_s,
                               num_splits=num_splits, window=W, tokens=T, group=G,
                               precision=_HIGHEST if dt == jnp.float32 else None)
    cache_spec = pl.BlockSpec((None, s_blk, None, D), lambda b, h, s: (b, 0, h, 0))
    part_specs, part_shapes = split_outputs(B, KVH, num_splits, R, D, dt)
    o_split, lse_split, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(B, KVH, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, R, D), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, Tp), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, Tp, D), lambda b, h, s: (b, h, new_row, 0)),
            pl.BlockSpec((None, None, Tp, D), lambda b, h, s: (b, h, new_row + 1, 0)),
            cache_spec, cache_spec,
        ],
        out_specs=[*part_specs, cache_spec, cache_spec],
        out_shape=[*part_shapes, jax.ShapeDtypeStruct(k_cache.shape, dt),
                   jax.ShapeDtypeStruct(v_cache.shape, dt)],
        input_output_aliases={4: 2, 5: 3},
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="ssd_cache_attention",
    )(rows, start, rows, rows, k_cache, v_cache)

    out = merge_splits(o_split, lse_split, T, H, q.dtype, interpret=interpret)
    return out.reshape(B, T, H * D), k_cache, v_cache


__all__ = ["MAX_ROWS", "cache_attention", "serves"]
