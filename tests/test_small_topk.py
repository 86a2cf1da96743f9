"""small_topk equals lax.top_k exactly: repeated values, -inf entries, k up to and past SMALL_K."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.small_topk import SMALL_K, kth_largest, top_k_indices


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
