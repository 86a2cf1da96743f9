"""ssd_jax.algorithm.verify.rejection_sample: hand-made cases, edges, jit with per-row accept counts, and a
single-round statistical check (the multi-round check is tests/statistical/test_exactness_harness.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ssd_jax.algorithm.sampling import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, position_keys,
                              sample_from_probs)
from ssd_jax.algorithm.verify import VerifyResult, rejection_sample

verify = jax.jit(rejection_sample)


def keys_for(B, K, seed=0, first_rid=0):
    rid = jnp.arange(first_rid, first_rid + B, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(K + 1, dtype=jnp.int32), (B, K + 1))
    return (position_keys(seed, rid, pos[:, :K], STREAM_ACCEPT),
            position_keys(seed, rid, pos, STREAM_RESIDUAL))


def one_hot(idx, V):
    return np.eye(V, dtype=np.float32)[np.asarray(idx)]


def run(p, q, s, B_rep=1, seed=0):
    """Verify the same (p, q', s) for B_rep independent requests."""
    p, q, s = (np.broadcast_to(np.asarray(x), (B_rep,) + np.asarray(x).shape[1:]) for x in (p, q, s))
    ak, rk = keys_for(B_rep, s.shape[1], seed)
    res = verify(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), jnp.asarray(s, jnp.int32), ak, rk)
    return jax.tree_util.tree_map(np.asarray, res)


def test_result_is_pytree():
    res = run(one_hot([[1, 2, 3]], 4), one_hot([[1, 2]], 4), [[1, 2]])
    assert isinstance(res, VerifyResult)
    assert len(jax.tree_util.tree_leaves(res)) == 3
    assert res.num_accepted.dtype == res.bonus.dtype == res.tokens.dtype == np.int32


def test_all_accept():
    # p(s) >= q'(s) at every position: always accepted; the bonus comes from p_{K+1} (one-hot at 3).
    p = np.array([[[0.1, 0.6, 0.3, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]]], np.float32)
    q = np.array([[[0.4, 0.2, 0.4, 0.0], [0.2, 0.2, 0.6, 0.0]]], np.float32)
    res = run(p, q, [[1, 1]], B_rep=500)
    assert np.all(res.num_accepted == 2) and np.all(res.bonus == 3)
    np.testing.assert_array_equal(res.tokens, np.broadcast_to([1, 1, 3], (500, 3)))


def test_reject_at_zero():
    # p_1(s_1) = 0: certain rejection; residual max(0, p_1 - q'_1) is one-hot at 2.
    p = np.array([[[0.0, 0.5, 0.5, 0.0], [0.25] * 4, [0.25] * 4]], np.float32)
    q = np.array([[[0.5, 0.5, 0.0, 0.0], [0.25] * 4]], np.float32)
    res = run(p, q, [[0, 1]], B_rep=500)
    assert np.all(res.num_accepted == 0) and np.all(res.bonus == 2)
    np.testing.assert_array_equal(res.tokens, np.broadcast_to([2, -1, -1], (500, 3)))


def test_one_hot_proposal_accepts_with_p_and_residual_excludes_s():
    p1 = np.array([0.3, 0.4, 0.2, 0.1], np.float32)
    p = np.stack([p1, p1])[None]
    q = one_hot([[1]], 4)
    n = 40_000
    res = run(p, q, [[1]], B_rep=n)
    acc = res.num_accepted == 1
    assert abs(acc.mean() - 0.4) < 4 * np.sqrt(0.24 / n)
    # rejected: bonus ~ p without s = [0.3, 0, 0.2, 0.1] / 0.6
    rej_bonus = res.bonus[~acc]
    counts = np.bincount(rej_bonus, minlength=4)
    assert counts[1] == 0
    want = np.array([0.3, 0.2, 0.1]) / 0.6 * len(rej_bonus)
    assert stats.chisquare(counts[[0, 2, 3]], want).pvalue > 1e-3
    # overall the first emitted token is distributed as p1
    assert stats.chisquare(np.bincount(res.tokens[:, 0], minlength=4), [0.3 * n, 0.4 * n, 0.2 * n, 0.1 * n]).pvalue > 1e-3


def test_zero_residual_falls_back_to_p_not_token_0():
    # q' >= p everywhere (q' == p up to "rounding", here exaggerated): rejections happen with
    # probability 1 - 0.5/0.6 but the residual is all zero; the bonus must come from p, never token 0.
    p = np.array([[[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0]]], np.float32)
    q = np.array([[[0.0, 0.6, 0.5, 0.0]]], np.float32)
    res = run(p, q, [[1]], B_rep=5000)
    rejected = res.num_accepted == 0
    assert 500 < rejected.sum() < 1200  # ~1/6
    assert set(np.unique(res.bonus[rejected])) == {1, 2}


def test_q_prime_underflow_no_nan():
    # s was drafted although q'(s) == 0 (underflow / upstream bug): accept iff p(s) > 0.
    p = np.array([[[0.0, 0.7, 0.3, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25] * 4]], np.float32)
    q = np.array([[[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]], np.float32)
    res = run(p, q, [[1, 0]], B_rep=1000)  # s_1 = 1: q' 0, p 0.7 -> accept; s_2 = 0: q' 0, p 0.1 -> accept
    assert np.all(res.num_accepted == 2)
    p[0, 0] = [0.0, 0.0, 1.0, 0.0]  # now p(s_1) = 0 too: reject; residual max(0, p - q') is all zero
    res = run(p, q, [[1, 0]], B_rep=1000)
    assert np.all(res.num_accepted == 0) and np.all(res.bonus == 2)
    for x in jax.tree_util.tree_leaves(res):
        assert np.all(x >= -1)


def test_padded_vocab_never_emitted():
    # V = 6 embedding rows, 4 real: rows 4-5 are zero in p and q'.
    rng = np.random.default_rng(0)
    B, K = 2000, 3
    p = np.zeros((B, K + 1, 6), np.float32)
    q = np.zeros((B, K, 6), np.float32)
    p[..., :4] = rng.dirichlet(np.ones(4), size=(B, K + 1))
    q[..., :4] = rng.dirichlet(np.ones(4), size=(B, K))
    s = np.asarray(sample_from_probs(jnp.asarray(q), position_keys(
        0, jnp.arange(B, dtype=jnp.int32), jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)), STREAM_DRAFT)))
    ak, rk = keys_for(B, K, seed=1)
    res = verify(jnp.asarray(p), jnp.asarray(q), jnp.asarray(s), ak, rk)
    tokens = np.asarray(res.tokens)
    assert tokens.max() < 4 and np.all(np.asarray(res.bonus) < 4)
    assert len(np.unique(np.asarray(res.num_accepted))) == K + 1  # every accept count occurs


def test_temperature_zero_is_argmax_matching():
    # one-hot p (temperature 0): accept exactly while s_i == argmax p_i, bonus = argmax at the stop.
    rng = np.random.default_rng(1)
    B, K, V = 300, 4, 5
    am = rng.integers(0, V, size=(B, K + 1))
    p = one_hot(am, V)
    q = rng.dirichlet(np.ones(V), size=(B, K)).astype(np.float32)
    # drafts agree with the argmax for a random-length prefix, then differ
    s = am[:, :K].copy()
    stop = rng.integers(0, K + 1, size=B)
    for b in range(B):
        if stop[b] < K:
            s[b, stop[b]] = (am[b, stop[b]] + 1) % V
    ak, rk = keys_for(B, K, seed=2)
    res = jax.tree_util.tree_map(np.asarray, verify(jnp.asarray(p), jnp.asarray(q), jnp.asarray(s, jnp.int32), ak, rk))
    np.testing.assert_array_equal(res.num_accepted, stop)
    np.testing.assert_array_equal(res.bonus, am[np.arange(B), stop])


def test_jit_per_row_accept_counts():
    V, K = 4, 3
    am = np.array([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [3, 3, 3, 3]])
    s = np.array([[0, 1, 2], [0, 1, 0], [1, 1, 2], [3, 3, 0]], np.int32)
    p = one_hot(am, V)
    q = np.full((4, K, V), 0.25, np.float32)
    ak, rk = keys_for(4, K, seed=3)
    res = jax.tree_util.tree_map(np.asarray, verify(jnp.asarray(p), jnp.asarray(q), jnp.asarray(s), ak, rk))
    np.testing.assert_array_equal(res.num_accepted, [3, 2, 0, 2])
    np.testing.assert_array_equal(res.bonus, [3, 2, 0, 3])
    np.testing.assert_array_equal(res.tokens, [[0, 1, 2, 3], [0, 1, 2, -1], [0, -1, -1, -1], [3, 3, 3, -1]])


def test_bad_shapes_raise():
    ak, rk = keys_for(2, 2)
    with pytest.raises(ValueError):
        rejection_sample(jnp.ones((2, 2, 4)), jnp.ones((2, 2, 4)), jnp.zeros((2, 2), jnp.int32), ak, rk)
    with pytest.raises(ValueError):
        rejection_sample(jnp.ones((2, 3, 4)), jnp.ones((2, 2, 4)), jnp.zeros((2, 2), jnp.int32), ak, rk[:, :2])


def test_single_round_is_exact():
    """Context-free rows: the i-th emitted token (given it exists) must be distributed as p_i."""
    rng = np.random.default_rng(4)
    K, V, B = 3, 5, 100_000
    p_rows = rng.dirichlet(np.ones(V), size=K + 1).astype(np.float32)
    q_rows = rng.dirichlet(np.ones(V), size=K).astype(np.float32)
    p = jnp.broadcast_to(jnp.asarray(p_rows), (B, K + 1, V))
    q = jnp.broadcast_to(jnp.asarray(q_rows), (B, K, V))
    rid = jnp.arange(B, dtype=jnp.int32)
    s = sample_from_probs(q, position_keys(0, rid, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)), STREAM_DRAFT))
    ak, rk = keys_for(B, K, seed=0)
    res = jax.tree_util.tree_map(np.asarray, verify(p, q, s, ak, rk))
    for i in range(K + 1):
        emitted = res.tokens[res.num_accepted >= i, i]
        counts = np.bincount(emitted, minlength=V)
        want = p_rows[i].astype(np.float64)
        pval = stats.chisquare(counts, want / want.sum() * len(emitted)).pvalue
        assert pval > 1e-4, (i, counts, pval)
