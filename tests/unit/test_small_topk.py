"""small_topk equals lax.top_k exactly: repeated values, -inf entries, k up to and past SMALL_K;
its argmax equals jnp.argmax, NaN and signed zeros included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm.small_topk import SMALL_K, argmax, kth_largest, kth_largest_per_row, top_k_indices


def rows(seed, shape=(3, 5, 40)):
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 4, shape).astype(np.float32)  # many ties
    x[rng.random(shape) < 0.2] = -np.inf
    x[0, 0, :] = -np.inf  # a row with no finite entry
    x[0, 1, 3:] = -np.inf  # a row with fewer finite entries than k
    return jnp.asarray(x)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, SMALL_K, SMALL_K + 3])
def test_matches_lax_top_k(k):
    for seed in range(3):
        x = rows(seed)
        vals, idx = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(kth_largest(x, k), vals[..., -1:])
        np.testing.assert_array_equal(top_k_indices(x, k), idx)
        got = jax.jit(top_k_indices, static_argnums=1)(x, k)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, idx)


def test_indices_are_distinct_when_the_row_runs_out_of_finite_entries():
    x = jnp.asarray([[1.0, -np.inf, 2.0, -np.inf, -np.inf]])
    assert top_k_indices(x, 5).tolist() == [[2, 0, 1, 3, 4]]


def test_bad_k():
    x = jnp.zeros((2, 4))
    for k in (0, 5):
        with pytest.raises(ValueError, match="k must be in"):
            kth_largest(x, k)
        with pytest.raises(ValueError, match="k must be in"):
            top_k_indices(x, k)


@pytest.mark.parametrize("V", [1, 5, 127, 128, 129, 300, 1000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_equals_jnp_argmax(V, dtype):
    """Ties, +-inf, -0.0 beside 0.0, NaN (first NaN wins, even over +inf), a block's padding."""
    rng = np.random.default_rng(V)
    x = rng.integers(-3, 3, (4, 3, V)).astype(np.float32)  # many ties
    x[0, 0] = -np.inf
    x[0, 1, ::2] = np.inf
    x[1, 0, V // 2:] = np.nan
    x[1, 1, -1] = np.nan
    x[1, 2, 0] = -np.nan
    x[2, 0] = 0.0
    x[2, 0, : V // 2] = -0.0
    x[2, 1] = -np.inf
    x[2, 1, -1] = -3.0  # the maximum in the padded last block
    x = jnp.asarray(x, dtype)
    want = jnp.argmax(x, axis=-1)
    for got in (argmax(x), jax.jit(argmax)(x)):
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)


def test_argmax_of_a_short_row_pads_nothing():
    """A row shorter than a block is one block of its own length: padding V = 4 up to 128 made
    every argmax (greedy, the exponential race, the fork) 32x the work on the engine's tests."""
    for V in (4, 100):
        jaxpr = str(jax.make_jaxpr(argmax)(jnp.zeros((8, V))))
        assert "concatenate" not in jaxpr and "pad" not in jaxpr, jaxpr
    assert "concatenate" in str(jax.make_jaxpr(argmax)(jnp.zeros((8, 129))))  # the padded case


def test_argmax_of_int_and_bool_rows():
    rng = np.random.default_rng(0)
    for x in (rng.integers(-5, 5, (3, 300)).astype(np.int32), rng.random((3, 300)) < 0.05,
              np.zeros((2, 130), bool)):
        np.testing.assert_array_equal(argmax(jnp.asarray(x)), jnp.argmax(jnp.asarray(x), axis=-1))


def test_argmax_rejects_an_empty_row():
    with pytest.raises(ValueError, match="non-empty last axis"):
        argmax(jnp.zeros((2, 0)))
    with pytest.raises(ValueError, match="non-empty last axis"):
        argmax(jnp.float32(1.0))


def _want_kth(x, k):
    """Per-row k-th largest by lax.top_k over the whole row (k 0 -> -inf)."""
    vals = jax.lax.top_k(x, x.shape[-1])[0]
    got = jnp.take_along_axis(vals, jnp.maximum(k, 1) - 1, axis=-1)
    return jnp.where(k > 0, got, -jnp.inf)


@pytest.mark.parametrize("kmax", [0, 1, 2, 3, 5, 8, 9, SMALL_K, SMALL_K + 1, 40])
def test_kth_largest_per_row_matches_top_k(kmax):
    """Per-row k (0 = no threshold), traced (one compile for all k) and host values, through the
    max passes (<= SMALL_K) and the counting bisection (above); ties, -inf, -0.0, huge values."""
    f = jax.jit(kth_largest_per_row)
    for seed in range(3):
        x = np.asarray(rows(seed)).copy()
        x[1, 2, :5] = -0.0
        x[2, 3, :3] = [3e38, -3e38, 1e-45]
        x = jnp.asarray(x)
        k = jnp.asarray(np.random.default_rng(seed).integers(0, kmax + 1, x.shape[:-1] + (1,)),
                        jnp.int32)
        want = _want_kth(x, k)
        np.testing.assert_array_equal(f(x, k), want)
        np.testing.assert_array_equal(kth_largest_per_row(x, np.asarray(k)), want)
    assert f._cache_size() == 1


@pytest.mark.parametrize("V,branches", [(1, []), (3, [3]), (4, [3]), (5, [4]), (8, [4]), (9, [5]),
                                         (SMALL_K, [5]), (SMALL_K + 1, [6])])
def test_a_short_row_compiles_only_the_passes_it_can_need(V, branches):
    """A traced k is at most V, so a row of V entries needs no more than V passes: the switch
    holds the pass counts below V, the first that reaches V, and the bisection only past SMALL_K
    (a tiny vocabulary compiles half of them; one branch is no switch at all); every k in 0..V
    is still exact."""
    x = rows(11, (V + 1, 2, V))
    k = jnp.asarray(np.arange(V + 1)[:, None, None] * np.ones((1, 2, 1), int), jnp.int32)
    jaxpr = jax.make_jaxpr(kth_largest_per_row)(x, k)
    switches = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert [len(e.params["branches"]) for e in switches] == branches
    np.testing.assert_array_equal(jax.jit(kth_largest_per_row)(x, k), _want_kth(x, k))


def test_bisection_equals_passes_for_every_k():
    from ssd_jax.algorithm.small_topk import _kth_by_bisection, _kth_by_passes

    x = rows(7, (4, 3, 40))
    for k in range(0, 41):
        kk = jnp.full(x.shape[:-1] + (1,), k, jnp.int32)
        want = _want_kth(x, kk)
        np.testing.assert_array_equal(_kth_by_bisection(x, kk), want)
        if k <= SMALL_K:
            np.testing.assert_array_equal(_kth_by_passes(x, kk, SMALL_K), want)  # extra passes: no-ops
            np.testing.assert_array_equal(_kth_by_passes(x, kk, k), want)
