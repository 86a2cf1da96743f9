"""small_topk equals lax.top_k exactly: repeated values, -inf entries, k up to and past SMALL_K;
its argmax equals jnp.argmax, NaN and signed zeros included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm.small_topk import SMALL_K, argmax, kth_largest, top_k_indices


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
