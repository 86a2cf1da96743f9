"""`init_params` draws a model's weights on the device: the same pytree as `random_params` (so
every backend, the engine and `jax.jit` take it alike) and the same distribution, leaf by leaf."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import init_params, random_params
from ssd_jax.models.transformer import forward
from ssd_jax.models.kv_cache import init_cache

CONFIGS = {
    "qwen2-bias-tied": tiny_config("qwen2", vocab_size=96, tie_embeddings=True),
    "qwen3-qk-norm": tiny_config("qwen3", vocab_size=96),
    "llama-bf16": tiny_config("llama", vocab_size=96, dtype="bfloat16"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_same_pytree_shapes_and_dtypes_as_random_params(name):
    cfg = CONFIGS[name]
    a, b = init_params(cfg, jax.random.key(0)), random_params(cfg, 0)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), jax.tree_util.keystr(path)
        assert isinstance(x, jax.Array) and bool(jnp.isfinite(x.astype(jnp.float32)).all())


def test_each_leaf_follows_random_params_law():
    """Mean and spread of every leaf within a few standard errors of the NumPy draw's law, on a
    config wide enough for the moments to settle (scale 0.7 so `scale` is seen to act)."""
    cfg = tiny_config("qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
    a = init_params(cfg, jax.random.key(1), scale=0.7)
    b = random_params(cfg, 1, scale=0.7)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        se = y.std() / np.sqrt(x.size)
        assert abs(x.mean() - y.mean()) < 6 * se + 1e-12, jax.tree_util.keystr(path)
        assert abs(x.std() / y.std() - 1) < 6 / np.sqrt(x.size) + 0.02, jax.tree_util.keystr(path)
    # two keys give two models
    c = init_params(cfg, jax.random.key(2), scale=0.7)
    assert not np.array_equal(np.asarray(a.embed), np.asarray(c.embed))


def test_a_model_on_init_params_runs():
    cfg = CONFIGS["qwen2-bias-tied"]
    model = Model(cfg, init_params(cfg, jax.random.key(3)))
    cache = init_cache(cfg, 1, 16)
    tokens = jnp.arange(1, 6, dtype=jnp.int32)[None]
    logits, _ = forward(model.params, cfg, tokens, cache)
    assert logits.shape == (1, 5, cfg.vocab_size) and bool(jnp.isfinite(logits).all())
