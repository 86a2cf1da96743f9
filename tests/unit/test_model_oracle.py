"""Tiny random Llama / Qwen2 / Qwen3 decoders match HF transformers (torch, fp32) on the same weights,
for every call shape speculative decoding makes: prefill, one-token decode, a K+1-token verify at
per-sequence offsets, and a short catch-up."""
import numpy as np
import pytest

import jax.numpy as jnp

from _hf_model import empty_model, load_weights
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.params import params_from_hf, random_hf_tensors
from ssd_jax.models.transformer import forward


TOL = 1e-4  # max |Δ| / max |logit|


def hf_model(cfg, tensors):
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    return load_weights(empty_model(hf_cfg), tensors, cfg.tie_embeddings)


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


CONFIGS = {
    "llama": dict(arch="llama", vocab_size=96, tie_embeddings=True),
    "qwen2": dict(arch="qwen2", vocab_size=96),
    "qwen3": dict(arch="qwen3", vocab_size=96, num_kv_heads=1),
    "qwen2-mha": dict(arch="qwen2", vocab_size=80, num_kv_heads=4, tie_embeddings=True),
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_hf_for_every_call_shape(name):
    cfg = tiny_config(**CONFIGS[name])
    tensors = random_hf_tensors(cfg, seed=1)
    params = params_from_hf(tensors, cfg)
    model = hf_model(cfg, tensors)
    rng = np.random.default_rng(0)
    B, L = 3, 20
    seqs = rng.integers(0, cfg.vocab_size, size=(B, L))
    full = hf_logits(model, seqs)  # [B, L, V] the oracle for every prefix

    # prefill prompts of different lengths in one padded batch
    plens = np.array([7, 4, 9])
    prompt = np.zeros((B, 12), np.int64)
    for b in range(B):
        prompt[b, : plens[b]] = seqs[b, : plens[b]]
    cache = init_cache(cfg, B, 32)
    logits, cache = forward(params, cfg, jnp.asarray(prompt, jnp.int32), cache,
                            jnp.asarray(plens, jnp.int32))
    for b in range(B):
        assert rel_err(np.asarray(logits[b, : plens[b]]), full[b, : plens[b]]) <= TOL
    last, _ = forward(params, cfg, jnp.asarray(prompt, jnp.int32), init_cache(cfg, B, 32),
                      jnp.asarray(plens, jnp.int32), last_only=True)
    for b in range(B):
        assert rel_err(np.asarray(last[b]), full[b, plens[b] - 1]) <= TOL

    # one-token decode at per-sequence offsets
    step = np.array([[seqs[b, plens[b]]] for b in range(B)])
    logits, cache = forward(params, cfg, jnp.asarray(step, jnp.int32), cache, window=16)
    for b in range(B):
        assert rel_err(np.asarray(logits[b, 0]), full[b, plens[b]]) <= TOL
    pos = plens + 1

    # K+1 = 4 token verify, then roll back to a different accepted length per row
    ver = np.stack([seqs[b, pos[b]: pos[b] + 4] for b in range(B)])
    logits, cache = forward(params, cfg, jnp.asarray(ver, jnp.int32), cache)
    for b in range(B):
        assert rel_err(np.asarray(logits[b]), full[b, pos[b]: pos[b] + 4]) <= TOL
    accepted = np.array([0, 2, 3])  # verify committed b + accepted tokens
    pos = pos + 1 + accepted
    cache = cache.with_lengths(jnp.asarray(pos, jnp.int32))

    # catch-up of 2 tokens over the stale slots left by the rollback
    cu = np.stack([seqs[b, pos[b]: pos[b] + 2] for b in range(B)])
    logits, cache = forward(params, cfg, jnp.asarray(cu, jnp.int32), cache)
    for b in range(B):
        assert rel_err(np.asarray(logits[b]), full[b, pos[b]: pos[b] + 2]) <= TOL
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos + 2)


def test_bf16_forward_is_close_to_fp32():
    cfg = tiny_config(arch="qwen2")
    tensors = random_hf_tensors(cfg, seed=2)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    l32, _ = forward(params_from_hf(tensors, cfg), cfg, ids, init_cache(cfg, 2, 16))
    cfg16 = cfg.replace(dtype="bf16")
    l16, _ = forward(params_from_hf(tensors, cfg16), cfg16, ids, init_cache(cfg16, 2, 16))
    assert l16.dtype == jnp.float32
    assert rel_err(np.asarray(l16), np.asarray(l32)) < 5e-2
