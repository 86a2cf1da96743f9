"""Distribution exactness of the real engine (SD and SSD rounds, tiny transformers, vocabulary 4).

100,000 independent requests (distinct request ids, so independent keys) generate a window of
K + 2 = 4 tokens from one prompt; the empirical window distribution must pass the calibrated
chi-square test of `ssd_jax.testing` against the exact target distribution enumerated from the
target's forward. Planted bugs in the verifier and in the proposer must fail the same test.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax.algorithm.steps
import ssd_jax.algorithm.tree
from ssd_jax.algorithm import saguaro
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.draft_head import truncate_model_head
from ssd_jax.runtime.engine import SSDConfig
from ssd_jax.testing import PLANTED_BUG_VERIFIERS, distribution_test, window_counts

from _engine_stats import T07, T10, V, exact, make_pair, sample_windows, verdict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    return make_pair()


EXACT_CASES = {
    "sd-t1.0": ("sd", T10, {}),
    "sd-t0.7-topk3": ("sd", SamplingParams(temperature=0.7, top_k=3), {}),
    "sd-t1.0-topp0.8": ("sd", SamplingParams(temperature=1.0, top_p=0.8), {}),
    "sd-draft-t0.5-topk2": ("sd", T10, dict(draft_sampling=SamplingParams(temperature=0.5, top_k=2))),
    "ssd-t0.7-saguaro0.5": ("ssd", T07, dict(ssd=SSDConfig(fanout=(2, 2, 1), saguaro_c=0.5))),
    "ssd-t1.0-random-backup": ("ssd", T10, dict(ssd=SSDConfig(fanout=(2, 1, 1), backup="random"))),
    "ssd-t1.0-ngram-onehot": ("ssd", T10, dict(ssd=SSDConfig(fanout=(1, 1, 1), backup="ngram"))),
}


@pytest.mark.parametrize("case", sorted(EXACT_CASES))
def test_engine_output_has_the_target_distribution(pair, case):
    mode, sampling, kw = EXACT_CASES[case]
    res, metrics = verdict(pair, mode, sampling, **kw)
    assert res.passed, str(res)
    hist = np.sum([m.accept_hist for m in metrics], axis=0)
    assert np.all(hist > 0), f"every accept length 0..K must occur: {hist}"
    if mode == "ssd":
        hits = sum(m.hits for m in metrics)
        lookups = sum(m.lookups for m in metrics)
        assert 0 < hits < lookups, (hits, lookups)


@pytest.mark.parametrize("bug", sorted(PLANTED_BUG_VERIFIERS))
def test_planted_verifier_bugs_fail(pair, bug):
    # SSD rounds run every verifier path SD does (plus cache hits); the same planted verifiers on
    # plain SD are caught by tests/test_exactness_harness.py's vectorised SD.
    res, _ = verdict(pair, "ssd", T10, verifier=PLANTED_BUG_VERIFIERS[bug],
                     ssd=SSDConfig(fanout=(2, 1, 1)))
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


def test_planted_q_not_q_prime_fails_sd(pair, q_not_q_prime):
    res, _ = verdict(pair, "sd", T10, draft_sampling=SamplingParams(temperature=0.5, top_k=2))
    assert not res.passed, str(res)


def test_planted_saguaro_q_verified_fails_ssd(pair, q_not_q_prime):
    res, _ = verdict(pair, "ssd", T10, ssd=SSDConfig(fanout=(2, 2, 1), saguaro_c=0.2))
    assert not res.passed, str(res)


@pytest.mark.parametrize("mode,sampling,kw", [
    ("sd", T10, {}),
    ("ssd", T07, dict(ssd=SSDConfig(fanout=(2, 2, 1), saguaro_c=0.5))),
], ids=["sd-t1.0", "ssd-t0.7-saguaro0.5"])
def test_a_draft_head_cut_to_half_the_vocabulary_keeps_the_target_distribution(pair, mode, sampling, kw):
    # models/draft_head.py: the draft proposes only ids 0 and 1; ids 2 and 3 must still come out
    # at the target's rates, through the residual after a rejection.
    target, draft = pair
    toks, metrics = sample_windows((target, truncate_model_head(draft, V // 2)), mode, sampling, **kw)
    res = distribution_test(window_counts(toks, V), exact(sampling))
    assert res.passed, str(res)
    assert np.mean(toks >= V // 2) > 0.1  # the cut ids are a real share of the output
    hist = np.sum([m.accept_hist for m in metrics], axis=0)
    assert np.all(hist > 0), f"every accept length 0..K must occur: {hist}"
