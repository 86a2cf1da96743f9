"""A miss in one row does not re-draft the rows that hit (issue: the neural backup rewrote every
row's draft KV): `draft_chain(..., draft_rows=)` leaves the other rows' cache exactly as it was,
and a request's tokens at temperature 1 are the same alone and beside a companion that misses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm import steps
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.runtime.engine import Engine, SSDConfig

from _tiny import padded_draft, padded_model

IDS = 64
MODEL = padded_model(tiny_config("qwen2", vocab_size=IDS))
CFG = MODEL.cfg  # IDS ids in IDS + PAD rows


def test_draft_chain_leaves_the_rows_it_does_not_draft_untouched():
    params = MODEL.params
    cache = init_cache(CFG, 2, 32)
    # row 1 holds values no forward writes: any write to it shows
    cache = cache.replace(k=tuple(k.at[1].set(7.0) for k in cache.k),
                          v=tuple(v.at[1].set(-3.0) for v in cache.v),
                          lengths=jnp.asarray([6, 11], jnp.int32))
    args = (jnp.asarray([3, 4]), jnp.asarray([5, 6]), jnp.asarray([6, 9]), jnp.int32(0),
            jnp.asarray([0, 1]), SamplingParams(temperature=1.0), IDS, 3)
    want_tok, want_rows, _ = steps.draft_chain(params, CFG, jax.tree_util.tree_map(jnp.copy, cache), *args)
    tok, rows, got = steps.draft_chain(params, CFG, jax.tree_util.tree_map(jnp.copy, cache), *args,
                                       draft_rows=jnp.asarray([True, False]))
    np.testing.assert_array_equal(np.asarray(tok[0]), np.asarray(want_tok[0]))
    np.testing.assert_array_equal(np.asarray(rows[0]), np.asarray(want_rows[0]))
    assert np.all(np.asarray(tok) < IDS) and not np.any(np.asarray(rows)[..., IDS:])
    assert int(got.lengths[1]) == 11 and int(got.lengths[0]) == 6 + 3  # KV at n-1..n+K-1
    for k, v in zip(got.k, got.v):
        assert bool(jnp.all(k[1] == 7.0)) and bool(jnp.all(v[1] == -3.0))


@pytest.fixture(scope="module")
def pair():
    target = padded_model(tiny_config("qwen2", vocab_size=IDS), 0, scale=1.0)
    return target, padded_draft(target, 1, 0.5)


def test_a_request_alone_and_beside_a_companion_that_misses(pair):
    target, draft = pair
    eng = Engine(target, draft, compilation_cache=False)
    kw = dict(mode="ssd", k=3, max_new_tokens=24, sampling=SamplingParams(temperature=1.0),
              ssd=SSDConfig(fanout=(2, 1, 1, 1)), seed=4)
    mine = [1, 2, 3, 4, 5]
    alone = eng.generate([mine], request_ids=[5], **kw)
    together = eng.generate([mine, [30, 31, 32]], request_ids=[5, 9], **kw)
    assert together.metrics.backups.get("neural", 0) > alone.metrics.backups.get("neural", 0)
    assert together.token_ids[0] == alone.token_ids[0]
