"""pytest fixtures for researchers' own exactness tests (auto-loaded once ssd_jax is installed).

    def test_my_proposal_rule_is_exact(assert_window_distribution):
        tokens = my_sampler(...)                   # [N, window] generated windows
        exact = enumerate_window_distribution(...)  # from ssd_jax.testing
        assert_window_distribution(tokens, exact, vocab_size)

    def test_my_draft_is_greedy_exact(assert_greedy_agreement):
        assert_greedy_agreement(params, cfg, prompt, speculative_ids, plain_ids)
"""
from __future__ import annotations

import pytest

from ssd_jax.algorithm.near_tie import assert_greedy_agreement as _greedy
from ssd_jax.testing import distribution_test, window_counts


@pytest.fixture
def assert_window_distribution():
    """(tokens [N, window], exact_probs [V**window], vocab_size, false_alarm=1e-3) -> result;
    fails the test with the statistic, threshold and empirical TV when the check rejects."""
    def check(tokens, exact_probs, vocab_size: int, false_alarm: float = 1e-3):
        res = distribution_test(window_counts(tokens, vocab_size), exact_probs, false_alarm)
        assert res.passed, f"output distribution differs from the target's: {res}"
        return res
    return check


@pytest.fixture
def assert_greedy_agreement():
    """(params, cfg, prompt, got_ids, plain_greedy_ids, rel_tol=1e-5): identical, or a reported
    near-tie at the first divergence (ALGORITHM.md §3); anything else fails."""
    return _greedy
