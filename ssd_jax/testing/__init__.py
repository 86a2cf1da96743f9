"""Exactness harness: is a decoding procedure's output distributed exactly as the target's?

Point it at any target / draft / proposal rule:
  1. `enumerate_window_distribution(logits_fn, prompt, window, params, vocab_size)` — the exact
     distribution of the next `window` tokens under plain sampling from the target (tiny vocab),
     read from full-length forwards of every window by `logits_fn` (a causal model's cache-free
     forward, `tokens [N, T] -> logits [N, T, V]`, called on one shape),
     each step's row from `reference_probs`: float64 numpy written from the sampling contract,
     sharing no code with the `probs_from_logits` the verifier uses (so a temperature / top-k /
     top-p bug cannot move the reference and the decoder together).
  2. Run your decoder on N independent requests (distinct request ids, position-indexed keys) and
     collect the first `window` generated tokens of each: `window_counts(tokens, vocab_size)`.
  3. `distribution_test(counts, exact)` — passes iff the counts are consistent with `exact` at the
     stated false-alarm rate; `detection_power(exact, n)` says how large a deviation it would catch.
The planted bugs (planted.py: verifiers, the proposer's q-not-q', and SSD bugs of the lookup and the
tree planted by `plant_ssd_bug`) are what a broken implementation looks like; a harness that cannot
tell them from the real thing is too weak to trust.

Statistic: Pearson chi-square over cells pooled so that every pooled cell has expected count
>= `min_expected` (default 5; the smallest cells are merged together, in order of probability),
plus, when that pools more coarsely, 1/4 of the chi-square over cells pooled only to expected
count 5 (so mass moved between cells of one pooled group is seen: stats.py), plus a hard check
that no sample falls in a cell of exact probability 0 (top-k / top-p / temperature 0 make many such cells; one sample
there is a certain failure). The rejection threshold is the (1 - false_alarm) quantile of the same
statistic over Monte-Carlo multinomial draws from the exact distribution (fixed numpy seed), so the
false-alarm rate is the one asked for, not an asymptotic approximation. Chi-square is used rather than
total variation because with ~256 cells and n = 1e5 the null TV is itself ~0.02: a TV test cannot see
a 0.02 deviation, while chi-square (non-centrality ~ n * sum(delta^2 / p) >= ~160 for any TV-0.02
shift) does.

Pooling is the caller's choice (`min_expected`); the threshold is calibrated for whatever pooling
is used, so any fixed choice keeps the false-alarm rate. A coarser pooling (fewer, heavier cells)
has more power against deviations spread over many cells; the fine term keeps the power against
one confined to a few rare cells, or moved among them (the `within_tail` and
`within_pooled_group` alternatives of the power simulation).

Chosen sizes. The synthetic SD (tests/statistical/test_exactness_harness.py): vocabulary 4 (+1 padded row),
K = 2, window 4 (= K + 2, so every sample crosses at least one round boundary), 256 cells,
n = 100_000, cells pooled only up to expected count 5; it requires power >= 0.95 against
total-variation-0.02 alternatives (`detection_power`) and checks the calibrated false-alarm rate.
The real engine (tests/statistical/test_engine_exactness.py): the same vocabulary and K, 4-token windows
(tokens 1-4 for SD, 5-8 for SSD, so that every token follows a cache lookup), cells below 1%
probability pooled into groups of >= 1%, n = 100k-175k per case, which gives power
>= 0.95 against every TV-0.01 alternative on each case's exact distribution (that module's
docstring has the table; a test asserts it). A longer window spreads the same n over V times more
cells and catches a given TV less often.

Layout: reference.py (the target's row distribution in float64), windows.py (the exact window
distribution, window counts), stats.py (the test, its
calibration and power), planted.py (the planted bugs), padded.py (a model with more embedding rows
than ids, as released models have: `pad_vocabulary`); everything public is re-exported here.
"""
from __future__ import annotations

from ssd_jax.testing.padded import id_tokenizer, pad_vocabulary, padded_mass
from ssd_jax.testing.planted import (
    ALL_PLANTED_BUGS,
    PLANTED_BUG_VERIFIERS,
    PLANTED_PROPOSER_BUGS,
    PLANTED_SSD_BUGS,
    correct_proposal_rows,
    plant_ssd_bug,
    wrong_proposal_rows,
)
from ssd_jax.testing.stats import (
    DistributionTestResult,
    detection_power,
    detection_power_by_alternative,
    distribution_test,
)
from ssd_jax.testing.reference import reference_probs, reference_row
from ssd_jax.testing.windows import enumerate_window_distribution, window_counts

__all__ = [
    "enumerate_window_distribution",
    "window_counts",
    "reference_probs",
    "reference_row",
    "DistributionTestResult",
    "distribution_test",
    "detection_power",
    "detection_power_by_alternative",
    "PLANTED_BUG_VERIFIERS",
    "PLANTED_PROPOSER_BUGS",
    "PLANTED_SSD_BUGS",
    "plant_ssd_bug",
    "ALL_PLANTED_BUGS",
    "correct_proposal_rows",
    "wrong_proposal_rows",
    "id_tokenizer",
    "pad_vocabulary",
    "padded_mass",
]
