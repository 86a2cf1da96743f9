"""The fixtures ssd_jax ships for users' own exactness tests catch what they should."""
import numpy as np
import pytest

from ssd_jax.testing import window_counts


def test_window_distribution_fixture_accepts_exact_and_rejects_biased(assert_window_distribution):
    rng = np.random.default_rng(0)
    exact = rng.dirichlet(np.ones(16))  # window of 2 tokens over vocabulary 4
    cells = rng.choice(16, size=50_000, p=exact)
    tokens = np.stack([cells // 4, cells % 4], 1)
    assert window_counts(tokens, 4).sum() == 50_000
    assert assert_window_distribution(tokens, exact, 4).passed
    biased = exact.copy()
    biased[0] += 0.05
    biased /= biased.sum()
    bad = rng.choice(16, size=50_000, p=biased)
    with pytest.raises(AssertionError, match="differs from the target"):
        assert_window_distribution(np.stack([bad // 4, bad % 4], 1), exact, 4)


def test_greedy_fixture_is_the_near_tie_check(assert_greedy_agreement):
    from ssd_jax.algorithm import near_tie
    assert assert_greedy_agreement is near_tie.assert_greedy_agreement
