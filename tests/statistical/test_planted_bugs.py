"""Planted bugs: the real engine's exactness tests (tests/statistical/test_engine_exactness.py) and its
deterministic checks (tests/_engine_checks.py) run with one bug planted each, and must fail. A
harness that cannot tell a broken engine from the real one is too weak to trust; the same pair,
windows and statistic as the exactness cases (`_engine_stats`).

The verifier bugs and the proposer's q-not-q' fail the distribution test at 20k requests (chi2
533-2777 against a threshold of 83). The SSD bugs of `ssd_jax.testing.PLANTED_SSD_BUGS` (planted
by `plant_ssd_bug`), each with the tests that catch it and the measured numbers:

- lookup_next_branch (the lookup returns the next branch's tokens and rows; 'hit' is right): with
  fan-out (3, 3, 4) every outcome is cached, so after round 1 every round is a hit; tokens 5-8 of
  60k requests fail (chi2 149 against 111; at 20k, 83 against 103 passes), and SSD no longer
  emits SD's tokens (1056 of 2000 requests differ). Why it needs that: most wrong branches have
  the hit's accept count, so their tokens were drawn, with fresh keys at the right positions, from
  the very rows returned, which is exact (any proposal is, given its rows); only a branch of
  another accept count, whose keys belong to other positions, biases the output.
- tree_keys_accept_stream (tree draws keyed on the accept stream): a drafted token and its own
  accept coin share a key (token 0's exponential is -log1p(-u) of the coin), so token 0 is
  over-accepted. The quick case with the bug fails (chi2 487 against 103; the correct engine on
  the same requests: 73), and 3149 of 19,526 speculated tokens are not drawn from their rows.
- tree_keys_by_row (tree draws keyed by batch row): a request's tree draws still use keys that
  none of its other draws use, so each request's output is exactly distributed and no
  distribution test on identical prompts can see it (measured with the earlier two-layer draft,
  fan-out (3, 3, 4), 20k requests in chunks of 5000, so four share each row's keys: 49% of the
  outputs change, and tokens 5-8 pass). What it breaks is ALGORITHM.md §7's "a request's output
  does not depend on its batch row": the same request ids in reversed batch order must give the
  same tokens per id; under the bug 834 of 2000 do not (and 3156 of 19,492 speculated tokens are
  not drawn from their rows).
- tree_rows_rounded_after_draw (the token drawn from the float32 rows, the bf16-rounded rows
  stored): the verifier's rows differ from the drawn-from ones by bf16 rounding (2^-9 relative),
  which moves the output by about that much TV at most; measured (with the earlier two-layer
  draft), 16 of 20,000 requests' 8 tokens change at all: no feasible n sees it. The rule it
  breaks is checked directly: every speculated token must be the exponential-race winner of the
  very rows handed to the verifier under its (request id, position, STREAM_DRAFT) key
  (ALGORITHM.md §3). With every outcome
  cached and 12,000 requests: 43 of 120,006 tokens are not (the correct engine: 0).

The hit-path bugs (what only a cache hit hands the verifier) are listed with their figures above
HIT_PATH_BUGS below, the padded-row bugs (what only a model with more rows than ids shows) above
PADDED_ROW_BUGS.
"""
import jax
import jax.numpy as jnp
import pytest

import ssd_jax.algorithm.steps
import ssd_jax.algorithm.tree
from ssd_jax.algorithm import saguaro
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.runtime.engine import SSDConfig
from ssd_jax.testing import PLANTED_BUG_VERIFIERS, PLANTED_SSD_BUGS, plant_ssd_bug

from _engine_checks import (DET_BATCH, FULL_FANOUT, QUICK, SAGUARO_SSD, draws_not_from_their_rows,
                            generate_ids, recorded_verifies, requests_moved_by_batch_order,
                            ssd_requests_unlike_sd)
from _engine_stats import STAT_CASES, T10, make_pair, planted_verdict

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    return make_pair()


# ---------------------------------------------------------------------------------------------
# Planted verifier and proposer bugs fail the distribution test
# ---------------------------------------------------------------------------------------------
# At n = 100k they failed by far (chi2 2,300-40,000 against a threshold of 54), so 20k suffices:
# the statistic's excess over its threshold shrinks in proportion to n.
PLANTED = dict(n=20_000, chunk=20_000)


@slow
@pytest.mark.parametrize("bug", sorted(PLANTED_BUG_VERIFIERS))
def test_planted_verifier_bugs_fail(pair, bug):
    # SSD rounds run every verifier path SD does (plus cache hits); the same planted verifiers on
    # plain SD are caught by tests/statistical/test_exactness_harness.py's vectorised SD.
    res, _ = planted_verdict(pair, "ssd", T10, verifier=PLANTED_BUG_VERIFIERS[bug],
                     ssd=SSDConfig(fanout=(2, 1, 1)), **PLANTED)
    print(bug, res)
    assert not res.passed, f"planted bug {bug} passed the exactness test: {res}"


@pytest.fixture
def q_not_q_prime(monkeypatch):
    """Planted proposer bug: sample from q' but hand the verifier q (before the draft's own
    temperature / top-k and Saguaro scaling)."""
    def wrong(logits, sampling, keys, *, vocab_size=None, saguaro_top_n=0, saguaro_c=1.0,
              row_dtype=jnp.float32):
        tok, _ = saguaro.propose(logits, sampling, keys, vocab_size=vocab_size,
                                 saguaro_top_n=saguaro_top_n, saguaro_c=saguaro_c, row_dtype=row_dtype)
        return tok, saguaro.probs_from_logits(logits, T10, vocab_size).astype(row_dtype)

    jax.clear_caches()  # the jitted steps captured the correct proposer
    monkeypatch.setattr(ssd_jax.algorithm.steps, "propose", wrong)
    monkeypatch.setattr(ssd_jax.algorithm.tree, "propose", wrong)
    yield
    monkeypatch.undo()
    jax.clear_caches()


@slow
def test_planted_q_not_q_prime_fails_sd(pair, q_not_q_prime):
    res, _ = planted_verdict(pair, "sd", T10, draft_sampling=SamplingParams(temperature=0.5, top_k=2),
                     **PLANTED)
    print(res)
    assert not res.passed, str(res)


@slow
def test_planted_saguaro_q_verified_fails_ssd(pair, q_not_q_prime):
    res, _ = planted_verdict(pair, "ssd", T10, ssd=SSDConfig(fanout=(2, 2, 1), saguaro_c=0.2),
                             **PLANTED)
    print(res)
    assert not res.passed, str(res)


# ---------------------------------------------------------------------------------------------
# Planted SSD bugs: each caught (module docstring: which test, and why that one)
# ---------------------------------------------------------------------------------------------
def test_planted_ssd_bug_names():
    assert set(PLANTED_SSD_BUGS) == {"lookup_next_branch", "tree_keys_accept_stream",
                                     "tree_keys_by_row", "tree_rows_rounded_after_draw",
                                     "lookup_rows_one_depth_late", "tree_rows_before_saguaro",
                                     "tree_keys_one_position_early",
                                     "random_backup_rows_over_padded_rows",
                                     "ngram_rows_over_padded_rows"}


# The padded-row bugs (#55): a backup that reports rows over every embedding row, padded ones
# included, while its tokens are drawn from the ids only. On a pair whose rows are its ids the
# rule is a no-op, so only a padded pair can see it. Measured at 20k requests, tokens 5-8, SSD
# (2, 1, 1) C 0.5 (threshold 102): random backup chi2 840 on the padded pair, 83 (a pass) on the
# same pair unpadded; n-gram backup 132 padded, 65 unpadded. n: 20k for the random backup,
# 40k for the n-gram one (misses that found no match are fewer).
PADDED_ROW_BUGS = {"random_backup_rows_over_padded_rows": ("random", 20_000),
                   "ngram_rows_over_padded_rows": ("ngram", 40_000)}


@slow
@pytest.mark.parametrize("bug", list(PADDED_ROW_BUGS))
def test_planted_padded_row_bugs_are_caught(pair, bug):
    backup, n = PADDED_ROW_BUGS[bug]
    assert pair[0].cfg.vocab_size > pair[0].tokenizer.vocab_size  # the pair has padded rows
    with plant_ssd_bug(bug):
        res, metrics = planted_verdict(pair, "ssd", T10, n=n, chunk=5_000, skip=4,
                                       ssd=SSDConfig(fanout=(2, 1, 1), saguaro_c=0.5,
                                                     backup=backup))
    assert sum(m.backups.get(backup, 0) for m in metrics) > 0, "the backup never served a miss"
    assert not res.passed, str(res)


# The hit-path bugs (#34): each changes only what comes out of the speculation cache. With every
# outcome cached (fan-out (3, 3, 4)) every round after the first verifies a hit. Saguaro needs a
# fan-out that leaves a token out at j < K (with F_j = 3 of V = 4 it scales every candidate
# alike). bug -> (SSD config, the least share of lookups that must hit). Each is caught here by
# the deterministic check that every speculated token was drawn from the row the verifier got;
# measured on the distribution test at 20k requests, tokens 5-8 (threshold 103; the correct
# engine 75 at (3, 3, 4), 77 at (2, 2, 4)): lookup_rows_one_depth_late chi2 36264,
# tree_rows_before_saguaro (C = 0.05) chi2 2860, tree_keys_one_position_early chi2 78 (a bias
# that n does not see; the draws check does: 6695 of 20,374 tokens).
HIT_PATH_BUGS = {
    "lookup_rows_one_depth_late": (FULL_FANOUT, 0.9),
    "tree_rows_before_saguaro": (SSDConfig(fanout=(2, 2, 4), saguaro_c=0.05), 0.3),
    "tree_keys_one_position_early": (FULL_FANOUT, 0.9),
}


@slow
@pytest.mark.parametrize("bug", list(HIT_PATH_BUGS))
def test_planted_hit_path_bugs_are_caught(pair, monkeypatch, bug):
    ssd, hit_share = HIT_PATH_BUGS[bug]
    with plant_ssd_bug(bug):
        with recorded_verifies(monkeypatch) as log:
            _, m = generate_ids(pair, "ssd", range(1000, 1000 + DET_BATCH), ssd=ssd)
    bad, checked = draws_not_from_their_rows(log)
    print(bug, bad, checked, m.hits, m.lookups)
    assert m.hits > hit_share * m.lookups, (m.hits, m.lookups)
    assert bad > 0.01 * checked, (bad, checked)


@slow
def test_planted_lookup_next_branch_is_caught(pair):
    with plant_ssd_bug("lookup_next_branch"):
        res, metrics = planted_verdict(pair, "ssd", T10, n=60_000, chunk=DET_BATCH, skip=4,
                                       ssd=FULL_FANOUT)
        differ, _ = ssd_requests_unlike_sd(pair)
    print(res, differ)
    assert sum(m.hits for m in metrics) > 0.9 * sum(m.lookups for m in metrics)
    assert not res.passed, str(res)
    assert differ > 0.01 * DET_BATCH, differ  # measured: 53%


@slow
def test_planted_tree_keys_accept_stream_is_caught(pair, monkeypatch):
    with plant_ssd_bug("tree_keys_accept_stream"):
        c = STAT_CASES[QUICK[0]]  # the quick case, with the bug
        res, _ = planted_verdict(pair, QUICK[1], c.sampling, n=c.n, skip=c.skip, **QUICK[2])
        with recorded_verifies(monkeypatch) as log:
            generate_ids(pair, "ssd", range(1000, 1000 + DET_BATCH), ssd=SAGUARO_SSD)
    bad, checked = draws_not_from_their_rows(log)
    print(res, bad, checked)
    assert not res.passed, str(res)
    assert bad > 0.01 * checked, (bad, checked)  # measured: 16%


@slow
def test_planted_tree_keys_by_row_is_caught(pair, monkeypatch):
    with plant_ssd_bug("tree_keys_by_row"):
        moved, _ = requests_moved_by_batch_order(pair)
        with recorded_verifies(monkeypatch) as log:
            generate_ids(pair, "ssd", range(1000, 1000 + DET_BATCH), ssd=SAGUARO_SSD)
    bad, checked = draws_not_from_their_rows(log)
    print(moved, bad, checked)
    # no distribution test: each request's own output is still exactly distributed
    assert moved > 0.01 * DET_BATCH, moved  # measured: 42%
    assert bad > 0.01 * checked, (bad, checked)  # measured: 16%


@slow
def test_planted_tree_rows_rounded_after_draw_is_caught(pair, monkeypatch):
    # Only a near-tie of the race flips with a 2^-9 rounding (~3e-4 of the tree's tokens), so:
    # 12,000 requests, every outcome cached (every round after the first drafted by the tree),
    # and the correct engine in the same configuration as the control.
    ssd = SSDConfig(fanout=(3, 3, 4), row_dtype="bfloat16")

    def mismatches():
        with recorded_verifies(monkeypatch) as log:
            for c in range(6):
                generate_ids(pair, "ssd", range(1000 + c * DET_BATCH, 1000 + (c + 1) * DET_BATCH),
                          ssd=ssd)
        return draws_not_from_their_rows(log)

    good, checked = mismatches()
    with plant_ssd_bug("tree_rows_rounded_after_draw"):
        bad, _ = mismatches()
    print(good, bad, checked)
    assert good == 0, (good, checked)
    assert bad >= 10, (bad, checked)  # measured: 43 of 120,006
