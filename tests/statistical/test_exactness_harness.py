"""The exactness harness on a synthetic speculative decoder.

Target and draft are random trigram logits tables over a vocabulary of 4 real tokens plus one padded
embedding row (with the largest logit, so any masking bug shows up as token 4). A vectorised SD
simulation written here runs N = 100_000 independent requests for WINDOW = 4 = K + 2 tokens (so every
sample crosses a round boundary), drafting from the draft's processed rows q', verifying with the
verifier under test, with keys indexed by (request id, position, stream). The exact verifier must pass
`distribution_test`; every planted bug must fail it; and the test must have power >= 0.95 against
total-variation-0.02 alternatives at this size.
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm.sampling import (STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL, SamplingParams,
                              position_keys, probs_from_logits, sample_from_probs)
from ssd_jax.testing import (ALL_PLANTED_BUGS, PLANTED_BUG_VERIFIERS, PLANTED_PROPOSER_BUGS,
                             correct_proposal_rows, detection_power,
                             detection_power_by_alternative, distribution_test,
                             enumerate_window_distribution, reference_probs, window_counts)
from ssd_jax.algorithm.verify import rejection_sample

V = 4            # real vocabulary
V_MODEL = 5      # embedding rows; row 4 is padding
K = 2            # lookahead
WINDOW = K + 2   # 4**4 = 256 cells
N = 100_000
PROMPT = (1, 3)
SEED = 1234


def _tables():
    rng = np.random.default_rng(7)
    target = 1.5 * rng.normal(size=(V, V, V_MODEL))
    # The draft is correlated with the target (acceptance ~0.6-0.7, so rounds of every length occur)
    # but clearly different (so rejections, residuals and bonus rows all matter).
    draft = 0.7 * target + 0.9 * rng.normal(size=(V, V, V_MODEL))
    # Padded row: larger than every real logit, so forgetting to mask it would make it the favourite.
    target[..., V:] = 6.0
    draft[..., V:] = 6.0
    return jnp.asarray(target, jnp.float32), jnp.asarray(draft, jnp.float32)


TARGET_TABLE, DRAFT_TABLE = _tables()


def trigram_logits_fn(table):
    """Full cache-free forward: tokens [N, T] -> logits [N, T, V_MODEL]; row t predicts token t+1
    from tokens t-1 and t (token -1 := 0)."""
    def logits_fn(tokens):
        prev2 = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)
        return table[prev2, tokens]
    return logits_fn


def _logits_for(table, buf, pos):
    """Logits predicting the token at position `pos` [N] of `buf` [N, L] (the forward's row pos-1)."""
    rows = jnp.arange(buf.shape[0])
    prev1 = buf[rows, pos - 1]
    prev2 = jnp.where(pos >= 2, buf[rows, jnp.maximum(pos - 2, 0)], 0)
    return table[prev2, prev1]


def _write(buf, pos, tok, mask=True):
    """buf[b, pos[b]] = tok[b] where mask[b]."""
    hit = (jnp.arange(buf.shape[1])[None, :] == pos[:, None]) & jnp.asarray(mask)[..., None]
    return jnp.where(hit, tok[:, None], buf)


@partial(jax.jit, static_argnames=("target_params", "draft_params", "verifier", "proposal",
                                   "proposal_rows", "n"))
def simulate_sd(target_table, draft_table, seed, *, target_params, draft_params, verifier,
                proposal="draft", proposal_rows=correct_proposal_rows, n=N):
    """n independent requests of chain SD; returns their first WINDOW generated tokens [n, WINDOW].

    proposal="draft": s_d ~ q' = probs_from_logits(draft logits, draft_params) with the draft stream
      key at its position; the verifier gets proposal_rows(q, q') with q the draft at temperature 1.
    proposal="guess": a deterministic n-gram-like guess s_d = (previous token + 1) % V, q' one-hot.
    """
    P = len(PROMPT)
    L = P + WINDOW * (K + 1) + 1
    buf = jnp.zeros((n, L), jnp.int32).at[:, :P].set(jnp.asarray(PROMPT, jnp.int32))
    length = jnp.full((n,), P, jnp.int32)
    rids = jnp.arange(n, dtype=jnp.int32)
    raw_params = SamplingParams(temperature=1.0)

    def one_round(_, state):
        buf, length = state
        spec = buf
        drafts, rows = [], []
        for d in range(K):
            pos = length + d
            if proposal == "draft":
                lg = _logits_for(draft_table, spec, pos)
                q_prime = probs_from_logits(lg, draft_params, V)
                s = sample_from_probs(q_prime, position_keys(seed, rids, pos[:, None], STREAM_DRAFT)[:, 0])
                rows.append(proposal_rows(probs_from_logits(lg, raw_params, V), q_prime))
            else:
                s = (spec[jnp.arange(n), pos - 1] + 1) % V
                rows.append(jax.nn.one_hot(s, V_MODEL, dtype=jnp.float32))
            drafts.append(s)
            spec = _write(spec, pos, s)
        target_logits = jnp.stack([_logits_for(target_table, spec, length + j) for j in range(K + 1)], 1)
        p = probs_from_logits(target_logits, target_params, V)
        offs = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
        akeys = position_keys(seed, rids, length[:, None] + offs[:, :K], STREAM_ACCEPT)
        rkeys = position_keys(seed, rids, length[:, None] + offs, STREAM_RESIDUAL)
        res = verifier(p, jnp.stack(rows, 1), jnp.stack(drafts, 1), akeys, rkeys)
        for j in range(K + 1):
            buf = _write(buf, length + j, res.tokens[:, j], j <= res.num_accepted)
        return buf, length + res.num_accepted + 1

    # Each round commits >= 1 token, so WINDOW rounds always cover the window.
    buf, _ = jax.lax.fori_loop(0, WINDOW, one_round, (buf, length))
    return buf[:, P:P + WINDOW]


_EXACT_CACHE = {}


def exact_window(params):
    if params not in _EXACT_CACHE:
        _EXACT_CACHE[params] = enumerate_window_distribution(
            trigram_logits_fn(TARGET_TABLE), list(PROMPT), WINDOW, params, V)
    return _EXACT_CACHE[params]


def run_case(target_params, draft_params=SamplingParams(1.0), verifier=rejection_sample, **kw):
    tokens = np.asarray(simulate_sd(TARGET_TABLE, DRAFT_TABLE, SEED, target_params=target_params,
                                    draft_params=draft_params, verifier=verifier, **kw))
    return distribution_test(window_counts(tokens, V), exact_window(target_params))


# ---------------------------------------------------------------------------------------------
# The harness's own pieces
# ---------------------------------------------------------------------------------------------
def test_enumeration_matches_chain_rule():
    params = SamplingParams(0.8, top_k=3)
    exact = exact_window(params)
    assert exact.shape == (V ** WINDOW,)
    assert abs(exact.sum() - 1) < 1e-12
    fn = trigram_logits_fn(TARGET_TABLE)
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = rng.integers(0, V, WINDOW)
        toks, prob = list(PROMPT), 1.0
        for t in w:
            row = np.asarray(probs_from_logits(fn(jnp.asarray([toks]))[:, -1], params, V))[0]
            prob *= row[t] / row.sum()
            toks.append(int(t))
        idx = int("".join(map(str, w)), V)
        assert np.isclose(exact[idx], prob, rtol=1e-5, atol=1e-12)
    # top-k=3 of 4 removes one token per step: zero cells exist
    assert (exact == 0).sum() > 0


def _prefix_by_prefix(logits_fn, prompt, window, params, vocab):
    """The exact window distribution the slow way: every prefix forwarded alone, its last row
    through reference_probs, the chain rule over all vocab ** window windows."""
    out = np.zeros(vocab ** window)
    for idx in range(vocab ** window):
        w = [idx // vocab ** (window - 1 - i) % vocab for i in range(window)]
        prob, toks = 1.0, list(prompt)
        for t in w:
            prob *= reference_probs(np.asarray(logits_fn(jnp.asarray([toks], jnp.int32)))[0, -1],
                                    params, vocab_size=vocab)[t]
            toks.append(t)
        out[idx] = prob
    return out


@pytest.mark.parametrize("window,batch_size", [(1, 4096), (3, 4096), (3, 3), (4, 7)])
def test_enumeration_forwards_one_shape_and_equals_each_prefix_alone(window, batch_size):
    """Every window's probability equals the chain rule over prefixes forwarded one by one, for a
    batch that holds every sequence, one that divides them and one that does not (the last call
    wraps around); logits_fn sees one shape, so a jitted one compiles once."""
    fn, shapes = trigram_logits_fn(TARGET_TABLE), set()

    def counted(tokens):
        shapes.add(tokens.shape)
        return fn(tokens)

    params = SamplingParams(0.9, top_k=3)
    got = enumerate_window_distribution(counted, list(PROMPT), window, params, V,
                                        batch_size=batch_size)
    want = _prefix_by_prefix(fn, PROMPT, window, params, V)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
    assert len(shapes) == 1, shapes
    assert shapes == {(min(batch_size, V ** (window - 1)), len(PROMPT) + window - 1)}


def test_enumeration_refuses_a_logits_fn_that_sees_later_tokens():
    """A forward whose rows depend on later tokens (no causal mask) cannot be read prefix by
    prefix from a full-length call: a clear error, not a wrong distribution."""
    fn = trigram_logits_fn(TARGET_TABLE)

    def leaky(tokens):
        return fn(tokens) + tokens[:, -1:, None].astype(jnp.float32)  # every row sees the last token

    with pytest.raises(ValueError, match="not causal"):
        enumerate_window_distribution(leaky, list(PROMPT), 3, SamplingParams(1.0), V)


def test_window_counts_indexing():
    counts = window_counts(np.array([[0, 0, 0, 1], [3, 0, 0, 0], [3, 0, 0, 0]]), V)
    assert counts[1] == 1 and counts[3 * V ** 3] == 2 and counts.sum() == 3
    with pytest.raises(ValueError):
        window_counts(np.array([[0, 4, 0, 0]]), V)  # a padded token leaked
    with pytest.raises(ValueError):
        window_counts(np.array([[0, -1, 0, 0]]), V)  # a placeholder leaked


@pytest.mark.parametrize("min_expected", [5.0, 0.01 * N], ids=["singletons", "pooled-1%"])
def test_false_alarm_rate_is_calibrated(min_expected):
    """Direct multinomial samples from the exact distribution: at false_alarm=0.05 (cheap to
    check) the rejection rate over 600 null trials is 0.05 within sampling error, with every cell
    of expected count >= 5 alone and with the engine suite's pooling (cells below 1% pooled)."""
    exact = exact_window(SamplingParams(1.0))
    rng = np.random.default_rng(3)
    fails = sum(not distribution_test(rng.multinomial(N, exact), exact, false_alarm=0.05,
                                      min_expected=min_expected)
                for _ in range(600))
    assert 12 <= fails <= 50, fails  # mean 30, sd 5.3


def test_detection_power():
    """Power against TV-0.02 alternatives for this exact distribution at n = 1e5, 256 cells."""
    for params in (SamplingParams(1.0), SamplingParams(0.7)):
        exact = exact_window(params)
        per_alt = detection_power_by_alternative(exact, N, tv=0.02, trials=200)
        power = detection_power(exact, N, tv=0.02, trials=800)
        print(params, per_alt, power)
        assert power >= 0.95, (params, per_alt)
        assert min(per_alt.values()) >= 0.9, (params, per_alt)


# ---------------------------------------------------------------------------------------------
# The exact verifier passes
# ---------------------------------------------------------------------------------------------
EXACT_CASES = {
    "t1.0": dict(target_params=SamplingParams(1.0)),
    "t0.7": dict(target_params=SamplingParams(0.7)),
    "t1.0_topk3": dict(target_params=SamplingParams(1.0, top_k=3)),
    "t0.9_topp0.8": dict(target_params=SamplingParams(0.9, top_p=0.8)),
    # Draft with its own temperature and top-k (q' != q): exact as long as q' is verified.
    "t1.0_draft_t0.5_topk2": dict(target_params=SamplingParams(1.0),
                                  draft_params=SamplingParams(0.5, top_k=2)),
    # One-hot proposals: a deterministic guess, and a greedy draft.
    "t1.0_guess": dict(target_params=SamplingParams(1.0), proposal="guess"),
    "t0.8_greedy_draft": dict(target_params=SamplingParams(0.8), draft_params=SamplingParams(0.0)),
    # Greedy target: the exact distribution is one cell.
    "t0": dict(target_params=SamplingParams(0.0)),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_exact_verifier_passes(case):
    result = run_case(**EXACT_CASES[case])
    print(case, result)
    assert result.passed, f"{case}: {result}"
    assert result.impossible == 0


# ---------------------------------------------------------------------------------------------
# Every planted bug fails
# ---------------------------------------------------------------------------------------------
def test_planted_bug_names():
    assert set(ALL_PLANTED_BUGS) == {"residual_from_p", "argmax_match", "no_q_zero_after_all_accept",
                                     "verify_q_not_q_prime", "lookup_next_branch",
                                     "tree_keys_accept_stream", "tree_keys_by_row",
                                     "tree_rows_rounded_after_draw", "lookup_rows_one_depth_late",
                                     "tree_rows_before_saguaro", "tree_keys_one_position_early",
                                     "random_backup_rows_over_padded_rows",
                                     "ngram_rows_over_padded_rows"}
    # the SSD bugs (PLANTED_SSD_BUGS) need the real engine's tree and lookup:
    # tests/statistical/test_engine_exactness.py


@pytest.mark.parametrize("bug", list(PLANTED_BUG_VERIFIERS))
def test_planted_verifier_bug_fails(bug):
    result = run_case(SamplingParams(1.0), verifier=PLANTED_BUG_VERIFIERS[bug])
    print(bug, result)
    assert not result.passed, f"{bug} went undetected: {result}"


def test_planted_proposer_bug_fails():
    # q' (temperature 0.5, top-k 2) differs from q (temperature 1): verifying against q is wrong.
    result = run_case(SamplingParams(1.0), draft_params=SamplingParams(0.5, top_k=2),
                      proposal_rows=PLANTED_PROPOSER_BUGS["verify_q_not_q_prime"])
    print("verify_q_not_q_prime", result)
    assert not result.passed, f"verify_q_not_q_prime went undetected: {result}"


# ---------------------------------------------------------------------------------------------
# The independent reference (ssd_jax.testing.reference) against probs_from_logits
# ---------------------------------------------------------------------------------------------
def _log(*p):
    return [float(np.log(x)) if x > 0 else -np.inf for x in p]


NEG = -np.inf
# name -> (logits [V], SamplingParams, vocab_size, the support the contract's text gives)
ADVERSARIAL_ROWS = {
    "topk2-tie-at-kth": ([1.0, 2.0, 2.0, 3.0], SamplingParams(1.0, top_k=2), None, {1, 2, 3}),
    "topk3-tie-at-kth": ([1.0, 2.0, 2.0, 3.0], SamplingParams(0.7, top_k=3), None, {1, 2, 3}),
    "topk1-tied-top": ([3.0, 3.0, 1.0, 0.0], SamplingParams(1.0, top_k=1), None, {0, 1}),
    "topp-just-above-first": (_log(0.5, 0.3, 0.2), SamplingParams(1.0, top_p=0.5001), None, {0, 1}),
    "topp-just-below-first": (_log(0.5, 0.3, 0.2), SamplingParams(1.0, top_p=0.4999), None, {0}),
    "topp-just-above-two": (_log(0.5, 0.3, 0.2), SamplingParams(1.0, top_p=0.8001), None, {0, 1, 2}),
    "topp-just-below-two": (_log(0.5, 0.3, 0.2), SamplingParams(1.0, top_p=0.7999), None, {0, 1}),
    "topp-tie-at-last-kept": (_log(0.4, 0.3, 0.3), SamplingParams(1.0, top_p=0.5), None, {0, 1, 2}),
    # top-p acts on the top-k-renormalised row: after top-k 2 the row is (4/7, 3/7), so top-p 0.5
    # keeps one token (on the raw row it would keep two)
    "topk-then-topp": (_log(0.4, 0.3, 0.2, 0.1), SamplingParams(1.0, top_k=2, top_p=0.5), None, {0}),
    # the temperature acts before top-p: at T 0.5 the row is (0.64, 0.36) over two, top-p 0.6 keeps
    # one (at T 1 it would keep two)
    "temperature-then-topp": (_log(0.8, 0.6), SamplingParams(0.5, top_p=0.6), None, {0}),
    "neg-inf-fewer-finite-than-k": ([NEG, 0.0, 1.0, NEG], SamplingParams(1.0, top_k=3), None, {1, 2}),
    "neg-inf-with-topp": ([NEG, 0.0, 0.5, NEG], SamplingParams(1.0, top_p=0.9), None, {1, 2}),
    "all-neg-inf": ([NEG, NEG, NEG, NEG], SamplingParams(1.0), None, {0}),
    "huge-logits": ([1e30, 1e30, -1e30, 0.0], SamplingParams(0.5), None, {0, 1}),
    "huge-spread-small-temperature": ([3e38, -3e38, 3e38, 0.0], SamplingParams(0.01), None, {0, 2}),
    "close-logits-tiny-temperature": ([10.0, 10.001, 9.99, -5.0], SamplingParams(1e-3), None,
                                      {0, 1, 2}),
    "v2-equal": ([0.0, 0.0], SamplingParams(1.0), None, {0, 1}),
    "v2-topp": ([0.0, 1.0], SamplingParams(1.0, top_p=0.5), None, {1}),
    "v2-topk1-of-2": ([5.0, -5.0], SamplingParams(2.0, top_k=1), None, {0}),
    "v2-topk2-is-off": ([5.0, -5.0], SamplingParams(2.0, top_k=2), None, {0, 1}),
    "padded-row-largest": ([0.0, 1.0, 2.0, 9.0], SamplingParams(1.0), 3, {0, 1, 2}),
    "padded-row-largest-greedy": ([0.0, 1.0, 2.0, 9.0], SamplingParams(0.0), 3, {2}),
    "greedy-tie-first-max": ([2.0, 5.0, 5.0, 1.0], SamplingParams(0.0), None, {1}),
}
MIXED_ROWS = (np.array([[2.0, 5.0, 5.0, 1.0], [1.0, 2.0, 2.0, 3.0], _log(0.4, 0.3, 0.2, 0.1)]),
              SamplingParams(temperature=[0.0, 0.7, 1.3], top_k=[0, 2, 3], top_p=[1.0, 0.9, 0.6]))


def _disagreement(lib, ref) -> str:
    """'' when the library's float32 rows `lib` match the reference's `ref` (same support; every
    entry within 2e-6), else what differs. An entry the reference gives < 1e-30 may underflow to 0
    in float32."""
    lib, ref = np.asarray(lib, np.float64), np.asarray(ref, np.float64)
    if np.any((lib > 0) & (ref == 0)) or np.any((lib == 0) & (ref > 1e-30)):
        return f"support differs: {lib} vs {ref}"
    if np.max(np.abs(lib - ref)) > 2e-6:
        return f"values differ by {np.max(np.abs(lib - ref)):.2g}: {lib} vs {ref}"
    return ""


@pytest.mark.parametrize("name", list(ADVERSARIAL_ROWS))
def test_the_reference_follows_the_documented_contract(name):
    """The reference's support on each adversarial row is the one the contract's text gives
    (typed here from SamplingParams' docstring, not from either implementation)."""
    logits, params, vocab, support = ADVERSARIAL_ROWS[name]
    ref = reference_probs(np.asarray([logits]), params, vocab)[0]
    assert set(np.flatnonzero(ref)) == support, ref
    assert abs(ref.sum() - 1) < 1e-12


@pytest.mark.parametrize("name", list(ADVERSARIAL_ROWS))
def test_probs_from_logits_matches_the_reference(name):
    logits, params, vocab, _ = ADVERSARIAL_ROWS[name]
    x = np.asarray([logits], np.float32)  # both see the same numbers
    lib = probs_from_logits(jnp.asarray(x), params, vocab)[0]
    ref = reference_probs(x, params, vocab)[0]
    assert _disagreement(lib, ref) == "", name


def test_probs_from_logits_matches_the_reference_per_request_and_on_random_rows():
    logits, params = MIXED_ROWS
    logits = logits.astype(np.float32)
    assert _disagreement(probs_from_logits(jnp.asarray(logits), params),
                         reference_probs(logits, params)) == ""
    rng = np.random.default_rng(0)
    for V_ in (2, 3, 7):
        x = (3 * rng.normal(size=(64, V_))).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = -np.inf
        params = SamplingParams(temperature=rng.uniform(0.05, 2.0, 64).astype(np.float32),
                                top_k=rng.integers(0, V_ + 1, 64).astype(np.int32),
                                top_p=rng.uniform(0.05, 1.0, 64).astype(np.float32))
        assert _disagreement(probs_from_logits(jnp.asarray(x), params), reference_probs(x, params)) == ""


def _topp_before_topk(logits, params, vocab):
    p = probs_from_logits(logits, SamplingParams(params.temperature, top_p=params.top_p), vocab)
    keep = probs_from_logits(logits, SamplingParams(params.temperature, top_k=params.top_k), vocab) > 0
    p = jnp.where(keep, p, 0.0)
    return p / p.sum(-1, keepdims=True)


def _temperature_after_topp(logits, params, vocab):
    keep = probs_from_logits(logits, SamplingParams(1.0, params.top_k, params.top_p), vocab) > 0
    p = jnp.where(keep, probs_from_logits(logits, SamplingParams(params.temperature), vocab), 0.0)
    return p / p.sum(-1, keepdims=True)


def _top_k_drops_ties(logits, params, vocab):
    k = int(params.top_k)
    if not 0 < k < logits.shape[-1] or params.greedy:
        return probs_from_logits(logits, params, vocab)
    idx = jnp.argsort(-logits, axis=-1, stable=True)[..., :k]
    mask = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], idx].set(True)
    return probs_from_logits(jnp.where(mask, logits, -jnp.inf), SamplingParams(params.temperature, 0, params.top_p), vocab)


def _padding_not_masked(logits, params, vocab):
    return probs_from_logits(logits, params, None)


@pytest.mark.parametrize("mutant", [_topp_before_topk, _temperature_after_topp, _top_k_drops_ties,
                                    _padding_not_masked])
def test_a_wrong_probs_from_logits_disagrees_with_the_reference(mutant):
    """Each plausible one-rule slip in the sampling distribution shows on some adversarial row,
    so the comparison above (and the window distributions built from the reference) would catch it."""
    failing = [name for name, (logits, params, vocab, _) in ADVERSARIAL_ROWS.items()
               if _disagreement(mutant(jnp.asarray([logits], jnp.float32), params, vocab)[0],
                                reference_probs(np.asarray([logits], np.float32), params, vocab)[0])]
    assert failing, f"{mutant.__name__} agrees with the reference on every adversarial row"


# ---------------------------------------------------------------------------------------------
# Power inside the low-probability cells (the statistic's fine term)
# ---------------------------------------------------------------------------------------------
def test_mass_moved_among_the_pooled_cells_is_detected():
    """With cells below 1% pooled, moving TV 0.01 between cells of one pooled group (or among the
    tail of the sorted cells) leaves the pooled counts as they were: the pooled chi-square alone
    rejects it at about the false-alarm rate (measured 0.0025 and 0.0); with the fine term, at
    >= 0.95 (measured 1.0 and 1.0)."""
    exact = exact_window(SamplingParams(1.0))
    kw = dict(tv=0.01, trials=400, min_expected=0.01 * N)
    blind = detection_power_by_alternative(exact, N, fine_weight=0.0, **kw)
    seen = detection_power_by_alternative(exact, N, **kw)
    print(blind, seen)
    assert blind["within_pooled_group"] <= 0.02, blind
    assert seen["within_pooled_group"] >= 0.95 and seen["within_tail"] >= 0.95, seen
    # and the fine term costs the pooled term's alternatives nothing that matters (at this n the
    # spread alternative at TV 0.01 is beyond either: the suite sizes the harness for TV 0.02)
    assert all(seen[k] >= blind[k] - 0.03 for k in blind), (blind, seen)
