"""Exactness harness: is a decoding procedure's output distributed exactly as the target's?

Point it at any target / draft / proposal rule:
  1. `enumerate_window_distribution(logits_fn, prompt, window, params, vocab_size)` — the exact
     distribution of the next `window` tokens under plain sampling from the target (tiny vocab).
  2. Run your decoder on N independent requests (distinct request ids, position-indexed keys) and
     collect the first `window` generated tokens of each: `window_counts(tokens, vocab_size)`.
  3. `distribution_test(counts, exact)` — passes iff the counts are consistent with `exact` at the
     stated false-alarm rate; `detection_power(exact, n)` says how large a deviation it would catch.
The planted-bug verifiers (planted.py) are what a broken implementation looks like; a harness that
cannot tell them from `rejection_sample` is too weak to trust.

Statistic: Pearson chi-square over cells pooled so that every pooled cell has expected count >= 5
(the smallest cells are merged together, in order of probability), plus a hard check that no sample
falls in a cell of exact probability 0 (top-k / top-p / temperature 0 make many such cells; one sample
there is a certain failure). The rejection threshold is the (1 - false_alarm) quantile of the same
statistic over Monte-Carlo multinomial draws from the exact distribution (fixed numpy seed), so the
false-alarm rate is the one asked for, not an asymptotic approximation. Chi-square is used rather than
total variation because with ~256 cells and n = 1e5 the null TV is itself ~0.02: a TV test cannot see
a 0.02 deviation, while chi-square (non-centrality ~ n * sum(delta^2 / p) >= ~160 for any TV-0.02
shift) does.

Chosen sizes (the suite's synthetic SD, tests/test_exactness_harness.py): vocabulary 4 (+1 padded
row), K = 2, window 4 (= K + 2, so every sample crosses at least one round boundary), 256 cells,
n = 100_000. That test requires power >= 0.95 against total-variation-0.02 alternatives
(`detection_power`) and checks the calibrated false-alarm rate; a longer window spreads the same n
over V times more cells, which dilutes the chi-square and lowers the power.

Layout: windows.py (the exact window distribution, window counts), stats.py (the test, its
calibration and power), planted.py (the planted bugs); everything public is re-exported here.
"""
from __future__ import annotations

from ssd_jax.testing.planted import (
    ALL_PLANTED_BUGS,
    PLANTED_BUG_VERIFIERS,
    PLANTED_PROPOSER_BUGS,
    correct_proposal_rows,
    wrong_proposal_rows,
)
from ssd_jax.testing.stats import (
    DistributionTestResult,
    detection_power,
    detection_power_by_alternative,
    distribution_test,
)
from ssd_jax.testing.windows import enumerate_window_distribution, window_counts

__all__ = [
    "enumerate_window_distribution",
    "window_counts",
    "DistributionTestResult",
    "distribution_test",
    "detection_power",
    "detection_power_by_alternative",
    "PLANTED_BUG_VERIFIERS",
    "PLANTED_PROPOSER_BUGS",
    "ALL_PLANTED_BUGS",
    "correct_proposal_rows",
    "wrong_proposal_rows",
]
