"""Every public function's edges: each documented input out of range gets the documented result
or a `ValueError` naming the argument, before anything is traced.

rejection_sample, saguaro_propose, lookup, draft_tree, forward, tree_step and init_cache, called
as a user calls them from a notebook (eagerly, on a tiny model with padded vocabulary rows), at
K = 0, an empty batch, rows that do not sum to 1, vocabularies that disagree, the wrong dtypes,
and values out of range. The peers' rejection-sampler cases (vLLM's, tpu-inference's) agree with
ours on the rest; K = 0 was the one that raised an opaque gather error.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.algorithm.speculation_cache import SpeculationCache
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import random_params
from ssd_jax.models.transformer import init_branch_kv
from ssd_jax.testing import pad_vocabulary

IDS, ROWS = 12, 16  # the tokenizer's ids and the embedding rows, as a released model has
T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("qwen2", vocab_size=IDS, num_layers=1)
    return pad_vocabulary(Model(cfg, random_params(cfg, 0)), ROWS)


def _keys(*shape, seed=0):
    return jax.random.split(jax.random.key(seed), int(np.prod(shape))).reshape(shape)


def _rows(rng, *shape):
    r = rng.random(shape)
    return r / r.sum(-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# rejection_sample
# ---------------------------------------------------------------------------------------------
def test_rejection_sample_at_k0_is_plain_sampling_from_p1():
    # one-hot p_1: the bonus is that token, whatever the key
    p = jax.nn.one_hot(jnp.asarray([[2], [5], [7]]), ROWS)
    out = ssd_jax.rejection_sample(p, jnp.zeros((3, 0, ROWS)), jnp.zeros((3, 0), jnp.int32),
                                   _keys(3, 0), _keys(3, 1))
    assert out.tokens.shape == (3, 1)
    np.testing.assert_array_equal(out.num_accepted, [0, 0, 0])
    np.testing.assert_array_equal(out.bonus, [2, 5, 7])
    np.testing.assert_array_equal(out.tokens[:, 0], out.bonus)
    # p_1 = (0.25, 0.75) on two ids: 4,000 draws land on id 1 at 0.75 (+- 4 sigma = 0.027)
    n = 4000
    p2 = jnp.zeros((n, 1, ROWS)).at[:, 0, 0].set(0.25).at[:, 0, 1].set(0.75)
    b = ssd_jax.rejection_sample(p2, jnp.zeros((n, 0, ROWS)), jnp.zeros((n, 0), jnp.int32),
                                 _keys(n, 0), _keys(n, 1, seed=1)).bonus
    assert set(np.unique(b)) <= {0, 1}
    assert abs(np.mean(np.asarray(b) == 1) - 0.75) < 0.027


def test_rejection_sample_of_an_empty_batch_is_empty():
    out = ssd_jax.rejection_sample(jnp.zeros((0, 3, ROWS)), jnp.zeros((0, 2, ROWS)),
                                   jnp.zeros((0, 2), jnp.int32), _keys(0, 2), _keys(0, 3))
    assert out.num_accepted.shape == (0,) and out.bonus.shape == (0,) and out.tokens.shape == (0, 3)


def test_rejection_sample_names_each_bad_argument():
    rng = np.random.default_rng(0)
    B, K = 2, 3
    p, q = _rows(rng, B, K + 1, ROWS), _rows(rng, B, K, ROWS)
    s = np.asarray([[0, 1, 2], [3, 4, 5]], np.int32)
    ak, rk = _keys(B, K), _keys(B, K + 1)
    good = dict(target_probs=p, proposal_probs=q, draft_tokens=s, accept_keys=ak, residual_keys=rk)
    assert ssd_jax.rejection_sample(**good).tokens.shape == (B, K + 1)
    cases = [
        (dict(target_probs=p * 1.5), r"every row of target_probs must sum to 1"),
        (dict(proposal_probs=q * 0.5), r"every row of proposal_probs must sum to 1"),
        (dict(proposal_probs=-q), r"proposal_probs must be probabilities"),
        (dict(target_probs=np.where(np.arange(ROWS) == 3, np.nan, p)),
         r"target_probs must be probabilities"),
        (dict(proposal_probs=_rows(rng, B, K, ROWS - 1)), r"proposal_probs must be \[B, K, V\]"),
        (dict(proposal_probs=_rows(rng, B, K + 1, ROWS)), r"proposal_probs must be \[B, K, V\]"),
        (dict(draft_tokens=s[:, :2]), r"draft_tokens must be \[B, K\]"),
        (dict(draft_tokens=s.astype(np.float32)), r"draft_tokens must hold integers"),
        (dict(draft_tokens=s + ROWS - 5), rf"draft_tokens must be in \[0, {ROWS}\)"),
        (dict(target_probs=(p == p.max(-1, keepdims=True)).astype(np.int32)),
         r"target_probs must be floating point"),
        (dict(target_probs=p[0]), r"target_probs must be \[B, K\+1, V\]"),
        (dict(accept_keys=_keys(B, K + 1)), r"accept_keys must be typed PRNG keys \[2, 3\]"),
        (dict(residual_keys=np.zeros((B, K + 1), np.uint32)), r"residual_keys must be"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            ssd_jax.rejection_sample(**{**good, **bad})
    # raw uint32 keys are the documented alternative to typed ones
    raw = dict(accept_keys=jax.random.key_data(ak), residual_keys=jax.random.key_data(rk))
    np.testing.assert_array_equal(ssd_jax.rejection_sample(**{**good, **raw}).tokens,
                                  ssd_jax.rejection_sample(**good).tokens)


# ---------------------------------------------------------------------------------------------
# saguaro_propose
# ---------------------------------------------------------------------------------------------
def test_saguaro_propose_edges():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, ROWS)) * 3, jnp.float32)
    tok, rows = ssd_jax.saguaro_propose(logits, T1, _keys(3), vocab_size=IDS, saguaro_top_n=2,
                                        saguaro_c=0.5)
    assert np.all(np.asarray(tok) < IDS) and np.all(np.asarray(rows)[:, IDS:] == 0)
    t0, r0 = ssd_jax.saguaro_propose(jnp.zeros((0, ROWS)), T1, _keys(0), vocab_size=IDS)
    assert t0.shape == (0,) and r0.shape == (0, ROWS)
    greedy, _ = ssd_jax.saguaro_propose(logits, SamplingParams(temperature=0.0), None,
                                        vocab_size=IDS)  # greedy draws no key
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits)[:, :IDS], -1))
    cases = [
        (dict(vocab_size=0), r"vocab_size must be in \[1, 16\]"),
        (dict(vocab_size=ROWS + 1), r"vocab_size must be in \[1, 16\]"),
        (dict(saguaro_top_n=-1), r"saguaro_top_n must be >= 0"),
        (dict(saguaro_c=0.0), r"saguaro_c must be in \(0, 1\]"),
        (dict(saguaro_c=np.asarray([0.5, 1.5, 1.0])), r"saguaro_c must be in \(0, 1\]"),
        (dict(row_dtype=jnp.int32), r"row_dtype must be floating point"),
        (dict(keys=_keys(4)), r"keys must be typed PRNG keys \[3\]"),
        (dict(logits=jnp.asarray(logits, jnp.int32)), r"logits must be floating point"),
        (dict(logits=jnp.zeros((3, 0))), r"logits must be \[..., V\] with V >= 1"),
    ]
    for bad, match in cases:
        kw = dict(logits=logits, sampling=T1, keys=_keys(3), vocab_size=IDS)
        with pytest.raises(ValueError, match=match):
            ssd_jax.saguaro_propose(**{**kw, **bad})


# ---------------------------------------------------------------------------------------------
# lookup
# ---------------------------------------------------------------------------------------------
def test_lookup_edges():
    B, MQ, K = 2, 3, 2
    keys = jnp.asarray([[[0, 4], [1, 7], [2, 9]]] * B, jnp.int32)
    toks = jnp.arange(B * MQ * K, dtype=jnp.int32).reshape(B, MQ, K) % IDS
    rows = jax.nn.one_hot(toks, ROWS)
    cache = SpeculationCache(keys=keys, tokens=toks, rows=rows, valid=jnp.ones((B, MQ), bool))
    hit, t, r = ssd_jax.lookup(cache, jnp.asarray([1, 0]), jnp.asarray([7, 5]))
    np.testing.assert_array_equal(hit, [True, False])  # outcome (0, 5): no branch, a miss
    np.testing.assert_array_equal(t[0], toks[0, 1])
    np.testing.assert_array_equal(t[1], [0, 0])
    assert float(jnp.abs(r[1]).sum()) == 0.0
    cases = [
        ((jnp.asarray([1, 0, 0]), jnp.asarray([7, 5])), r"num_accepted must be \[B\]"),
        ((jnp.asarray([1.0, 0.0]), jnp.asarray([7, 5])), r"num_accepted must hold integers"),
        ((jnp.asarray([K + 1, 0]), jnp.asarray([7, 5])), rf"num_accepted must be in \[0, {K + 1}\)"),
        ((jnp.asarray([1, 0]), jnp.asarray([7, ROWS])), rf"bonus must be in \[0, {ROWS}\)"),
        ((jnp.asarray([1, 0]), jnp.asarray([[7, 5]])), r"bonus must be \[B\]"),
    ]
    for (na, b), match in cases:
        with pytest.raises(ValueError, match=match):
            ssd_jax.lookup(cache, na, b)
    bad = dataclasses.replace(cache, rows=rows[:, :, :1])
    with pytest.raises(ValueError, match=r"cache.rows must be \[B, MQ, K, V\]"):
        ssd_jax.lookup(bad, jnp.asarray([1, 0]), jnp.asarray([7, 5]))


# ---------------------------------------------------------------------------------------------
# draft_tree
# ---------------------------------------------------------------------------------------------
def test_draft_tree_edges(model):
    B, K = 2, 2
    cfg = model.cfg
    good = dict(params=model.params, cfg=cfg,
                bonus=jnp.asarray([1, 2]), spec=jnp.asarray([[3, 4], [5, 6]]),
                n=jnp.asarray([3, 4]), active=jnp.asarray([True, True]),
                from_backup=jnp.asarray([False, True]), seed=jnp.int32(0),
                request_ids=jnp.asarray([0, 1]), sampling=T1, vocab_size=IDS,
                fanout_hit=(2, 1, 1), fanout_backup=(1, 1, 2))
    tree, _ = ssd_jax.draft_tree(cache=init_cache(cfg, B, 16), **good)  # the cache is donated
    assert tree.tokens.shape == (B, 4, K) and tree.rows.shape == (B, 4, K, ROWS)
    assert np.all(np.asarray(tree.tokens) < IDS)  # never a padded row's id
    assert np.all(np.asarray(tree.keys)[..., 1] < IDS)  # nor a padded bonus candidate
    cases = [
        (dict(spec=jnp.zeros((B, 0), jnp.int32), fanout_hit=(1,), fanout_backup=(1,)),
         r"spec must be \[B, K\] with K >= 1"),
        (dict(spec=jnp.asarray([[3.0, 4.0], [5.0, 6.0]])), r"spec must hold integers"),
        (dict(bonus=jnp.asarray([1, 2, 3])), r"bonus must be \[B\]"),
        (dict(n=jnp.asarray([3.0, 4.0])), r"n must hold integers"),
        (dict(active=jnp.asarray([1, 1])), r"active must be bool \[B\]"),
        (dict(fanout_hit=(2, 2)), r"fanout_hit must be F_0..F_K, K\+1 = 3"),
        (dict(fanout_backup=(1, -1, 4)), r"fanout_backup must be F_0..F_K"),
        (dict(fanout_backup=(1, 1, 1)), r"must have one positive sum"),
        (dict(fanout_hit=(0, 0, 0), fanout_backup=(0, 0, 0)), r"must have one positive sum"),
        (dict(saguaro_top_n=(2,)), r"saguaro_top_n must have K = 2 entries or none"),
        (dict(vocab_size=ROWS + 1), rf"vocab_size must be in \[1, {ROWS}\]"),
        (dict(row_dtype="int8"), r"row_dtype must be floating point"),
        (dict(tree_loop="while"), r"tree_loop must be one of"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            ssd_jax.draft_tree(cache=init_cache(cfg, B, 16), **{**good, **bad})


# ---------------------------------------------------------------------------------------------
# forward, tree_step, init_cache
# ---------------------------------------------------------------------------------------------
def test_forward_edges(model):
    cfg, params = model.cfg, model.params
    cache = init_cache(cfg, 2, 8)
    logits, c = ssd_jax.forward(params, cfg, jnp.asarray([[1, 2], [3, 4]]), cache,
                                jnp.asarray([2, 0]))
    assert logits.shape == (2, 2, ROWS)
    np.testing.assert_array_equal(c.lengths, [2, 0])  # num_new 0: the row writes nothing
    cases = [
        ((jnp.asarray([1, 2]), None), r"tokens must be \[B, T\]"),
        ((jnp.zeros((2, 0), jnp.int32), None), r"tokens must be \[B, T\] with T >= 1"),
        ((jnp.asarray([[1.0], [2.0]]), None), r"tokens must hold integers"),
        ((jnp.asarray([[1], [ROWS]]), None), rf"tokens must be in \[0, {ROWS}\)"),
        ((jnp.asarray([[1], [-1]]), None), rf"tokens must be in \[0, {ROWS}\)"),
        ((jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([2, 3])), r"num_new must be in \[0, 3\)"),
        ((jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([2.0, 1.0])), r"num_new must hold integers"),
        ((jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([2])), r"num_new must be \[B=2\]"),
    ]
    for (tokens, num_new), match in cases:
        with pytest.raises(ValueError, match=match):
            ssd_jax.forward(params, cfg, tokens, cache, num_new)


def test_tree_step_edges(model):
    cfg, params = model.cfg, model.params
    B, MQ, K = 1, 2, 2
    good = dict(params=params, cfg=cfg, tokens=jnp.asarray([[1, 2]]),
                positions=jnp.asarray([[3, 3]]), cache=init_cache(cfg, B, 8),
                prefix_len=jnp.asarray([[3, 3]]), branch=init_branch_kv(cfg, B, MQ, K),
                step=jnp.int32(0), valid=jnp.asarray([[True, False]]))
    logits, _ = ssd_jax.tree_step(**good)
    assert logits.shape == (B, MQ, ROWS)
    cases = [
        (dict(tokens=jnp.asarray([[1.0, 2.0]])), r"tokens must hold integers"),
        (dict(tokens=jnp.asarray([[1, ROWS]])), rf"tokens must be in \[0, {ROWS}\)"),
        (dict(positions=jnp.asarray([[3.0, 3.0]])), r"positions must hold integers"),
        (dict(step=jnp.asarray([0])), r"step must be a scalar"),
        (dict(valid=jnp.asarray([[1, 0]])), r"valid must be bool \[B, MQ\]"),
        (dict(tokens=jnp.asarray([1, 2])), r"tokens must be \[B, MQ\]"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            ssd_jax.tree_step(**{**good, **bad})


def test_init_cache_edges(model):
    c = init_cache(model.cfg, np.int64(2), 8, dtype="float32")
    assert c.k[0].shape == (2, 8, model.cfg.num_kv_heads, model.cfg.head_dim)
    for kw, match in [(dict(batch=0), "batch must be an integer >= 1"),
                      (dict(batch=2.5), "batch must be an integer >= 1"),
                      (dict(batch=True), "batch must be an integer >= 1"),
                      (dict(max_len="8"), "max_len must be an integer >= 1"),
                      (dict(max_len=-1), "max_len must be an integer >= 1"),
                      (dict(dtype="int32"), "dtype must be floating point")]:
        with pytest.raises(ValueError, match=match):
            init_cache(model.cfg, **{**dict(batch=2, max_len=8), **kw})
