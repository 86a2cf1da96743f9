"""The greedy near-tie rule (ssd_jax.algorithm.near_tie, ALGORITHM.md §3): identical outputs, or at
the first divergence both tokens among those tied for the top logit of plain decoding — never a
third token just because plain decoding had a near-tie between two others."""
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm import near_tie
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.params import random_params
from ssd_jax.models.transformer import forward


def test_tied_tokens_are_those_within_the_tolerance_of_the_top():
    # top logit 10, rel_tol 1e-5: tolerance 1e-4 below it
    row = np.array([10.0 - 5e-5, 3.0, 10.0, 10.0 - 1e-3, 10.0 - 1e-4, -2.0])
    assert near_tie.tied_tokens(row, 1e-5) == (2, 0, 4)  # highest first; the edge counts
    assert near_tie.tied_tokens(row, 1e-7) == (2,)  # only the argmax
    assert near_tie.tied_tokens(row, 1e-3) == (2, 0, 4, 3)
    # a negative top logit: |top| = 10 scales the tolerance the same way
    assert near_tie.tied_tokens(row - 20.0, 1e-5) == (2, 0, 4)


# ---------------------------------------------------------------------------------------------
# Each way the tolerance could be fooled: a row whose top-2 gap is clearly not a near-tie must
# not pass because of something elsewhere in the row
# ---------------------------------------------------------------------------------------------
NOT_A_TIE = np.array([1.0, 1.0 - 1e-3, 0.5, 0.0])  # gap 1e-3, 100x the tolerance 1e-5


def _extended(*extra):
    return np.concatenate([NOT_A_TIE, np.asarray(extra, np.float64)])


@pytest.mark.parametrize("extra", [(), (-100.0,), (-1e30,), (-np.inf,), (-np.inf,) * 60,
                                   (-np.inf, -1e30, -5.0)],
                         ids=["plain", "a-logit-at-minus-100", "a-logit-at-minus-1e30",
                              "one-minus-inf", "a-cut-head-of-minus-infs", "all-of-them"])
def test_far_away_and_minus_inf_logits_do_not_widen_the_tolerance(extra):
    row = _extended(*extra)
    assert near_tie.tied_tokens(row) == (0,)
    assert near_tie.tolerance(row) == pytest.approx(1e-5)
    with pytest.raises(AssertionError, match="not a near-tie"):
        near_tie.near_tie_verdict(row, 1, 0)


def test_a_minus_inf_token_is_never_tied():
    # the emitted token is one the row scores -inf (a cut head's id): never a near-tie, also when
    # every other logit is far below (no finite logit near it can excuse it)
    row = _extended(-np.inf)
    with pytest.raises(AssertionError, match="got token 4"):
        near_tie.near_tie_verdict(row, 4, 0)
    assert near_tie.tied_tokens(np.full(5, -np.inf)) == ()
    with pytest.raises(AssertionError):
        near_tie.near_tie_verdict(np.full(5, -np.inf), 1, 0)


def test_a_top_logit_near_zero_keeps_a_floor():
    # |top| ~ 0 must not shrink the tolerance to nothing (float noise there is still ~1e-7), and
    # the floor must not grow it past rel_tol
    assert near_tie.tied_tokens(np.array([1e-9, 1e-9 - 1e-7, -3.0])) == (0, 1)
    assert near_tie.tied_tokens(np.array([1e-9, 1e-9 - 1e-3, -3.0])) == (0,)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_plus_inf_in_the_row_fails(bad):
    row = _extended(bad)
    with pytest.raises(AssertionError, match="NaN or \\+inf"):
        near_tie.near_tie_verdict(row, 1, 0)


def test_a_cut_head_model_cannot_excuse_a_divergence():
    """End to end through `assert_greedy_agreement`: the 'plain decoding' model's head is cut (its
    forward writes -inf for the cut ids, as a cut draft head does). A divergence to the
    second-best token, far from a tie, must fail (the old rule scaled by max|logit| = inf)."""
    from ssd_jax.models.draft_head import truncate_model_head
    from ssd_jax.models.model import Model
    cut = truncate_model_head(Model(CFG, random_params(CFG, 0, scale=1.0)), CFG.vocab_size // 2)
    row = _row(cut.params, PROMPT)
    assert np.isneginf(row).sum() == CFG.vocab_size // 2  # the head really writes -inf
    want = _greedy(cut.params, PROMPT, 2)
    second = int(np.argsort(row)[-2])
    assert row.max() - row[second] > 1e-4 * max(abs(row.max()), 1)  # no tie here
    with pytest.raises(AssertionError, match="not a near-tie"):
        near_tie.assert_greedy_agreement(cut.params, CFG, PROMPT, [second, want[1]], want)


def test_the_documents_state_the_rule_the_code_applies():
    """README and ALGORITHM.md §3 give the tolerance as 1e-5 · max(|top|, 1); the code's default
    rel_tol is that 1e-5 and its scale is max(|top|, 1) (checked on rows above)."""
    import inspect
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    assert "1e-5 · max(|top logit|, 1)" in (root / "README.md").read_text()
    assert "1e-5 · max(|top|, 1)" in (root / "docs" / "ALGORITHM.md").read_text()
    for fn in (near_tie.tolerance, near_tie.tied_tokens, near_tie.near_tie_verdict,
               near_tie.greedy_agreement, near_tie.assert_greedy_agreement):
        assert inspect.signature(fn).parameters["rel_tol"].default == 1e-5, fn
    assert near_tie.tolerance(np.array([-250.0, -300.0])) == pytest.approx(2.5e-3)
    assert near_tie.tolerance(np.array([0.25, -300.0, -np.inf])) == pytest.approx(1e-5)


def test_verdict_requires_both_tokens_among_the_tied():
    row = np.array([10.0, 10.0 - 5e-5, 3.0, 10.0 - 1e-3])
    gap, scale, tied = near_tie.near_tie_verdict(row, 1, 0)
    assert gap == pytest.approx(5e-5) and scale == 10.0 and tied == (0, 1)
    near_tie.near_tie_verdict(row, 0, 1)  # either way round
    # plain decoding had a near-tie (0 vs 1), but the emitted token 2 is not one of them
    with pytest.raises(AssertionError, match="got token 2 .*not a near-tie"):
        near_tie.near_tie_verdict(row, 2, 0)
    with pytest.raises(AssertionError, match="got token 3"):  # 1e-3 below the top: too far
        near_tie.near_tie_verdict(row, 3, 0)
    with pytest.raises(AssertionError, match="plain decoding token 3"):
        near_tie.near_tie_verdict(row, 1, 3)
    with pytest.raises(AssertionError, match="got token 99"):  # out of the vocabulary
        near_tie.near_tie_verdict(row, 99, 0)


CFG = tiny_config("qwen2", vocab_size=64)
PROMPT = [3, 14, 15, 9, 26]


def _greedy(params, prompt, n):
    out = []
    for _ in range(n):
        ids = list(prompt) + out
        logits, _ = forward(params, CFG, jnp.asarray([ids], jnp.int32), init_cache(CFG, 1, len(ids)),
                            last_only=True)
        out.append(int(np.argmax(np.asarray(logits[0]))))
    return out


def _row(params, ids):
    logits, _ = forward(params, CFG, jnp.asarray([ids], jnp.int32), init_cache(CFG, 1, len(ids)),
                        last_only=True)
    return np.asarray(logits[0], np.float64)


@pytest.fixture(scope="module")
def tied_model():
    """A tiny model whose head has two identical columns: after the prompt and one generated
    token, tokens a and b tie exactly for the top logit."""
    params = random_params(CFG, 0, scale=1.0)
    first = _greedy(params, PROMPT, 1)
    row = _row(params, PROMPT + first)
    a, b = int(np.argsort(row)[-1]), int(np.argsort(row)[-2])
    head = np.asarray(params.lm_head).copy()
    head[:, b] = head[:, a]
    tied = params.replace(lm_head=jnp.asarray(head, params.lm_head.dtype))
    want = _greedy(tied, PROMPT, 3)
    assert want[0] == first[0] and want[1] in (a, b)
    row = _row(tied, PROMPT + want[:1])
    low = int(np.argmin(row))  # far below the top
    return tied, want, (a, b), low


def test_identical_outputs_agree(tied_model):
    params, want, _, _ = tied_model
    v = near_tie.greedy_agreement(params, CFG, PROMPT, want, want)
    assert v.identical and v.divergence is None
    with pytest.raises(AssertionError, match="different lengths"):
        near_tie.greedy_agreement(params, CFG, PROMPT, want[:2], want)


def test_the_other_tied_token_is_a_reported_near_tie(tied_model):
    params, want, (a, b), _ = tied_model
    other = b if want[1] == a else a
    got = [want[0], other, 7]
    with pytest.warns(UserWarning, match="near-tie at generated token 1"):
        v = near_tie.assert_greedy_agreement(params, CFG, PROMPT, got, want)
    assert not v.identical and v.divergence == 1
    assert set(v.tied) == {a, b} and v.gap <= 1e-5 * v.scale


def test_a_third_token_at_a_near_tie_is_a_divergence(tied_model):
    # plain decoding ties a and b at token 1; emitting any other token there is a real error
    params, want, (a, b), low = tied_model
    assert low not in (a, b)
    with pytest.raises(AssertionError, match="diverge at generated token 1: got"):
        near_tie.assert_greedy_agreement(params, CFG, PROMPT, [want[0], low, want[2]], want)


def test_a_divergence_without_a_tie_fails():
    params = random_params(CFG, 0, scale=1.0)
    want = _greedy(params, PROMPT, 2)
    row = _row(params, PROMPT)
    second = int(np.argsort(row)[-2])
    assert row.max() - row[second] > 1e-5 * np.abs(row).max()  # the random model has no tie here
    with pytest.raises(AssertionError, match="not a near-tie"):
        near_tie.assert_greedy_agreement(params, CFG, PROMPT, [second, want[1]], want)


def test_padded_rows_are_masked_by_vocab_size(tied_model):
    """A model with padded embedding rows (ssd_jax.testing.pad_vocabulary): the engine never emits
    them, so the near-tie is judged on the ids alone (vocab_size); without it the padded rows'
    large logits would be the top and excuse nothing."""
    from ssd_jax.models.model import Model
    from ssd_jax.testing import pad_vocabulary
    params, want, (a, b), low = tied_model
    padded = pad_vocabulary(Model(CFG, params), CFG.vocab_size + 4)
    logits, _ = forward(padded.params, padded.cfg, jnp.asarray([PROMPT + want[:1]], jnp.int32),
                        init_cache(padded.cfg, 1, len(PROMPT) + 1), last_only=True)
    row = np.asarray(logits[0], np.float64)
    assert row[CFG.vocab_size:].max() > row[:CFG.vocab_size].max()  # a padded row would win
    other = b if want[1] == a else a
    got = [want[0], other, 7]
    with pytest.warns(UserWarning, match="near-tie at generated token 1"):
        v = near_tie.assert_greedy_agreement(padded.params, padded.cfg, PROMPT, got, want,
                                             vocab_size=CFG.vocab_size)
    assert set(v.tied) == {a, b}
    with pytest.raises(AssertionError, match="not a near-tie"):  # the padded row's top, unmasked
        near_tie.assert_greedy_agreement(padded.params, padded.cfg, PROMPT, got, want)
    with pytest.raises(ValueError, match="vocab_size must be in"):
        near_tie.assert_greedy_agreement(padded.params, padded.cfg, PROMPT, got, want,
                                         vocab_size=CFG.vocab_size + 5)
