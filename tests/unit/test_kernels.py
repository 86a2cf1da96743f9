"""Pallas kernels (pallas_kernels/): semantics, kernel == reference in interpret mode, CUDA lowering.

Everything runs on the CPU. The kernels run in the Pallas interpreter (slow: small shapes here); the
engine's real shapes appear only in the cross-lowering tests, which build the Triton IR for CUDA
without a GPU, verify it and check the Triton rules (power-of-2 tensors, dots >= 16 x 16 x 16).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models.ops import xla_add_norm, xla_attend
from ssd_jax.pallas_kernels.add_norm import add_norm
from ssd_jax.pallas_kernels.add_norm import serves as norm_serves
from ssd_jax.pallas_kernels.cache_attention import cache_attention, serves
from ssd_jax.pallas_kernels.cache_gather import cache_gather, cache_gather_reference
from ssd_jax.pallas_kernels.tree_attention import (tree_attention, tree_attention_reference,
                                           tree_attention_xla)

try:  # private, used only to parse and verify the Triton module embedded in the custom call
    from jax._src.lib.mlir import ir as _mlir_ir
    from jax._src.pallas.triton import lowering as _triton_lowering

    _new_triton_ctx = _triton_lowering._new_ir_context
except (ImportError, AttributeError):  # pragma: no cover - other JAX versions: the check fails
    _new_triton_ctx = None


# ----------------------------------------------------------------------------------------------
# Problem builders
# ----------------------------------------------------------------------------------------------
def _tree_problem(rng, *, B, fanout, KVH, G, D, S, Kb, block_s, dtype=np.float32,
                  force_prefix=()):
    """A tree-decode step laid out as SSD builds it.

    fanout: F_j for j = 0..len-1 (zeros allowed); MQ = sum(F_j); branch (j, c) sees prefix n + j + 1.
    force_prefix: extra prefix lengths (0, block boundaries, S) written over the first branches.
    """
    MQ = int(sum(fanout))
    H = KVH * G
    branch_j = np.repeat(np.arange(len(fanout)), fanout)  # [MQ]
    n = rng.integers(0, max(1, S - len(fanout)), size=B)  # committed length per sequence
    prefix = np.minimum(n[:, None] + branch_j[None, :] + 1, S).astype(np.int32)
    forced = [p for p in force_prefix if p <= S]
    for i, p in enumerate(forced):
        prefix[i % B, i % MQ] = p
    valid = rng.random((B, MQ)) > 0.25  # fan-out padding
    if B > 1:
        valid[-1] = False  # a finished sequence
    valid[0, 0] = True
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    arrs = dict(q=f(B, MQ, H, D), k_cache=f(B, S, KVH, D), v_cache=f(B, S, KVH, D),
                prefix_len=prefix, branch_k=f(B, MQ, Kb, KVH, D), branch_v=f(B, MQ, Kb, KVH, D),
                branch_valid=valid)
    for name in ("q", "k_cache", "v_cache", "branch_k", "branch_v"):
        arrs[name] = jnp.asarray(arrs[name], dtype)
    return arrs


def _call(fn, a, step, **kw):
    """fn's attention output. The kernel also writes entry `step` of the branch buffers: it is
    given the rows already there (the write is checked on its own below)."""
    if fn is tree_attention:
        new = [a[name][:, :, step] for name in ("branch_k", "branch_v")]
        out, bk, bv = fn(a["q"], *new, a["k_cache"], a["v_cache"], a["prefix_len"], a["branch_k"],
                         a["branch_v"], jnp.int32(step), a["branch_valid"], **kw)
        return out
    return fn(a["q"], a["k_cache"], a["v_cache"], a["prefix_len"], a["branch_k"], a["branch_v"],
              jnp.int32(step), a["branch_valid"], **kw)


def _naive_tree_attention(a, step, scale=None):
    """Per-branch, per-head loop in float64 numpy: the semantics in ALGORITHM.md §2."""
    q = np.asarray(a["q"], np.float64)
    kc, vc = np.asarray(a["k_cache"], np.float64), np.asarray(a["v_cache"], np.float64)
    bk, bv = np.asarray(a["branch_k"], np.float64), np.asarray(a["branch_v"], np.float64)
    B, MQ, H, D = q.shape
    KVH = kc.shape[2]
    G = H // KVH
    scale = D ** -0.5 if scale is None else scale
    out = np.zeros((B, MQ, H, D))
    for b in range(B):
        for m in range(MQ):
            if not a["branch_valid"][b, m]:
                continue
            n = int(a["prefix_len"][b, m])
            for h in range(H):
                kvh = h // G
                keys = np.concatenate([kc[b, :n, kvh], bk[b, m, :step + 1, kvh]])
                vals = np.concatenate([vc[b, :n, kvh], bv[b, m, :step + 1, kvh]])
                s = keys @ q[b, m, h] * scale
                p = np.exp(s - s.max())
                out[b, m, h] = p @ vals / p.sum()
    return out


# ----------------------------------------------------------------------------------------------
# Tree attention: semantics
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("G", [1, 3])
def test_reference_matches_naive_loop(G):
    rng = np.random.default_rng(10 + G)
    a = _tree_problem(rng, B=3, fanout=[2, 0, 3, 1], KVH=2, G=G, D=16, S=20, Kb=4, block_s=16,
                      force_prefix=(0, 20))
    for step in range(4):
        ref = np.asarray(_call(tree_attention_reference, a, step))
        np.testing.assert_allclose(ref, _naive_tree_attention(a, step), atol=2e-6, rtol=0)
    scaled = np.asarray(_call(tree_attention_reference, a, 1, scale=0.3))
    np.testing.assert_allclose(scaled, _naive_tree_attention(a, 1, scale=0.3), atol=2e-6, rtol=0)


def test_xla_baseline_matches_reference():
    rng = np.random.default_rng(7)
    a = _tree_problem(rng, B=2, fanout=[3, 1, 0, 2], KVH=2, G=4, D=32, S=50, Kb=3, block_s=16,
                      force_prefix=(0, 16, 50))
    for step in range(3):
        np.testing.assert_allclose(np.asarray(_call(tree_attention_xla, a, step)),
                                   np.asarray(_call(tree_attention_reference, a, step)),
                                   atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# Tree attention: kernel (interpret mode) vs reference
# ----------------------------------------------------------------------------------------------
# (B, fanout, KVH, G, D, S, Kb, block_s, num_splits). S is never a multiple of block_s except
# where noted; fan-outs contain zeros; GQA 1, 2, 4, 8; head dims 64 and 128; one case with
# MQ x G = 24 x 4 = 96 rows (padded to 128) like the engine.
TREE_CASES = [
    (1, [2, 0, 1, 1], 1, 1, 64, 40, 3, 16, 1),
    (2, [3, 1, 0, 2], 2, 2, 64, 100, 4, 32, 2),
    (3, [1, 0, 0, 2, 1], 1, 4, 128, 72, 3, 32, 3),
    (4, [2, 2, 0, 1], 1, 8, 64, 48, 2, 16, 2),     # S = 3 blocks exactly
    (2, [6, 5, 4, 3, 3, 2, 1, 0], 1, 4, 64, 90, 7, 32, None),  # MQ 24 x G 4 -> 128 rows
    (1, [1, 0, 2], 2, 8, 128, 33, 2, 16, None),
]



def _random_tree_cases(n, seed=2024):
    """Seeded random shapes over the same ranges (deterministic, so failures reproduce)."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        block_s = int(rng.choice([16, 32]))
        fanout = [int(f) for f in rng.integers(0, 4, size=int(rng.integers(2, 6)))]
        fanout[int(rng.integers(len(fanout)))] = 0  # always a zero fan-out
        fanout[0] = max(fanout[0], 1)
        S = int(rng.integers(1, 5)) * block_s + int(rng.integers(1, block_s))
        cases.append((int(rng.integers(1, 5)), fanout, int(rng.choice([1, 2])),
                      int(rng.choice([1, 2, 4, 8])), int(rng.choice([64, 128])), S,
                      int(rng.integers(1, 5)), block_s, [None, 1, 2, 3][int(rng.integers(4))]))
    return cases


TREE_CASES += _random_tree_cases(6)


def _case_id(c):
    return f"B{c[0]}-MQ{sum(c[1])}-KVH{c[2]}-G{c[3]}-D{c[4]}-S{c[5]}-Kb{c[6]}-bs{c[7]}-ns{c[8]}"


@pytest.mark.parametrize("case", TREE_CASES, ids=_case_id)
def test_tree_kernel_matches_reference_fp32(case):
    B, fanout, KVH, G, D, S, Kb, block_s, splits = case
    rng = np.random.default_rng([B, S, D, G, Kb, block_s])
    bounds = (0, block_s, 2 * block_s, S, S - 1, 1)
    a = _tree_problem(rng, B=B, fanout=fanout, KVH=KVH, G=G, D=D, S=S, Kb=Kb, block_s=block_s,
                      force_prefix=bounds)
    for step in range(Kb):
        out = _call(tree_attention, a, step, block_s=block_s, num_splits=splits, interpret=True)
        ref = _call(tree_attention_reference, a, step)
        assert out.dtype == ref.dtype == jnp.float32 and out.shape == ref.shape
        assert not np.isnan(np.asarray(out)).any()
        err = float(jnp.max(jnp.abs(out - ref)))
        assert err <= 1e-5, f"step {step}: max |delta| {err}"
        invalid = ~np.asarray(a["branch_valid"])
        assert (np.asarray(out)[invalid] == 0).all()


def test_tree_kernel_bf16():
    rng = np.random.default_rng(3)
    a = _tree_problem(rng, B=2, fanout=[3, 0, 2, 1], KVH=2, G=4, D=64, S=70, Kb=3, block_s=32,
                      dtype=jnp.bfloat16, force_prefix=(0, 32, 70))
    for step in range(3):
        out = _call(tree_attention, a, step, block_s=32, num_splits=2, interpret=True)
        ref = _call(tree_attention_reference, a, step)
        assert out.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        # bf16 rounding of p (for p @ v), of the per-split output and of the result (|out| < 2,
        # one bf16 ulp there is 2^-7): a few ulps at most. Measured: 3.9e-3.
        assert err <= 1.6e-2, f"step {step}: max |delta| {err}"


def test_tree_kernel_masked_rows_are_exact_zeros_and_garbage_is_never_read():
    rng = np.random.default_rng(5)
    B, S, Kb, block_s = 2, 45, 3, 16
    a = _tree_problem(rng, B=B, fanout=[2, 1, 1], KVH=2, G=2, D=64, S=S, Kb=Kb, block_s=block_s)
    live = int(np.asarray(a["prefix_len"])[np.asarray(a["branch_valid"])].max())
    # Poison what must never be read: cache slots past every valid branch's prefix, own-path
    # entries past `step`, queries of invalid branches.
    step = 1
    poisoned = dict(a)
    for name in ("k_cache", "v_cache"):
        x = np.array(a[name])
        x[:, live:] = np.nan
        poisoned[name] = jnp.asarray(x)
    for name in ("branch_k", "branch_v"):
        x = np.array(a[name])
        x[:, :, step + 1:] = np.inf
        poisoned[name] = jnp.asarray(x)
    qn = np.array(a["q"])
    qn[~np.asarray(a["branch_valid"])] = np.nan
    poisoned["q"] = jnp.asarray(qn)
    out = _call(tree_attention, poisoned, step, block_s=block_s, interpret=True)
    ref = _call(tree_attention_reference, a, step)
    assert not np.isnan(np.asarray(out)).any()
    assert float(jnp.max(jnp.abs(out - ref))) <= 1e-5
    # Everything invalid: exact zeros, no NaN, also with an empty prefix everywhere.
    nothing = dict(a, branch_valid=np.zeros_like(a["branch_valid"]),
                   prefix_len=np.zeros_like(a["prefix_len"]))
    for fn, kw in ((tree_attention, dict(interpret=True, block_s=block_s)),
                   (tree_attention_reference, {})):
        z = np.asarray(_call(fn, nothing, 0, **kw))
        assert (z == 0).all() and not np.isnan(z).any()
    # Valid branches with an empty prefix attend to their own path only.
    own_only = dict(a, prefix_len=np.zeros_like(a["prefix_len"]))
    out = _call(tree_attention, own_only, 2, block_s=block_s, interpret=True)
    assert float(jnp.max(jnp.abs(out - _call(tree_attention_reference, own_only, 2)))) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tree_kernel_writes_the_new_rows_and_attends_to_them(dtype):
    """The op `ssd_jax.models.ops.xla_tree_attention` (write, then the reference) against the
    kernel: the buffers bit for bit (entry `step` of every branch, valid or not, the rest
    untouched) and the output, at every step, over a window short of the cache. The first step
    is the Python int 0, as a tree runs it: both make new buffers, the new rows at entry 0 and
    zeros after, from given ones that hold inf and NaN (never read)."""
    from ssd_jax.models.ops import xla_tree_attention

    rng = np.random.default_rng(21)
    a = _tree_problem(rng, B=2, fanout=[3, 1, 2], KVH=2, G=3, D=32, S=60, Kb=4, block_s=16,
                      dtype=dtype, force_prefix=(0, 33))
    bk, bv = jnp.full_like(a["branch_k"], jnp.inf), jnp.full_like(a["branch_v"], jnp.nan)
    tol = 2e-6 if dtype == jnp.float32 else 3e-2
    for step in range(4):
        kn, vn = (jnp.asarray(rng.standard_normal(bk.shape[:2] + bk.shape[3:]), dtype)
                  for _ in range(2))
        args = (a["q"], kn, vn, a["k_cache"], a["v_cache"], a["prefix_len"], bk, bv,
                0 if step == 0 else jnp.int32(step), a["branch_valid"])
        out, k2, v2 = tree_attention(*args, window=40, block_s=16, interpret=True)
        ref, rk, rv = xla_tree_attention(*args, window=40)
        np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(rk, np.float32))
        np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(rv, np.float32))
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   atol=tol, rtol=tol)
        if step == 0:
            for got, new in ((k2, kn), (v2, vn)):
                np.testing.assert_array_equal(np.asarray(got[:, :, 0]), np.asarray(new))
                assert not np.asarray(got[:, :, 1:], np.float32).any()
        bk, bv = k2, v2  # the next step sees this one's rows


# ----------------------------------------------------------------------------------------------
# Cache gather
# ----------------------------------------------------------------------------------------------
def _gather_problem(rng, *, B, fanout, K, V, dtype):
    MQ = int(sum(fanout))
    j = np.repeat(np.arange(len(fanout)), fanout)
    c = np.concatenate([rng.choice(V, size=f, replace=False) for f in fanout if f])
    keys = np.broadcast_to(np.stack([j, c], -1), (B, MQ, 2)).astype(np.int32).copy()
    for b in range(B):  # different trees per sequence
        keys[b, :, 1] = (keys[b, :, 1] + 7 * b) % V
    valid = rng.random((B, MQ)) > 0.2
    tokens = rng.integers(0, V, size=(B, MQ, K)).astype(np.int32)
    rows = jnp.asarray(rng.random((B, MQ, K, V)).astype(np.float32), dtype)
    return keys, valid, tokens, rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_kernel_matches_reference_exactly(dtype):
    rng = np.random.default_rng(11)
    B, K, V = 4, 7, 1000  # V not a multiple of the 256 block, not a power of 2
    keys, valid, tokens, rows = _gather_problem(rng, B=B, fanout=[6, 5, 4, 3, 3, 2, 1, 0], K=K,
                                                V=V, dtype=dtype)
    MQ = keys.shape[1]
    valid[:, 5] = True
    valid[2, 9] = False
    outcome = np.zeros((B, 2), np.int32)
    outcome[0] = keys[0, 5]          # hit
    outcome[1] = keys[1, MQ - 1]     # hit on the last branch
    valid[1, MQ - 1] = True
    outcome[2] = keys[2, 9]          # key exists but the branch is invalid: miss
    outcome[3] = (K + 5, 3)          # no such key: miss
    # A duplicate of a valid key on an invalid row must not be picked.
    keys[0, 0] = keys[0, 5]
    valid[0, 0] = False
    ref = cache_gather_reference(keys, valid, tokens, rows, outcome)
    out = cache_gather(keys, valid, tokens, rows, outcome, block_v=256, interpret=True)
    np.testing.assert_array_equal(np.asarray(ref[0]), [True, True, False, False])
    np.testing.assert_array_equal(np.asarray(ref[1]), [5, MQ - 1, -1, -1])
    for r, o, name in zip(ref, out, ("hit", "index", "next_tokens", "next_rows")):
        assert r.dtype == o.dtype and r.shape == o.shape, name
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r), err_msg=name)
    # Misses are zeros; hits are the stored rows bit for bit.
    assert (np.asarray(out[3][2:]) == 0).all() and (np.asarray(out[2][2:]) == 0).all()
    np.testing.assert_array_equal(np.asarray(out[3][0]), np.asarray(rows[0, 5]))


def test_gather_kernel_random():
    rng = np.random.default_rng(12)
    for B, fanout, K, V, bv in ((1, [1, 0, 2], 3, 100, 64), (3, [2, 0, 0, 3, 1], 2, 513, 128)):
        keys, valid, tokens, rows = _gather_problem(rng, B=B, fanout=fanout, K=K, V=V,
                                                    dtype=jnp.float32)
        pick = rng.integers(0, keys.shape[1], size=B)
        outcome = keys[np.arange(B), pick].copy()
        outcome[rng.random(B) < 0.3] = (-1, 0)
        ref = cache_gather_reference(keys, valid, tokens, rows, outcome)
        out = cache_gather(keys, valid, tokens, rows, outcome, block_v=bv, interpret=True)
        for r, o in zip(ref, out):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


# ----------------------------------------------------------------------------------------------
# Cache attention (the write and the attention of a few new tokens): kernel vs xla_attend
# ----------------------------------------------------------------------------------------------
def _attend_problem(rng, *, B, T, KVH, G, D, S, dtype, starts):
    """New tokens at starts[b] + t over a cache of random (stale past the start) KV."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    positions = jnp.asarray(np.asarray(starts)[:, None] + np.arange(T)[None], jnp.int32)
    return (f(B, T, KVH * G, D), f(B, T, KVH, D), f(B, T, KVH, D), positions, f(B, S, KVH, D),
            f(B, S, KVH, D))


# (B, T, KVH, G, D, S, window, starts): decode, a K+1 verify, G not a power of 2 (the merge's
# masked rows and heads), the draft's G = 7, a window short of S, a row at slot 0, rows whose new
# tokens run past the cache's end (dropped, never written elsewhere), T x G at MAX_ROWS.
ATTEND_CASES = [(2, 1, 2, 2, 16, 64, None, (0, 37)), (3, 5, 2, 6, 32, 50, None, (0, 13, 48)),
                (2, 3, 2, 5, 16, 40, 24, (21, 2)), (1, 1, 2, 7, 64, 96, 30, (29,)),
                (2, 4, 1, 3, 16, 33, None, (31, 16)), (1, 16, 1, 8, 16, 64, None, (40,))]


@pytest.mark.parametrize("case", ATTEND_CASES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cache_attention_kernel_matches_xla_attend(case, dtype):
    B, T, KVH, G, D, S, W, starts = case
    args = _attend_problem(np.random.default_rng(len(starts) * 7 + T), B=B, T=T, KVH=KVH, G=G,
                           D=D, S=S, dtype=dtype, starts=starts)
    assert serves(args[0], args[4])
    out, k, v = cache_attention(*args, window=W, block_s=16, interpret=True)
    ref_out, ref_k, ref_v = xla_attend(*args, window=W)
    # the caches: the very rows written, every other slot untouched (bit for bit)
    np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(ref_v, np.float32))
    # the output: the reference rounds normalised probabilities, the kernel unnormalised ones
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == jnp.float32 else dict(atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), **tol)


def test_cache_attention_never_reads_past_the_start_and_splits_agree():
    """Stale slots at and past each row's start hold NaN: the kernel reads only the prefix (and
    the new rows), with one split or many."""
    B, T, KVH, G, D, S = 2, 3, 2, 3, 16, 80
    q, kn, vn, pos, kc, vc = _attend_problem(np.random.default_rng(3), B=B, T=T, KVH=KVH, G=G,
                                             D=D, S=S, dtype=jnp.float32, starts=(45, 7))
    stale = jnp.arange(S)[None, :, None, None] >= pos[:, :1, None, None]
    kc, vc = jnp.where(stale, jnp.nan, kc), jnp.where(stale, jnp.nan, vc)
    ref = xla_attend(q, kn, vn, pos, jnp.nan_to_num(kc), jnp.nan_to_num(vc))[0]
    for splits in (1, 3, 8):
        out = cache_attention(q, kn, vn, pos, kc, vc, block_s=16, num_splits=splits,
                              interpret=True)[0]
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


def test_cache_attention_refuses_what_it_does_not_serve():
    q = jnp.zeros((1, 9, 16, 16))  # 9 tokens x 16 heads per kv head: past MAX_ROWS
    cache = jnp.zeros((1, 32, 1, 16))
    assert not serves(q, cache) and serves(q[:, :7], cache)  # 7 x 16 rows fit MAX_ROWS
    new = jnp.zeros((1, 9, 1, 16))
    with pytest.raises(ValueError, match="query rows"):
        cache_attention(q, new, new, jnp.zeros((1, 9), jnp.int32), cache, cache, interpret=True)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        cache_attention(q[:, :1], new, new, jnp.zeros((1, 1), jnp.int32), cache, cache,
                        interpret=True)
    with pytest.raises(ValueError, match="window 40"):
        cache_attention(q[:, :1], new[:, :1], new[:, :1], jnp.zeros((1, 1), jnp.int32), cache,
                        cache, window=40, interpret=True)


# ----------------------------------------------------------------------------------------------
# The residual add and RMSNorm of one row: kernel vs xla_add_norm
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("E", [1536, 896, 100, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_add_norm_kernel_matches_xla_add_norm(E, dtype):
    rng = np.random.default_rng(E)
    x, delta = (jnp.asarray(rng.standard_normal((1, 1, E)) * 3, dtype) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(E), dtype)
    y, h = add_norm(x, delta, w, eps=1e-6, interpret=True)
    ry, rh = xla_add_norm(x, delta, w, eps=1e-6)
    assert y.dtype == ry.dtype and h.dtype == rh.dtype and h.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ry, np.float32))
    # the sum of squares in another order: in bf16 the normed value and its product with w are
    # each rounded, so two bf16 ulps (2 x 2^-7 relative at most)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=1e-2, rtol=2 ** -6)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(rh, np.float32), **tol)


def test_add_norm_kernel_takes_one_row_only():
    x = jnp.zeros((2, 1, 64))
    assert not norm_serves(x) and norm_serves(x[:1])
    with pytest.raises(ValueError, match="one row"):
        add_norm(x, x, jnp.ones(64), eps=1e-6, interpret=True)


# ----------------------------------------------------------------------------------------------
# Cross-lowering to CUDA (Triton) on the CPU, at the engine's shapes
# ----------------------------------------------------------------------------------------------
def _custom_calls(op, acc):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    acc.append(inner)
                _custom_calls(inner.operation, acc)
    return acc


# The GPU the kernels are lowered for, without one: JAX 0.12's Triton lowering asks the device
# for its compute capability and, on a CPU, takes it from the abstract mesh's device instead.
H100 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


def _check_triton_lowering(fn, *args, ieee_dots=False, kernels=1):
    """Lower for CUDA (an H100); verify each of the `kernels` embedded Triton modules and check
    the Triton shape rules."""
    with jax.sharding.use_abstract_mesh(H100):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    calls = [c for c in _custom_calls(lowered.compiler_ir("stablehlo").operation, [])
             if "triton" in str(c.attributes["call_target_name"])]
    assert len(calls) == kernels, f"expected {kernels} Triton kernel(s), found {len(calls)}"
    assert _new_triton_ctx is not None, "this JAX has no Triton IR context to read the kernel with"
    texts = []
    for call in calls:
        config = call.attributes["mhlo.backend_config"] if (
            "mhlo.backend_config" in call.attributes) else None
        assert config is not None and "ir" in config, "the Triton custom call embeds no Triton IR"
        data = config["ir"].value_bytes
        with _new_triton_ctx():
            module = _mlir_ir.Module.parse(data)
            assert module.operation.verify()
            text = str(module)
        for dims in re.findall(r"tensor<((?:\d+x)+)", text):
            for d in dims.rstrip("x").split("x"):
                assert int(d) & (int(d) - 1) == 0, f"non power-of-2 tensor dim {d} in tensor<{dims}...>"
        dots = re.findall(r"tt\.dot .*?: tensor<(\d+)x(\d+)x\w+> \* tensor<(\d+)x(\d+)x", text)
        for dims in dots:
            assert min(map(int, dims)) >= 16, f"dot smaller than 16x16x16: {dims}"
        if ieee_dots:  # float32 inputs must not be rounded to TF32 (IEEE is Triton's unprinted default)
            dot_lines = [line for line in text.splitlines() if "tt.dot" in line]
            assert not any("tf32" in line for line in dot_lines)
        texts.append(text)
    assert not ieee_dots or any("tt.dot" in t for t in texts), "no dot in any kernel"
    return texts[0] if kernels == 1 else texts


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


# (B, MQ, H, KVH, D, S, Kb): Qwen2.5-0.5B draft (G = 7 -> 168 rows padded to 256), and a
# 32 / 8-head model at batch 16 (the benchmark shape).
ENGINE_TREE_SHAPES = [(1, 24, 14, 2, 64, 1024, 7), (2, 24, 14, 2, 64, 1024, 7),
                      (4, 24, 14, 2, 64, 1024, 7), (16, 24, 32, 8, 64, 2048, 7),
                      (3, 24, 32, 8, 128, 1000, 7)]


@pytest.mark.parametrize("shape", ENGINE_TREE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_tree_kernel_lowers_for_cuda(shape, dtype):
    B, MQ, H, KVH, D, S, Kb = shape
    args = (_sds((B, MQ, H, D), dtype), _sds((B, MQ, KVH, D), dtype), _sds((B, MQ, KVH, D), dtype),
            _sds((B, S, KVH, D), dtype), _sds((B, S, KVH, D), dtype),
            _sds((B, MQ), jnp.int32), _sds((B, MQ, Kb, KVH, D), dtype),
            _sds((B, MQ, Kb, KVH, D), dtype), _sds((), jnp.int32), _sds((B, MQ), jnp.bool_))
    # the attention and the merge of its splits
    _check_triton_lowering(tree_attention, *args, ieee_dots=dtype == jnp.float32, kernels=2)
    # a tree's first step (the Python int 0): the kernel makes the branch buffers itself
    first = lambda *a: tree_attention(*a[:8], 0, a[9])  # noqa: E731
    _check_triton_lowering(first, *args, ieee_dots=dtype == jnp.float32, kernels=2)


# (B, T, H, KVH, D, S): the default pair's target decode and K+1 verify (G = 6), its draft's
# step (G = 7), at batch 1 and 16.
ENGINE_ATTEND_SHAPES = [(1, 1, 12, 2, 128, 1024), (16, 1, 12, 2, 128, 1024), (1, 5, 12, 2, 128, 1024),
                        (16, 5, 12, 2, 128, 1024), (1, 1, 14, 2, 64, 1024), (16, 1, 14, 2, 64, 1024)]


@pytest.mark.parametrize("shape", ENGINE_ATTEND_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_cache_attention_lowers_for_cuda(shape, dtype):
    B, T, H, KVH, D, S = shape
    args = (_sds((B, T, H, D), dtype), _sds((B, T, KVH, D), dtype), _sds((B, T, KVH, D), dtype),
            _sds((B, T), jnp.int32), _sds((B, S, KVH, D), dtype), _sds((B, S, KVH, D), dtype))
    # the attention and the merge of its splits
    _check_triton_lowering(cache_attention, *args, ieee_dots=dtype == jnp.float32, kernels=2)


@pytest.mark.parametrize("E", [1536, 896])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_add_norm_kernel_lowers_for_cuda(E, dtype):
    args = (_sds((1, 1, E), dtype), _sds((1, 1, E), dtype), _sds((E,), dtype))
    _check_triton_lowering(lambda x, d, w: add_norm(x, d, w, eps=1e-6), *args)


@pytest.mark.parametrize("B", [1, 2, 4, 16])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_gather_kernel_lowers_for_cuda(B, dtype):
    MQ, K, V = 24, 7, 151936
    args = (_sds((B, MQ, 2), jnp.int32), _sds((B, MQ), jnp.bool_), _sds((B, MQ, K), jnp.int32),
            _sds((B, MQ, K, V), dtype), _sds((B, 2), jnp.int32))
    _check_triton_lowering(cache_gather, *args)


def test_bad_block_sizes_are_rejected():
    a = _tree_problem(np.random.default_rng(0), B=1, fanout=[1], KVH=1, G=1, D=64, S=16, Kb=2,
                      block_s=16)
    with pytest.raises(ValueError, match="power of 2"):
        _call(tree_attention, a, 0, block_s=48, interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        cache_gather(np.zeros((1, 2, 2), np.int32), np.ones((1, 2), bool),
                     np.zeros((1, 2, 1), np.int32), np.zeros((1, 2, 1, 40), np.float32),
                     np.zeros((1, 2), np.int32), block_v=24, interpret=True)


# ----------------------------------------------------------------------------------------------
# The GPU benchmark script runs end to end on the CPU (tiny shapes, interpret mode)
# ----------------------------------------------------------------------------------------------
def test_bench_script_smoke(tmp_path, capsys):
    import json

    from ssd_jax.pallas_kernels import bench_gpu

    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--smoke", "--no-sweep", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] and {r["name"] for r in res["results"]} >= {
        "tree: Pallas default", "gather: Pallas default", "tree: XLA reference (jnp, f32)"}
    assert "roofline" in capsys.readouterr().out


def test_bench_script_exits_nonzero_on_mismatch(monkeypatch):
    from ssd_jax.pallas_kernels import bench_gpu

    wrong = lambda *a, **kw: tree_attention_reference(*a) * 1.01  # noqa: E731
    monkeypatch.setattr(bench_gpu, "tree_attention", wrong)
    assert bench_gpu.main(["--smoke", "--check-only"]) == 1


def test_bench_loops_keep_every_unrolled_iteration():
    """The timed loop runs `unroll` bodies a trip; each must read the previous result, or XLA
    drops all but the last (their results are dead) and a call's time comes out `unroll` times
    too small, as it did on the first H200 run (a gather "faster" than HBM). Counted in the
    compiled program: 8 unrolled bodies hold 8 times one body's matmuls / row takes."""
    from ssd_jax.pallas_kernels import bench_gpu as bg
    from ssd_jax.pallas_kernels.tree_attention import tree_attention_xla

    cfg = bg.SMOKE
    t, g = bg.tree_inputs(cfg, jnp.float32), bg.gather_inputs(cfg, jnp.float32)
    init_g = cache_gather_reference(g["keys"], g["valid"], g["tokens"], g["rows"], g["keys"][:, 0])

    def count(body, init, data, pattern, unroll):
        hlo = bg.timed_loop(body, 16, unroll).lower(init, data).compile().as_text()
        return len(re.findall(pattern, hlo))

    tree = bg.tree_body(tree_attention_xla, cfg["K"])
    one = count(tree, jnp.zeros_like(t["q"]), t, r" dot\(", 1)
    assert one > 0 and count(tree, jnp.zeros_like(t["q"]), t, r" dot\(", 8) == 8 * one
    gather = bg.gather_body(cache_gather_reference)
    # each body takes one sequence's tokens and rows: two gathers a body that must survive
    assert count(gather, init_g, g, r" gather\(", 8) >= 8 * 2
