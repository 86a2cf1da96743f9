"""Tree attention for SSD's draft branch decode (ALGORITHM.md §2, "tree decode").

At one tree step every branch of a sequence has exactly one query. Branch `(j, c)` sees

  * the shared prefix: slots `0 .. prefix_len - 1` of the draft's per-layer KV cache (`n + j + 1`
    in SSD: committed tokens, the bonus `b` and `s_1..s_j`), and
  * its own path: entries `0 .. step` of its private KV buffer (token `c` and the tokens it has
    drafted so far).

Two implementations with the same signature and result:

  * `tree_attention_reference` - plain jnp, float32 softmax, dense over the whole cache. It pins the
    semantics (tests compare it with a per-branch numpy loop) and is the XLA baseline.
  * `tree_attention` - a Pallas (Triton backend) kernel for the prefix and the own paths, and a
    second small kernel that merges its splits.

Kernel design. The prefix dominates the bytes (S x KVH x D per sequence against Kb x KVH x D per
branch), and it is shared by every branch of a sequence. So one program handles one (sequence,
kv head, split): it stacks the MQ branches x G query heads that use this kv head into the R rows of
one block computation ("folding the tree into the GQA group"), walks its share of the live prefix in
`block_s` blocks with an online softmax and writes a normalised partial output plus its log-sum-exp.
Every prefix KV block is therefore read from HBM exactly once per sequence and kv head, and used for
all MQ x G queries. Splits (split-k) cut the live prefix - not the cache capacity - into equal whole
blocks, so short prefixes launch cheap empty programs and long ones spread over more SMs. The last
split also walks the own paths (Kb x KVH x D per branch): entry e of every branch at once, each row
keeping its own branch's score, its value row picked by an exact one-hot dot. `merge_splits` then
combines the splits by log-sum-exp and writes the heads in the layout the o projection reads
(pallas_kernels/splitk.py, which `cache_attention` shares). Compiled for an H100 (`ssd-jax inspect`), the XLA own path and
merge it replaces were ~10 launches a layer and a layout copy of each branch buffer.

Triton rules honoured here: tensors in the kernel have power-of-2 sizes (R = `rows_for(MQ, G)`,
e.g. 24 x 4 = 96 -> 128 and 24 x 7 = 168 -> 256; `block_s` a power of 2 >= 16; D a power
of 2), dots are at least 16 x 16 x 16, no scalar prefetch (lengths are data read inside the kernel),
and partial blocks are handled by masked loads, never by out-of-bounds reads.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ssd_jax.pallas_kernels._compat import (is_pow2, masked_load, masked_store, next_pow2,
                                            require_triton, triton_params)
from ssd_jax.pallas_kernels.splitk import (default_num_splits, default_tiling, merge_splits,
                                           pack_rows, rows_for, split_outputs,
                                           tiling, walk_prefix, write_split)

_HIGHEST = lax.Precision.HIGHEST


def _check_shapes(q, k_cache, v_cache, prefix_len, branch_k, branch_v, branch_valid):
    B, MQ, H, D = q.shape
    _, S, KVH, _ = k_cache.shape
    if k_cache.shape != (B, S, KVH, D) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k/v cache must be [B, S, KVH, D]; got {k_cache.shape}, {v_cache.shape}")
    if H % KVH:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {KVH}")
    Kb = branch_k.shape[2]
    if branch_k.shape != (B, MQ, Kb, KVH, D) or branch_v.shape != branch_k.shape:
        raise ValueError(f"branch_k/v must be [B, MQ, Kb, KVH, D]; got {branch_k.shape}")
    if prefix_len.shape != (B, MQ) or branch_valid.shape != (B, MQ):
        raise ValueError("prefix_len and branch_valid must be [B, MQ]")
    return B, MQ, H, D, S, KVH, H // KVH, Kb


def _own_path(qf, branch_k, branch_v, step, scale):
    """Dense attention of each branch's query over its own path entries 0..step.

    qf: [B, MQ, KVH, G, D] float32; branch_k/v: [B, MQ, Kb, KVH, D].
    Returns (o [B, MQ, KVH, G, D] float32 normalised, lse [B, MQ, KVH, G] float32). Entry 0 is always
    visible (0 <= step), so lse is finite whenever q and the buffer are.
    """
    Kb = branch_k.shape[2]
    visible = jnp.arange(Kb) <= step  # [Kb]
    bk = branch_k.astype(jnp.float32)
    # Entries past `step` are not written yet (may hold anything): zero them so 0 * garbage cannot
    # turn into NaN in p @ v.
    bv = jnp.where(visible[None, None, :, None, None], branch_v.astype(jnp.float32), 0.0)
    s = jnp.einsum("bmhgd,bmkhd->bmhgk", qf, bk, precision=_HIGHEST) * scale
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bmhgk,bmkhd->bmhgd", p, bv, precision=_HIGHEST) / l[..., None]
    return o, m + jnp.log(l)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale",))
def tree_attention_reference(q, k_cache, v_cache, prefix_len, branch_k, branch_v, step,
                             branch_valid, *, scale=None):
    """Plain-jnp tree attention (float32 softmax).

    q: [B, MQ, H, D] one query per branch; k_cache/v_cache: [B, S, KVH, D] shared by the branches of
    a sequence; prefix_len: [B, MQ] int32 (slots 0..prefix_len-1 visible, 0 allowed); branch_k/v:
    [B, MQ, Kb, KVH, D]; step: int32 scalar, own-path entries 0..step visible (0 <= step < Kb);
    branch_valid: [B, MQ] bool. Returns [B, MQ, H, D] in q's dtype; invalid branches are zeros.
    GQA: query head h uses kv head h // G, G = H // KVH.
    """
    B, MQ, H, D, S, KVH, G, Kb = _check_shapes(q, k_cache, v_cache, prefix_len, branch_k,
                                               branch_v, branch_valid)
    scale = D ** -0.5 if scale is None else scale
    qf = q.astype(jnp.float32).reshape(B, MQ, KVH, G, D)
    kf = k_cache.astype(jnp.float32)
    vf = v_cache.astype(jnp.float32)
    # Prefix logits [B, MQ, KVH, G, S]; slot s visible to branch m iff s < prefix_len[b, m].
    s_pre = jnp.einsum("bmhgd,bshd->bmhgs", qf, kf, precision=_HIGHEST) * scale
    vis_pre = jnp.arange(S)[None, None, :] < prefix_len[:, :, None]  # [B, MQ, S]
    s_pre = jnp.where(vis_pre[:, :, None, None, :], s_pre, -jnp.inf)
    # Own-path logits [B, MQ, KVH, G, Kb]; entries 0..step visible.
    vis_own = jnp.arange(Kb) <= step
    bvf = jnp.where(vis_own[None, None, :, None, None], branch_v.astype(jnp.float32), 0.0)
    s_own = jnp.einsum("bmhgd,bmkhd->bmhgk", qf, branch_k.astype(jnp.float32),
                       precision=_HIGHEST) * scale
    s_own = jnp.where(vis_own, s_own, -jnp.inf)
    # One softmax over the concatenation [prefix | own path].
    m = jnp.maximum(jnp.max(s_pre, axis=-1), jnp.max(s_own, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked row: keep exp() NaN-free
    p_pre = jnp.exp(s_pre - m[..., None])
    p_own = jnp.exp(s_own - m[..., None])
    l = jnp.sum(p_pre, axis=-1) + jnp.sum(p_own, axis=-1)
    o = (jnp.einsum("bmhgs,bshd->bmhgd", p_pre, vf, precision=_HIGHEST)
         + jnp.einsum("bmhgk,bmkhd->bmhgd", p_own, bvf, precision=_HIGHEST))
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    o = jnp.where(branch_valid[:, :, None, None, None], o, 0.0)
    return o.reshape(B, MQ, H, D).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def tree_attention_xla(q, k_cache, v_cache, prefix_len, branch_k, branch_v, step, branch_valid,
                       *, scale=None):
    """The best plain-XLA formulation we have (benchmark baseline, same result as the reference).

    Differences from the reference, all for speed: the cache stays in its dtype (bf16 x bf16 dots
    with float32 accumulation, no float32 copy of the cache), the GQA group and the branches are
    folded into the rows of one batched dot per (sequence, kv head), the probabilities are cast to
    the cache dtype for p @ v (like the kernel), and the own path is merged by log-sum-exp.
    """
    B, MQ, H, D, S, KVH, G, Kb = _check_shapes(q, k_cache, v_cache, prefix_len, branch_k,
                                               branch_v, branch_valid)
    scale = D ** -0.5 if scale is None else scale
    prec = _HIGHEST if k_cache.dtype == jnp.float32 else None
    qr = q.reshape(B, MQ, KVH, G, D).astype(k_cache.dtype)
    s = jnp.einsum("bmhgd,bshd->bhmgs", qr, k_cache, precision=prec,
                   preferred_element_type=jnp.float32) * scale
    vis = jnp.arange(S)[None, None, :] < prefix_len[:, :, None]  # [B, MQ, S]
    s = jnp.where(vis[:, None, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhmgs,bshd->bmhgd", p.astype(v_cache.dtype), v_cache, precision=prec,
                   preferred_element_type=jnp.float32)
    o_pre = o / jnp.where(l > 0, l, 1.0).transpose(0, 2, 1, 3)[..., None]
    lse_pre = jnp.where(l > 0, m_safe + jnp.log(l), -jnp.inf).transpose(0, 2, 1, 3)
    o_own, lse_own = _own_path(q.astype(jnp.float32).reshape(B, MQ, KVH, G, D), branch_k,
                               branch_v, step, scale)
    out = _merge_two(o_pre, lse_pre, o_own, lse_own)
    out = jnp.where(branch_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(B, MQ, H, D).astype(q.dtype)


def _merge_two(o_a, lse_a, o_b, lse_b):
    """Combine two normalised partial attentions by log-sum-exp (either may be empty: lse -inf)."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.exp(lse_a - m)
    wb = jnp.exp(lse_b - m)
    den = wa + wb
    den = jnp.where(den > 0, den, 1.0)
    return (wa[..., None] * o_a + wb[..., None] * o_b) / den[..., None]


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
def _tree_kernel(q_ref, rows_ref, kn_ref, vn_ref, k_ref, v_ref, *refs, scale, block_s, num_splits,
                 branches, group, precision, first):
    """One program = one (sequence b, kv head h, split).

    q_ref:    [R, D]      the MQ x G queries that use kv head h (branch-major, padded rows zero)
    rows_ref: [3, R] int32: each row's visible prefix length; 1 for a valid branch's row (0 for
              an invalid branch and the padding); the own-path step (every entry the same)
    kn_ref, vn_ref: [MQp, D] the branches' new K / V rows for kv head h (rows past MQ zero)
    k_ref, v_ref: [S_blk, D]  the whole cache of (b, h); only blocks of the live prefix are read
    bk_ref, bv_ref: [MQ, Kb, D] the branches' own-path K / V of kv head h; entries < step read
    o_ref:    [R, D]      this split's output, normalised by its own softmax sum (0 if empty)
    lse_ref:  [R] f32     this split's log-sum-exp (-inf if the row saw nothing here)
    bk_out, bv_out: the same branch buffers (aliased): the last split writes entry `step`

    The last split also takes the own paths: entries e < step of branch m from its buffer and
    entry `step` from the new rows, for the rows of m; then it writes the new rows. It reads no
    entry it writes, so no program waits on another's store.

    first (static): the first step (step 0): no branch buffers come in (bk_ref, bv_ref absent) and
    the last split writes every entry of the new ones, the new rows at 0 and zeros after.
    """
    if first:
        bk_ref = bv_ref = None
        o_ref, lse_ref, bk_out, bv_out = refs
    else:
        bk_ref, bv_ref, o_ref, lse_ref, bk_out, bv_out = refs
    split = pl.program_id(2)
    q = q_ref[...]
    plen = rows_ref[0, :]
    rows = q.shape[0]
    # the live prefix of this sequence: the longest branch's
    carry = walk_prefix(q, k_ref, v_ref, jnp.max(plen), plen[:, None], split=split,
                        num_splits=num_splits, block_s=block_s, scale=scale, precision=precision)

    # Own paths. Entry e of every branch at once: K_e [MQp, D] scored by every row, each row keeping
    # its own branch's column (a one-hot choice), V_e's row of that branch picked by a one-hot dot
    # (exact). MQp >= 16 rows keep Triton's dots legal; rows past MQ read as 0.
    mq_pad = kn_ref.shape[0]
    mcol = lax.broadcasted_iota(jnp.int32, (rows, mq_pad), 1)
    mine = mcol == lax.broadcasted_iota(jnp.int32, (rows, mq_pad), 0) // group  # [R, MQp]
    in_mq = (lax.broadcasted_iota(jnp.int32, (mq_pad,), 0) < branches)[:, None]
    last = split == num_splits - 1
    step = jnp.max(rows_ref[2, :])
    zero = split * 0  # a traced start: the [MQp] window may run past MQ (masked), as any load

    def own(ke, ve, carry):
        s = lax.dot_general(q, ke, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [R, MQp]
        s = jnp.sum(jnp.where(mine, s, 0.0), axis=1)  # [R]: each row's own branch
        o, m, l = carry
        m_new = jnp.maximum(m, s)
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        v_own = lax.dot_general(mine.astype(ve.dtype), ve, (((1,), (0,)), ((), ())),
                                precision=precision, preferred_element_type=jnp.float32)
        return alpha[:, None] * o + p[:, None] * v_own, m_new, alpha * l + p

    def entry(e, carry):
        ke = masked_load(bk_ref.at[pl.ds(zero, mq_pad), e, :], mask=in_mq, other=0)
        ve = masked_load(bv_ref.at[pl.ds(zero, mq_pad), e, :], mask=in_mq, other=0)
        return own(ke, ve, carry)

    kn, vn = kn_ref[...], vn_ref[...]
    before = carry if first else lax.fori_loop(0, jnp.where(last, step, 0), entry, carry)
    with_own = own(kn, vn, before)
    carry = tuple(jnp.where(last, a, b) for a, b in zip(with_own, carry))
    write_split(o_ref, lse_ref, carry, rows_ref[1, :] != 0)

    write = last & in_mq
    if first:  # every entry of the new buffers: the new rows, then zeros
        for e in range(bk_out.shape[1]):
            for out, new in ((bk_out, kn), (bv_out, vn)):
                masked_store(out.at[pl.ds(zero, mq_pad), zero + e, :],
                             new if e == 0 else jnp.zeros_like(new), mask=write)
        return
    masked_store(bk_out.at[pl.ds(zero, mq_pad), step, :], kn, mask=write)
    masked_store(bv_out.at[pl.ds(zero, mq_pad), step, :], vn, mask=write)


def tree_attention(q, k_new, v_new, k_cache, v_cache, prefix_len, branch_k, branch_v, step,
                   branch_valid, *, window=None, scale=None, block_s=None, num_splits=None,
                   num_warps=None, num_stages=2, interpret=False):
    """A tree step's branch write and attention: the new rows k_new / v_new [B, MQ, KVH, D]
    written at entry `step` of the branch buffers, then `tree_attention_reference` over the
    first `window` cache slots (default all). Returns (out [B, MQ, H, D], branch_k, branch_v);
    the buffers are aliased to the outputs (in place where the caller donates them).

    A `step` that is the Python int 0 is the first step (`write_branch`): the kernel reads
    nothing of branch_k / branch_v but their shape and makes the buffers itself, the new rows at
    entry 0 and zeros after. So a tree's layers need no zero buffer each to write into (XLA copies
    one shared zero buffer once a layer and buffer, for the in-place write).

    Two launches: the attention (prefix split-k, own paths and the write in the last split) and
    the merge of the splits. Static: window, scale, block_s (power of 2 >= 16), num_splits
    (split-k count over the live prefix), Triton num_warps / num_stages, interpret (run the
    kernels in the Pallas interpreter, e.g. on CPU). None picks `default_tiling` /
    `default_num_splits`. Data: prefix_len, step, branch_valid.
    """
    return _tree_attention(q, k_new, v_new, k_cache, v_cache, prefix_len, branch_k, branch_v,
                           step, branch_valid, window=window, scale=scale, block_s=block_s,
                           num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                           interpret=interpret, first=_is_first(step))


@functools.partial(jax.jit, static_argnames=("window", "scale", "block_s", "num_splits",
                                             "num_warps", "num_stages", "interpret", "first"))
def _tree_attention(q, k_new, v_new, k_cache, v_cache, prefix_len, branch_k, branch_v, step,
                    branch_valid, *, window, scale, block_s, num_splits, num_warps, num_stages,
                    interpret, first):
    require_triton()
    B, MQ, H, D, S, KVH, G, Kb = _check_shapes(q, k_cache, v_cache, prefix_len, branch_k,
                                               branch_v, branch_valid)
    if k_new.shape != (B, MQ, KVH, D) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new / v_new must be [B, MQ, KVH, D] = {[B, MQ, KVH, D]}; got "
                         f"{k_new.shape}, {v_new.shape}")
    W = S if window is None else int(window)
    if not 1 <= W <= S:
        raise ValueError(f"window {W} must be in [1, {S}]")
    # Rows: the MQ x G queries of one kv head, padded (Triton tensor and dot minimum; the merge's
    # window). Padded rows get prefix length 0 and no validity.
    MG = MQ * G
    R = rows_for(MQ, G)
    MQp = max(16, next_pow2(MQ))
    block_s, num_warps, num_splits, s_blk = tiling(R, D, B, KVH, W, S, block_s, num_warps,
                                                   num_splits)
    if not (is_pow2(D) and D >= 16):
        raise ValueError(f"head dim must be a power of 2 >= 16 (Triton), got {D}")
    dt = k_cache.dtype
    if v_cache.dtype != dt or branch_k.dtype != dt or branch_v.dtype != dt:
        raise ValueError("k_cache, v_cache and the branch KV must share a dtype")
    scale = float(D ** -0.5 if scale is None else scale)

    valid = branch_valid.astype(bool)
    q_c = jnp.where(valid[:, :, None, None], q, 0)  # invalid branches: no garbage into the dots
    # rows m * G + g: branch-major, so row // G is the branch
    rows, new_row = pack_rows(q_c, k_new, v_new, R, MQp, dt)
    plen = jnp.where(valid, jnp.clip(prefix_len.astype(jnp.int32), 0, W), 0)
    per_row = lambda x: jnp.pad(jnp.repeat(x, G, axis=1), ((0, 0), (0, R - MG)))  # noqa: E731
    row_info = jnp.stack([per_row(plen), per_row(valid.astype(jnp.int32)),
                          jnp.broadcast_to(jnp.asarray(step, jnp.int32), (B, R))], axis=1)

    precision = _HIGHEST if dt == jnp.float32 else None
    kernel = functools.partial(_tree_kernel, scale=scale, block_s=block_s,
                               num_splits=num_splits, branches=MQ, group=G, precision=precision,
                               first=first)
    cache_spec = pl.BlockSpec((None, s_blk, None, D), lambda b, h, s: (b, 0, h, 0))
    branch_spec = pl.BlockSpec((None, MQ, Kb, None, D), lambda b, h, s: (b, 0, 0, h, 0))
    part_specs, part_shapes = split_outputs(B, KVH, num_splits, R, D, dt)
    branches = () if first else (branch_k, branch_v)  # the first step makes its own
    o_split, lse_split, branch_k, branch_v = pl.pallas_call(
        kernel,
        grid=(B, KVH, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, R, D), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, 3, R), lambda b, h, s: (b, 0, 0)),
            pl.BlockSpec((None, None, MQp, D), lambda b, h, s: (b, h, new_row, 0)),
            pl.BlockSpec((None, None, MQp, D), lambda b, h, s: (b, h, new_row + 1, 0)),
            cache_spec, cache_spec, *(branch_spec for _ in branches),
        ],
        out_specs=[*part_specs, branch_spec, branch_spec],
        out_shape=[*part_shapes, jax.ShapeDtypeStruct(branch_k.shape, dt),
                   jax.ShapeDtypeStruct(branch_v.shape, dt)],
        input_output_aliases={} if first else {6: 2, 7: 3},
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="ssd_tree_attention",
    )(rows, row_info, rows, rows, k_cache, v_cache, *branches)
    return merge_splits(o_split, lse_split, MQ, H, q.dtype, interpret=interpret), branch_k, branch_v


def _is_first(step) -> bool:
    """Whether `step` is the first step, known while tracing: the Python int 0."""
    return isinstance(step, int) and not isinstance(step, bool) and step == 0


def write_branch(branch_k, branch_v, k_new, v_new, step):
    """The new rows [B, MQ, KVH, D] at entry `step` of the branch buffers [B, MQ, Kb, KVH, D]:
    the reference of the kernel's write. At the first step (`step` the Python int 0) the buffers
    are made from the new rows, zeros after entry 0, whatever branch_k / branch_v held: each
    layer's own buffer, where a shared zero buffer would be copied once a layer and buffer."""
    if _is_first(step):
        Kb = branch_k.shape[2]
        start = lambda buf, new: jnp.pad(  # noqa: E731
            new[:, :, None].astype(buf.dtype), ((0, 0), (0, 0), (0, Kb - 1), (0, 0), (0, 0)))
        return start(branch_k, k_new), start(branch_v, v_new)
    put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
        buf, new[:, :, None].astype(buf.dtype), step, axis=2)
    return put(branch_k, k_new), put(branch_v, v_new)


def prefix_bytes(batch: int, live_prefix: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """HBM bytes the kernel must read for the prefix: K and V of the live prefix, once."""
    return 2 * batch * live_prefix * kv_heads * head_dim * itemsize


__all__ = ["tree_attention", "tree_attention_reference", "tree_attention_xla",
           "default_num_splits", "default_tiling", "prefix_bytes", "write_branch"]
