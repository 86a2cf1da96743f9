"""ssd_jax.algorithm.sampling: the user's distribution, position-indexed keys, the exponential race."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ssd_jax.algorithm.sampling import (STREAM_ACCEPT, STREAM_BACKUP, STREAM_DRAFT, STREAM_RESIDUAL, STREAM_SAMPLE,
                              SamplingParams, position_keys, probs_from_logits, sample,
                              sample_from_probs)


def ref_probs(logits, params, vocab_size=None):
    """Independent float64 reference, one row at a time (HF semantics; ties at a cut are kept)."""
    x = np.asarray(logits, np.float64).copy()
    V = x.shape[-1]
    if vocab_size is not None:
        x[vocab_size:] = -np.inf
    if params.temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / params.temperature
    if 0 < params.top_k < V:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x[x < kth] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1:
        cum, cutoff = 0.0, None
        for i in np.argsort(-p, kind="stable"):
            cum += p[i]
            cutoff = p[i]
            if cum >= params.top_p:
                break
        p[p < cutoff] = 0
        p /= p.sum()
    return p


PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.6),
    SamplingParams(1.3, top_k=5),
    SamplingParams(0.8, top_k=1),
    SamplingParams(1.0, top_p=0.9),
    SamplingParams(0.7, top_p=0.5),
    SamplingParams(1.0, top_k=8, top_p=0.8),
    SamplingParams(2.0, top_k=50, top_p=0.3),  # top_k > V: off
]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_matches_numpy_reference(params):
    rng = np.random.default_rng(0)
    logits = (2.0 * rng.normal(size=(64, 20))).astype(np.float32)
    logits[::7, 3] = -np.inf  # -inf entries are legal
    for vocab_size in (None, 17):
        got = np.asarray(jax.jit(probs_from_logits, static_argnums=(1, 2))(logits, params, vocab_size))
        want = np.stack([ref_probs(row, params, vocab_size) for row in logits])
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
        assert np.all((got > 0) == (want > 0))  # identical support
        if vocab_size is not None:
            assert np.all(got[:, vocab_size:] == 0)


def test_batch_shape_any_rank():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 4, 9)), jnp.float32)
    p = probs_from_logits(logits, SamplingParams(1.0, top_k=3, top_p=0.9))
    assert p.shape == (2, 3, 4, 9)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, atol=1e-6)


def test_top_k_and_top_p_keep_ties():
    p = np.asarray(probs_from_logits(jnp.array([1.0, 1.0, 1.0, 0.0]), SamplingParams(1.0, top_k=2)))
    np.testing.assert_allclose(p, [1 / 3, 1 / 3, 1 / 3, 0], atol=1e-6)
    p = np.asarray(probs_from_logits(jnp.array([0.0, 2.0, 2.0, 1.0]), SamplingParams(1.0, top_p=0.3)))
    assert p[1] == p[2] == pytest.approx(0.5) and p[0] == p[3] == 0


def test_greedy_one_hot_first_max():
    logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [0.0, 1.0, 0.5, 9.0]])
    p = np.asarray(probs_from_logits(logits, SamplingParams(0.0)))
    np.testing.assert_array_equal(p, [[0, 1, 0, 0], [0, 0, 0, 1]])
    # the padded row (index 3) has the largest logit but is never the argmax
    p = np.asarray(probs_from_logits(logits, SamplingParams(0.0, top_k=3, top_p=0.5), vocab_size=3))
    np.testing.assert_array_equal(p, [[0, 1, 0, 0], [0, 1, 0, 0]])
    assert SamplingParams(0.0).greedy and not SamplingParams(0.1).greedy
    tokens, probs = sample(logits, SamplingParams(0.0), jax.random.split(jax.random.key(0), 2), vocab_size=3)
    np.testing.assert_array_equal(np.asarray(tokens), [1, 1])


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.01),
                                    SamplingParams(1.0, top_k=2), SamplingParams(1.0, top_p=0.5)], ids=str)
def test_padded_rows_zero_and_no_nan(params):
    logits = jnp.array([
        [0.0, 1.0, 50.0, 80.0],                    # padded rows hold the largest logits
        [-jnp.inf, -jnp.inf, 3.0, 1.0],            # only padded rows finite
        [-jnp.inf, -jnp.inf, -jnp.inf, -jnp.inf],  # nothing finite
        [1e30, -1e30, 0.0, 0.0],                   # huge logits and a small temperature
    ], jnp.float32)
    p = np.asarray(probs_from_logits(logits, params, vocab_size=2))
    assert not np.any(np.isnan(p))
    assert np.all(p[:, 2:] == 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
    assert p[0, 1] > p[0, 0] and p[3, 0] == 1.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=math.nan), "top_p"),
    (dict(top_p=-0.5), "top_p"),
])
def test_bad_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_hashable_static():
    a, b = SamplingParams(0.7, top_k=3), SamplingParams(0.7, top_k=3)
    assert a == b and hash(a) == hash(b) and a != SamplingParams(0.7)
    traces = []

    def g(x, params):
        traces.append(params)
        return probs_from_logits(x, params)

    f = jax.jit(g, static_argnums=1)
    f(jnp.zeros(4), a)
    f(jnp.zeros(4), b)
    assert len(traces) == 1  # equal params hit the same compiled function


def test_stream_constants():
    assert (STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_BACKUP) == (0, 1, 2, 3, 4)


def _data(keys):
    return np.asarray(jax.random.key_data(keys))


def test_keys_definition_and_seed_forms():
    rid, pos = jnp.array([5, 9], jnp.int32), jnp.array([[0, 3], [7, 7]], jnp.int32)
    keys = position_keys(11, rid, pos, STREAM_DRAFT)
    assert keys.shape == (2, 2)
    base = jax.random.key(11)
    want = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, 9), 7), STREAM_DRAFT)
    np.testing.assert_array_equal(_data(keys[1, 0]), _data(want))
    np.testing.assert_array_equal(_data(keys), _data(position_keys(base, rid, pos, STREAM_DRAFT)))
    np.testing.assert_array_equal(_data(keys), _data(position_keys(jax.random.PRNGKey(11), rid, pos, 1)))
    jitted = jax.jit(position_keys, static_argnums=3)(jnp.int32(11), rid, pos, STREAM_DRAFT)
    np.testing.assert_array_equal(_data(keys), _data(jitted))
    # streams, positions and requests all give different keys
    other = position_keys(11, rid, pos, STREAM_ACCEPT)
    assert not np.any(np.all(_data(keys) == _data(other), axis=-1))
    assert not np.array_equal(_data(keys[0, 0]), _data(keys[0, 1]))
    assert not np.array_equal(_data(keys[0, 0]), _data(position_keys(11, rid[1:], pos[:1], 1)[0, 0]))


def test_draws_independent_of_batch_layout():
    """Same request id and position -> same key and same token, whatever row the request sits in."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(40,)), jnp.float32)
    params = SamplingParams(1.0)
    rid_a = jnp.array([3, 17, 42, 8], jnp.int32)
    pos_a = jnp.array([[10, 11], [0, 1], [5, 6], [99, 100]], jnp.int32)
    perm = np.array([2, 0, 3])  # a different layout holding three of the requests
    rid_b, pos_b = rid_a[perm], pos_a[perm]
    ka = position_keys(0, rid_a, pos_a, STREAM_SAMPLE)
    kb = position_keys(0, rid_b, pos_b, STREAM_SAMPLE)
    np.testing.assert_array_equal(_data(ka)[perm], _data(kb))
    ta, _ = sample(jnp.broadcast_to(logits, (4, 2, 40)), params, ka)
    tb, _ = sample(jnp.broadcast_to(logits, (3, 2, 40)), params, kb)
    np.testing.assert_array_equal(np.asarray(ta)[perm], np.asarray(tb))


def test_sample_frequencies_match_probs():
    probs = jnp.array([0.5, 0.0, 0.2, 0.15, 0.1, 0.05, 0.0], jnp.float32)
    n = 200_000
    keys = position_keys(3, jnp.arange(n, dtype=jnp.int32), jnp.zeros((n, 1), jnp.int32), STREAM_SAMPLE)[:, 0]
    toks = np.asarray(jax.jit(sample_from_probs)(jnp.broadcast_to(probs, (n, 7)), keys))
    counts = np.bincount(toks, minlength=7)
    assert counts[1] == 0 and counts[6] == 0  # zero-probability tokens are never drawn
    support = np.asarray(probs) > 0
    pval = stats.chisquare(counts[support], n * np.asarray(probs, np.float64)[support]).pvalue
    assert pval > 1e-3, (counts, pval)


def test_sample_unnormalised_and_tiny_weights():
    # The race needs no normalisation; tiny positive weights are still drawable, zeros never.
    w = jnp.array([1e-30, 0.0, 3e-30], jnp.float32)
    n = 20_000
    keys = jax.random.split(jax.random.key(5), n)
    toks = np.asarray(sample_from_probs(jnp.broadcast_to(w, (n, 3)), keys))
    counts = np.bincount(toks, minlength=3)
    assert counts[1] == 0
    assert abs(counts[2] / n - 0.75) < 0.02


def test_sample_returns_probs_and_raw_keys():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(3, 6)), jnp.float32)
    params = SamplingParams(0.9, top_k=3)
    raw = jax.random.key_data(jax.random.split(jax.random.key(1), 3))
    t1, p1 = sample(logits, params, raw)
    t2, p2 = sample(logits, params, jax.random.wrap_key_data(raw))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    np.testing.assert_array_equal(np.asarray(p1), np.asarray(probs_from_logits(logits, params)))
    assert np.all(np.asarray(p1)[np.arange(3), np.asarray(t1)] > 0)
    with pytest.raises(ValueError):
        sample(logits, params, jax.random.split(jax.random.key(1), 4))


# ----------------------------------------------------------------------------------------------
# Traced values: one compile for every sampled value, the same numbers as host values
# ----------------------------------------------------------------------------------------------
_traced_probs = jax.jit(probs_from_logits, static_argnums=2)


@pytest.mark.parametrize("params", PARAMS + [SamplingParams(0.9, top_k=19), SamplingParams(1.0, top_k=40)],
                         ids=str)
def test_traced_values_give_the_host_values_rows(params):
    """SamplingParams as a traced argument (a pytree) gives the rows the static path gives, and
    the float64 reference's support."""
    rng = np.random.default_rng(0)
    logits = (2.0 * rng.normal(size=(64, 20))).astype(np.float32)
    logits[::7, 3] = -np.inf
    logits[::5, :4] = 1.5  # ties
    for vocab_size in (None, 17):
        got = np.asarray(_traced_probs(logits, params, vocab_size))
        host = np.asarray(probs_from_logits(logits, params, vocab_size))
        np.testing.assert_allclose(got, host, atol=1e-7, rtol=1e-6)
        assert np.all((got > 0) == (host > 0))
        want = np.stack([ref_probs(row, params, vocab_size) for row in logits])
        assert np.all((got > 0) == (want > 0))


def test_one_compile_for_every_sampled_value():
    f = jax.jit(lambda x, p: probs_from_logits(x, p))  # its own cache (jits of one function share one)
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 30)), jnp.float32)
    outs = [np.asarray(f(logits, p)) for p in PARAMS]
    assert f._cache_size() == 1
    assert len({o.tobytes() for o in outs}) == len(PARAMS)  # each value took effect
    f(logits, SamplingParams(0.0))  # greedy: its own (argmax-only) compile
    f(logits, SamplingParams(0.0, top_k=3, top_p=0.5))
    assert f._cache_size() == 2
    # Python floats, numpy scalars and ints all flatten to one signature
    f(logits, SamplingParams(np.float32(0.5), top_k=np.int64(2), top_p=1))
    assert f._cache_size() == 2


def test_per_request_rows_equal_each_request_alone():
    """[B] values: row b follows params b exactly (traced or host values); greedy rows of a
    sampled batch are one-hot at the argmax."""
    rng = np.random.default_rng(5)
    batch = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.6, top_k=3),
             SamplingParams(1.3, top_p=0.7), SamplingParams(0.9, top_k=25, top_p=0.9),
             SamplingParams(0.0, top_k=2)]
    per = SamplingParams.per_request(batch, len(batch))
    assert per.temperature.dtype == np.float32 and per.top_k.dtype == np.int32
    assert not per.greedy and SamplingParams.per_request(SamplingParams(0.0), 3).greedy
    for shape in ((len(batch), 30), (len(batch), 3, 30)):
        logits = jnp.asarray(2 * rng.normal(size=shape), jnp.float32)
        traced = np.asarray(_traced_probs(logits, per, 28))
        host = np.asarray(probs_from_logits(logits, per, 28))
        for b, p in enumerate(batch):
            alone = np.asarray(probs_from_logits(logits[b], p, 28))
            np.testing.assert_allclose(traced[b], alone, atol=1e-7, rtol=1e-6)
            np.testing.assert_allclose(host[b], alone, atol=1e-7, rtol=1e-6)
            assert np.all((traced[b] > 0) == (alone > 0))
    with pytest.raises(ValueError, match="one value per leading row"):
        probs_from_logits(jnp.zeros((4, 30)), per)


def test_per_request_construction_and_checks():
    one = SamplingParams.per_request(SamplingParams(0.7, top_k=2), 3)
    np.testing.assert_array_equal(one.temperature, np.float32([0.7] * 3))
    np.testing.assert_array_equal(one.top_k, [2, 2, 2])
    again = SamplingParams.per_request(one, 3)
    np.testing.assert_array_equal(again.top_p, [1, 1, 1])
    arr = SamplingParams(temperature=[0.5, 1.0], top_k=[0, 3], top_p=[1.0, 0.9])
    assert arr.temperature.dtype == np.float32 and arr.top_k.dtype == np.int32
    with pytest.raises(ValueError, match="one SamplingParams per request"):
        SamplingParams.per_request([SamplingParams(1.0)], 2)
    with pytest.raises(ValueError, match="values per field"):
        SamplingParams.per_request(arr, 3)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=[0.5, -1.0])
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=[1.5, 2.0])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=[0.5, 0.0])
    with pytest.raises(ValueError, match="differ in length"):
        SamplingParams(temperature=[0.5, 1.0], top_k=[1, 2, 3])


def test_sample_with_traced_params_draws_like_host_params():
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(8, 12)), jnp.float32)
    keys = position_keys(2, jnp.arange(8, dtype=jnp.int32), jnp.zeros((8,), jnp.int32), STREAM_SAMPLE)
    for p in (SamplingParams(0.8, top_k=4, top_p=0.9), SamplingParams(0.0)):
        t_host, _ = sample(logits, p, keys)
        t_traced, _ = jax.jit(sample)(logits, p, keys)
        np.testing.assert_array_equal(np.asarray(t_host), np.asarray(t_traced))


# ------------------------------------------------------------------------------ Saguaro's scale
def test_saguaro_scale_by_hand_and_with_a_traced_top_n():
    from ssd_jax.algorithm.saguaro import saguaro_scale
    # raw logits rank tokens 2 > 0 > 3 > 1; q = [0.3, 0.1, 0.4, 0.2]. Top-2 {2, 0} scaled by
    # C = 0.5: [0.15, 0.1, 0.2, 0.2] / 0.65.
    raw = jnp.asarray([[1.0, -1.0, 2.0, 0.0]])
    q = jnp.asarray([[0.3, 0.1, 0.4, 0.2]])
    want = np.array([[0.15, 0.1, 0.2, 0.2]]) / 0.65
    np.testing.assert_allclose(np.asarray(saguaro_scale(q, raw, 2, 0.5)), want, rtol=1e-6)
    # a traced top-n (a tree step inside a loop over depths) gives the same numbers, and its 0
    # leaves q exactly as it is, as a static 0 does
    traced = jax.jit(lambda n: saguaro_scale(q, raw, n, 0.5))
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(2))),
                                  np.asarray(saguaro_scale(q, raw, 2, 0.5)))
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(0))), np.asarray(q))
    assert saguaro_scale(q, raw, 0, 0.5) is q
    # C = 1 is plain sampling: q itself
    np.testing.assert_array_equal(np.asarray(saguaro_scale(q, raw, 2, 1.0)), np.asarray(q))


@pytest.mark.parametrize("row_dtype", [jnp.float32, jnp.bfloat16])
def test_a_greedy_proposal_under_saguaro_is_the_one_hot_row_the_scaling_gives(row_dtype):
    """`saguaro_propose` draws a greedy token without running Saguaro's scaling: the scaled row
    of a one-hot row is that row bit for bit (C x 1 renormalised by C), whatever C and top-n, so
    the token and the row are what the scaling path gives. Padded vocabulary rows and ties
    included (the first maximum, as greedy decoding breaks them)."""
    from ssd_jax.algorithm.saguaro import propose, saguaro_scale
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(6, 40)).astype(np.float32)
    logits[1, [3, 17]] = 9.0  # a tie: token 3
    logits[2, 38] = 50.0  # the largest logit on a padded row (vocab_size 36): not drawn
    logits = jnp.asarray(logits)
    greedy = SamplingParams(temperature=0.0)
    for top_n in (1, 3, 40):
        for c in (0.5, jnp.asarray([0.1, 0.3, 0.5, 0.7, 0.9, 1.0], jnp.float32)):
            tok, rows = propose(logits, greedy, None, vocab_size=36, saguaro_top_n=top_n,
                                saguaro_c=c, row_dtype=row_dtype)
            q = saguaro_scale(probs_from_logits(logits, greedy, 36), logits, top_n, c)
            np.testing.assert_array_equal(np.asarray(rows), np.asarray(q.astype(row_dtype)))
            np.testing.assert_array_equal(np.asarray(tok), np.asarray(jnp.argmax(q, -1)))
            assert int(tok[1]) == 3 and int(tok[2]) != 38
