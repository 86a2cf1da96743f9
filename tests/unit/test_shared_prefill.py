"""A batch that holds one prompt in every row (n samples of a prompt) prefills it once
(`steps.prefill_shared`, `steps.prefill_cache_shared`; `request.prefill_once` decides): the
first tokens, the KV and every later token are those of prefilling each row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm import steps
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.runtime import request
from ssd_jax.runtime.engine import Engine, SSDConfig

from _step_calls import count_step_calls

CFG = tiny_config("qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2)


def _block(B, T, plen, vocab):
    toks = np.zeros((B, T), np.int32)
    toks[:, :plen] = (np.arange(plen) * 7 + 1) % vocab
    return toks, np.full((B,), plen, np.int32)


@pytest.mark.parametrize("B", [2, 16, 300])
def test_the_shared_prefill_is_the_prefill_of_every_row(B):
    """Same first tokens (each row's own key), lengths and, to float32 rounding, the same KV and
    log-probs (the forward over one row rounds its dots as a batch of one does)."""
    params = random_params(CFG, 0)
    toks, lens = _block(B, 16, 5, CFG.vocab_size)
    sp = SamplingParams.per_request(SamplingParams(temperature=1.0), B)
    rid, seed = jnp.arange(B, dtype=jnp.int32), jnp.int32(3)
    full = steps.prefill(params, CFG, init_cache(CFG, B, 32), toks, lens, seed, rid, sp, CFG.vocab_size)
    one = steps.prefill_shared(params, CFG, init_cache(CFG, B, 32), toks[:1], lens[:1], seed, rid,
                               sp, CFG.vocab_size)
    assert np.asarray(full[0]).tolist() == np.asarray(one[0]).tolist()
    assert len(set(np.asarray(one[0]).tolist())) > 1  # the rows drew their own tokens
    np.testing.assert_allclose(np.asarray(one[1]), np.asarray(full[1]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(full[2]), jax.tree_util.tree_leaves(one[2]), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    cache = steps.prefill_cache(params, CFG, init_cache(CFG, B, 32), toks, lens)
    shared = steps.prefill_cache_shared(params, CFG, init_cache(CFG, B, 32), toks[:1], lens[:1])
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(shared), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def engine():
    target = Model(CFG, random_params(CFG, 1, scale=1.0))
    draft = Model(CFG, perturb(target.params, jax.random.key(2), 0.3))
    return Engine(target, draft, max_len=64, compilation_cache=False)


@pytest.mark.parametrize("mode,kw", [("ar", {}), ("sd", {}),
                                     ("ssd", dict(ssd=SSDConfig(fanout=(2, 1, 1, 1))))])
def test_n_samples_of_one_prompt_are_those_of_prefilling_each_row(engine, monkeypatch, mode, kw):
    prompts = [[5, 9, 2, 7, 1]] * 12
    call = dict(mode=mode, max_new_tokens=12, k=3, sampling=SamplingParams(temperature=0.9),
                seed=4, **kw)
    seen = count_step_calls(monkeypatch, ("prefill_shared", "prefill_cache_shared"))
    shared = engine.generate(prompts, **call)
    assert seen == {"prefill_shared": 1, "prefill_cache_shared": 0 if mode == "ar" else 1}
    monkeypatch.setattr(request, "one_prompt", lambda *a: False)  # both sides' rule
    each = engine.generate(prompts, **call)
    assert seen == {"prefill_shared": 1, "prefill_cache_shared": 0 if mode == "ar" else 1}
    assert shared.token_ids == each.token_ids
    assert len({tuple(t) for t in shared.token_ids}) > 1  # the samples differ from each other
    np.testing.assert_allclose(np.concatenate(shared.logprobs), np.concatenate(each.logprobs),
                               rtol=1e-5, atol=1e-5)


def test_a_batch_of_different_prompts_prefills_every_row(engine, monkeypatch):
    seen = count_step_calls(monkeypatch, ("prefill_shared", "prefill_cache_shared"))
    engine.generate([[5, 9, 2]] * 3 + [[5, 9, 3]], mode="sd", max_new_tokens=4, k=3)
    engine.generate([[5, 9, 2]], mode="sd", max_new_tokens=4, k=3)  # one row: nothing to share
    assert seen == {"prefill_shared": 0, "prefill_cache_shared": 0}
