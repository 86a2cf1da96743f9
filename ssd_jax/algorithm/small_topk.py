"""Exact `lax.top_k` results for a small k, by k passes of max / argmax over the row, and a fast
exact `argmax` (k = 1).

XLA:CPU lowers `lax.top_k` over a vocabulary row to a full sort, which costs far more than the
few max passes over the row that a small k needs. The fork (candidate bonus tokens), Saguaro's
top-n scaling and top-k sampling need only k <= a few, so they use these; above `SMALL_K` they fall
back to `lax.top_k`, and both paths give identical results.

`jnp.argmax` itself lowers to a (value, index) pair reduction that XLA:CPU does not vectorise;
`argmax` here uses plain max reductions, which it does (see benchmarks/README.md at 8faea7c). Greedy decoding,
the exponential race and the proposal draw take one per row per step, several times a speculative
round.

`kth_largest_per_row` takes k as an array, one per row and possibly traced (top-k sampling with
the user's k as a value, so a new k compiles nothing): max passes up to `SMALL_K`, and above it a
32-pass counting bisection, which is exact and 10-30x cheaper than XLA:CPU's sort.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SMALL_K = 16  # above this k, `kth_largest` and `top_k_indices` use `lax.top_k` itself


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """x `[..., V]` -> `[..., 1]`: the k-th largest entry counting repeats, i.e.
    `lax.top_k(x, k)[0][..., -1:]`. k (a Python int, static) must be in 1..V."""
    k = int(k)
    if k < 1 or k > x.shape[-1]:
        raise ValueError(f"k must be in [1, {x.shape[-1]}], got {k}")
    if k > SMALL_K:
        return jax.lax.top_k(x, k)[0][..., -1:]
    return _kth_by_passes(x, jnp.full(x.shape[:-1] + (1,), k, jnp.int32), k)


def _pass(x, remaining, kth):
    """One max pass: the row max becomes the k-th largest while `remaining` > 0, then every entry
    equal to it is removed (so repeats count once each)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    kth = jnp.where(remaining > 0, m, kth)
    hit = x == m
    remaining = remaining - jnp.sum(hit, axis=-1, keepdims=True, dtype=jnp.int32)
    return jnp.where(hit, -jnp.inf, x), remaining, kth


def _kth_by_passes(x, k, passes: int):
    """`passes` (a Python int) unrolled max passes -> the k-th largest `[..., 1]` of each row for
    k `[..., 1]` <= passes; -inf where k is 0."""
    carry = (x, k, jnp.full(x.shape[:-1] + (1,), -jnp.inf, x.dtype))
    for _ in range(int(passes)):
        carry = _pass(*carry)
    return carry[2]


def _kth_by_bisection(x, k):
    """The k-th largest `[..., 1]` of each row for any k `[..., 1]` in 1..V (-inf where k is 0), in
    32 counting passes: the largest order key t with at least k entries >= t, built bit by bit.
    Exact (it counts, it does not add), and far cheaper than the sort `lax.top_k` is on XLA:CPU."""
    flip = jnp.uint32(0x80000000)
    key = jax.lax.bitcast_convert_type(_order_key(x), jnp.uint32) ^ flip  # unsigned, same order

    def step(i, lo):  # bits 31 .. 0 (a loop, not unrolled: 32 copies would slow every compile)
        cand = lo | jax.lax.shift_left(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        count = jnp.sum(key >= cand, axis=-1, keepdims=True, dtype=jnp.int32)
        return jnp.where(count >= k, cand, lo)

    lo = jax.lax.fori_loop(0, 32, step, jnp.zeros(k.shape, jnp.uint32))
    i = jax.lax.bitcast_convert_type(lo ^ flip, jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)  # _order_key is its own inverse
    kth = jax.lax.bitcast_convert_type(i, jnp.float32).astype(x.dtype)
    return jnp.where(k > 0, kth, -jnp.inf)


_PASS_BUCKETS = (1, 2, 4, 8, SMALL_K)  # unrolled pass counts a traced k chooses among


def _pass_buckets(V: int) -> tuple[int, ...]:
    """The pass counts a traced k <= V can need: the buckets below V and the first that reaches
    it (no k needs more than V passes), so a small vocabulary compiles fewer branches."""
    below = tuple(b for b in _PASS_BUCKETS if b < V)
    reach = [b for b in _PASS_BUCKETS if b >= V][:1]
    return below + tuple(reach)


def kth_largest_per_row(x: jax.Array, k) -> jax.Array:
    """x `[..., V]`, k `[..., 1]` (or broadcastable; int, one per row, may be traced) -> `[..., 1]`:
    each row's k-th largest entry counting repeats (`kth_largest` with that row's k), or -inf
    where k is 0 (so `x >= kth` keeps the whole row). Every k must be in 0..V.

    Traced k compiles once for every value: a `lax.switch` on max(k) runs the smallest of
    1, 2, 4, 8, `SMALL_K` unrolled max passes that covers it (passes past a row's k change
    nothing), and above `SMALL_K` 32 counting passes (`_kth_by_bisection`); a row of V entries
    compiles only the branches a k <= V can reach (`_pass_buckets`). (A loop of max(k)
    passes would be shorter to compile, but XLA:CPU runs it 2-3x slower than unrolled passes at a
    few rows, and on a GPU a loop of unknown length reads its counter back every step.) A host
    (numpy) k decides in Python and gives the same numbers.
    """
    shape = x.shape[:-1] + (1,)
    if isinstance(k, (int, np.integer, np.ndarray)):
        k = np.broadcast_to(np.asarray(k, np.int32), shape)
        kmax = int(k.max(initial=0))
        if kmax <= SMALL_K:
            return _kth_by_passes(x, jnp.asarray(k), kmax)
        return _kth_by_bisection(x, jnp.asarray(k))
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), shape)
    kmax = jnp.max(k)
    buckets = _pass_buckets(x.shape[-1])
    which = sum((kmax > b).astype(jnp.int32) for b in buckets)  # 0 .. len(buckets)
    branches = [lambda x, n=n: _kth_by_passes(x, k, n) for n in buckets]
    if x.shape[-1] > buckets[-1]:  # only a row longer than the passes reach needs the bisection
        branches.append(lambda x: _kth_by_bisection(x, k))
    return jax.lax.switch(which, branches, x)  # (switch clamps: which <= len(branches) - 1)


_BLOCK = 128


def argmax(x: jax.Array) -> jax.Array:
    """x `[..., V]` (float, int or bool) -> int32 `[...]`: `jnp.argmax(x, axis=-1)` exactly: the first
    maximum, any NaN counting as the largest value (the first NaN wins), -0.0 equal to 0.0.

    Lowered for the CPU, `argmax_blocks` (plain max reductions XLA:CPU vectorises); elsewhere
    `jnp.argmax`, which XLA:GPU makes two kernels where the blocks' passes are seven
    (`ssd-jax inspect`). The choice is the lowering platform's (`lax.platform_dependent`).
    """
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"argmax needs a non-empty last axis, got shape {x.shape}")
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int32)
    return jax.lax.platform_dependent(
        x, cpu=argmax_blocks, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def argmax_blocks(x: jax.Array) -> jax.Array:
    """`argmax` for XLA:CPU, x `[..., V]` (float or int, V >= 1): the max of each block of 128
    entries, the first block holding the row max, then the first entry of that block equal to
    it. NaN is tracked apart (XLA:CPU's vectorised max does not reliably propagate it): a row with
    one looks for its first NaN instead."""
    V, lead = x.shape[-1], x.shape[:-1]
    # A row no longer than a block is one block of its own length: padding a short row up to
    # _BLOCK would multiply the work (32x at V = 4).
    blk = min(V, _BLOCK)
    nb = -(-V // blk)
    if nb * blk != V:  # pad past the row's end with entries that never beat a real one
        low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
        x = jnp.concatenate([x, jnp.full(lead + (nb * blk - V,), low, x.dtype)], axis=-1)
    blocks = x.reshape(lead + (nb, blk))
    if jnp.issubdtype(x.dtype, jnp.floating):
        nan = jnp.isnan(blocks)
        blocks = jnp.where(nan, jnp.inf, blocks)
        block_nan = jnp.max(nan.astype(jnp.int8), axis=-1)  # [..., nb]
        row_nan = jnp.max(block_nan, axis=-1, keepdims=True) > 0  # [..., 1]
    else:
        nan = block_nan = row_nan = None
    block_max = jnp.max(blocks, axis=-1)  # [..., nb]
    m = jnp.max(block_max, axis=-1, keepdims=True)  # [..., 1]
    hit = block_max == m
    if row_nan is not None:
        hit = jnp.where(row_nan, block_nan > 0, hit)
    first_block = jnp.min(jnp.where(hit, jnp.arange(nb, dtype=jnp.int32), nb), axis=-1)
    pick = first_block[..., None, None]
    hit = jnp.take_along_axis(blocks, pick, axis=-2)[..., 0, :] == m
    if row_nan is not None:
        hit = jnp.where(row_nan, jnp.take_along_axis(nan, pick, axis=-2)[..., 0, :], hit)
    within = jnp.min(jnp.where(hit, jnp.arange(blk, dtype=jnp.int32), blk), axis=-1)
    return first_block * blk + within


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (so -inf still ranks above a removed entry)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
    """x `[..., V]` -> int32 `[..., k]`: `lax.top_k(x, k)[1]` (descending; equal values by lower
    index first, since argmax returns the first maximum). k (a Python int, static) must be in 1..V.
    """
    k = int(k)
    V = x.shape[-1]
    if k < 1 or k > V:
        raise ValueError(f"k must be in [1, {V}], got {k}")
    if k > SMALL_K:
        return jax.lax.top_k(x, k)[1].astype(jnp.int32)
    key = _order_key(x)
    removed = jnp.iinfo(jnp.int32).min
    cols = jnp.arange(V, dtype=jnp.int32)
    out = []
    for _ in range(k):
        i = argmax(key)
        out.append(i)
        key = jnp.where(cols == i[..., None], removed, key)
    return jnp.stack(out, -1)
