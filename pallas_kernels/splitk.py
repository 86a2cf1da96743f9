"""The split-k machinery the attention kernels share (`cache_attention`, `tree_attention`).

A program of grid (sequence b, kv head h, split) holds the R query rows that use kv head h (the
GQA group folded with the new tokens or the tree's branches: `rows_for`), walks its equal share of
the live cache prefix in `block_s` blocks with an online softmax (`walk_prefix`, `online_step`)
and writes a normalised partial output and its log-sum-exp (`write_split`, `split_outputs`);
`merge_splits` combines the splits in one more launch and writes the heads in the layout the o
projection reads. `tiling` picks block size, warps and split count; `pack_rows` makes the one
operand holding the queries and the new K / V rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ssd_jax.pallas_kernels._compat import (is_pow2, masked_load, masked_store, next_pow2,
                                            triton_params)

# Enough programs for ~2 waves on a 132-SM H200; the split count is derived from this.
_TARGET_PROGRAMS = 264


def online_step(carry, s, v_rows, precision):
    """One online-softmax step: carry (o [R, D], m [R], l [R]) float32 with logits s [R, N] over
    values v_rows [N, D]."""
    o, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row with nothing visible so far keeps m = -inf; shift by 0 there so exp() stays NaN-free.
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_shift)
    p = jnp.exp(s - m_shift[:, None])
    pv = lax.dot_general(p.astype(v_rows.dtype), v_rows, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=1)


def write_split(o_ref, lse_ref, carry, keep):
    """Write a split's output normalised by its own sum (0 where the row saw nothing or `keep`
    [R] is False) and its log-sum-exp (-inf there)."""
    o, m, l = carry
    seen = (l > 0) & keep
    o_ref[...] = jnp.where(seen[:, None], o / jnp.where(seen, l, 1.0)[:, None], 0.0).astype(
        o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def walk_prefix(q, k_ref, v_ref, live, limit, *, split, num_splits, block_s, scale, precision):
    """This split's share of the live prefix (cache slots < `live`, cut into whole `block_s`
    blocks, equal shares per split): the online-softmax carry of q [R, D] over it, each row
    seeing the slots < its `limit` ([R, 1], or a scalar for all rows). Slots past `live` are
    never read (stale or uninitialised): the masked loads give 0, so they never meet p = 0 as
    NaN, and the work follows the prefix, not S."""
    rows, head_dim = q.shape
    n_blocks = (live + block_s - 1) // block_s
    per_split = (n_blocks + num_splits - 1) // num_splits
    first = split * per_split
    count = jnp.clip(n_blocks - first, 0, per_split)
    col = lax.broadcasted_iota(jnp.int32, (block_s,), 0)

    def body(i, carry):
        start = (first + i) * block_s
        cols = start + col  # [block_s] cache slots of this block
        in_live = (cols < live)[:, None]
        k = masked_load(k_ref.at[pl.ds(start, block_s), :], mask=in_live, other=0)
        v = masked_load(v_ref.at[pl.ds(start, block_s), :], mask=in_live, other=0)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [R, block_s]
        return online_step(carry, jnp.where(cols[None, :] < limit, s, -jnp.inf), v, precision)

    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    return lax.fori_loop(0, count, body, carry)


def tiling(rows: int, head_dim: int, batch: int, kv_heads: int, window: int, cache_len: int,
           block_s=None, num_warps=None, num_splits=None):
    """(block_s, num_warps, num_splits, the cache block: S rounded up to whole blocks) for a
    split-k kernel over `rows` query rows a kv head: the given values, or `default_tiling` /
    `default_num_splits` for None; block_s must be a power of 2 >= 16 (Triton)."""
    auto_block_s, auto_warps = default_tiling(rows, head_dim)
    block_s = auto_block_s if block_s is None else block_s
    num_warps = auto_warps if num_warps is None else num_warps
    if not (is_pow2(block_s) and block_s >= 16):
        raise ValueError(f"block_s must be a power of 2 >= 16 (Triton), got {block_s}")
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, window, block_s)
    return block_s, num_warps, num_splits, -(-cache_len // block_s) * block_s


def pack_rows(q, k_new, v_new, rows: int, new_rows: int, dtype):
    """One operand for the queries and the new K / V rows, [B, KVH, rows + 2 new_rows, D], in
    `dtype`: rows 0..rows-1 the queries of kv head h (row i * G + g for q [B, N, H, D]), then the
    new K rows (k_new [B, N, KVH, D]), then the new V rows, each padded with zeros. XLA makes it
    in one fusion with the rotary embedding; the kernel reads the three parts as blocks of one
    array. Returns (the operand, the new K rows' block index: rows is a multiple of new_rows)."""
    B, N, H, D = q.shape
    KVH = k_new.shape[2]
    G = H // KVH
    q_rows = q.astype(dtype).reshape(B, N, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(
        B, KVH, N * G, D)
    pad_n = ((0, 0), (0, 0), (0, new_rows - N), (0, 0))
    packed = jnp.concatenate([jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - N * G), (0, 0))),
                              jnp.pad(k_new.astype(dtype).transpose(0, 2, 1, 3), pad_n),
                              jnp.pad(v_new.astype(dtype).transpose(0, 2, 1, 3), pad_n)], axis=2)
    return packed, rows // new_rows


def split_outputs(batch: int, kv_heads: int, num_splits: int, rows: int, head_dim: int, dtype):
    """(out_specs, out_shapes) of a split-k kernel's partial results on grid (B, KVH, split): each
    split's output [R, D] normalised by its own sum (so `dtype`, the cache's, loses no range) and
    its log-sum-exp [R] in fp32, for `merge_splits`."""
    specs = [pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
             pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))]
    shapes = [jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, head_dim), dtype),
              jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32)]
    return specs, shapes


def merge_splits(o_split, lse_split, items: int, heads: int, out_dtype, *, interpret=False):
    """The splits' partial outputs [B, KVH, NS, R, D] (each normalised by its own sum) and
    log-sum-exps [B, KVH, NS, R] (rows r = i * G + g) merged by log-sum-exp in one launch, written
    as [B, items, heads, D] in `out_dtype` (query i, head h * G + g: what the o projection
    reads)."""
    B, KVH, NS, R, D = o_split.shape
    G = heads // KVH
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=NS, items=items, group=G,
                          group_pad=next_pow2(G)),
        grid=(B, KVH),
        in_specs=[pl.BlockSpec((None, None, NS, R, D), lambda b, h: (b, h, 0, 0, 0)),
                  pl.BlockSpec((None, None, NS, R), lambda b, h: (b, h, 0, 0))],
        out_specs=pl.BlockSpec((None, items, heads, D), lambda b, h: (b, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, items, heads, D), out_dtype),
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="ssd_attention_merge",
    )(o_split, lse_split)


def _merge_kernel(o_ref, lse_ref, out_ref, *, num_splits, items, group, group_pad):
    """One program = one (sequence b, kv head h): for each query i, its G rows merged over the
    splits and written to heads h * G .. h * G + G - 1.

    o_ref: [NS, R, D]; lse_ref: [NS, R]; out_ref: [items, H, D].
    """
    h = pl.program_id(1)
    head_dim = o_ref.shape[-1]
    mine = lax.broadcasted_iota(jnp.int32, (group_pad,), 0) < group

    def item(i, _):
        rows = pl.ds(i * group, group_pad)  # past this query's G rows: masked off

        def split(s, carry):
            acc, m, l = carry
            lse = masked_load(lse_ref.at[s, rows], mask=mine, other=-jnp.inf)
            o = masked_load(o_ref.at[s, rows, :], mask=mine[:, None], other=0).astype(jnp.float32)
            m_new = jnp.maximum(m, lse)
            m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha, w = jnp.exp(m - m_shift), jnp.exp(lse - m_shift)
            return alpha[:, None] * acc + w[:, None] * o, m_new, alpha * l + w

        acc, _, l = lax.fori_loop(0, num_splits, split, (
            jnp.zeros((group_pad, head_dim), jnp.float32),
            jnp.full((group_pad,), -jnp.inf, jnp.float32), jnp.zeros((group_pad,), jnp.float32)))
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        masked_store(out_ref.at[i, pl.ds(h * group, group_pad), :], out.astype(out_ref.dtype),
                     mask=mine[:, None])
        return 0

    lax.fori_loop(0, items, item, 0)


def rows_for(items: int, group: int) -> int:
    """Query rows R of one program: items x G padded to a power of 2 >= 16, and far enough that
    the merge's [next_pow2(G)]-row window of the last item stays inside."""
    return max(16, next_pow2((items - 1) * group + next_pow2(group)))


def default_num_splits(batch: int, kv_heads: int, seq_len: int, block_s: int) -> int:
    """Split-k count: enough programs for ~2 waves on an H200, never more splits than blocks."""
    want = -(-_TARGET_PROGRAMS // max(1, batch * kv_heads))
    return int(max(1, min(want, -(-seq_len // block_s), 64)))


def default_tiling(rows: int, head_dim: int) -> tuple[int, int]:
    """(block_s, num_warps) by the size of the per-program accumulators (untuned guesses).

    The [R, D] output accumulator and the [R, block_s] logits live in registers; keep them near
    64 float32 registers per thread each: 4 warps for R x D <= 128 x 64, else 8 warps, and halve
    block_s when R x D exceeds 256 x 64 (e.g. MQ 24 x G 7 -> R 256 with D 128).
    """
    acc = rows * head_dim
    num_warps = 4 if acc <= 128 * 64 else 8
    block_s = 64 if acc <= 256 * 64 else 32
    return block_s, num_warps


__all__ = ["default_num_splits", "default_tiling", "merge_splits", "online_step", "pack_rows",
           "rows_for", "split_outputs", "tiling", "walk_prefix", "write_split"]
