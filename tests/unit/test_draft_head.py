"""A draft head cut to ids [0, n) (models/draft_head.py): the logits it keeps, -inf past them, every
logical head form (float, tied, int8), exact SD and SSD with it, and errors that name the
problem (the cpu backend's layouts of a cut head: tests/cpu/test_cpu_layouts.py). Its distribution exactness at temperature > 0 is in tests/statistical/test_engine_exactness.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.draft_head import head_width, prepare_draft, truncate_head, truncate_model_head
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import random_params
from ssd_jax.models.quant import Int8Weight, quantize_params
from ssd_jax.models.transformer import forward
from ssd_jax.runtime.engine import Engine

from _greedy_modes import assert_sd_and_ssd_match_ar

V, N = 64, 24


def _logits(params, cfg, seed=0):
    toks = jax.random.randint(jax.random.key(seed), (2, 5), 0, cfg.vocab_size)
    return np.asarray(forward(params, cfg, toks, init_cache(cfg, 2, 16))[0])


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True), ("qwen3", True)])
def test_cut_head_keeps_the_first_n_logits_and_scores_the_rest_minus_inf(arch, tied):
    cfg = tiny_config(arch, vocab_size=V, tie_embeddings=tied)
    params = random_params(cfg, 1)
    cut = truncate_head(params, N)
    assert head_width(params) == V and head_width(cut) == N
    assert cut.lm_head.shape == (cfg.hidden_size, N)
    np.testing.assert_array_equal(np.asarray(cut.embed), np.asarray(params.embed))  # lookups stay whole
    full, got = _logits(params, cfg), _logits(cut, cfg)
    assert got.shape == full.shape
    np.testing.assert_allclose(got[..., :N], full[..., :N], rtol=1e-5, atol=1e-5)
    assert np.all(got[..., N:] == -np.inf)
    assert truncate_head(params, V).lm_head.shape == (cfg.hidden_size, V)


def test_cutting_an_int8_head_equals_quantizing_a_cut_head():
    # per-column scales: the kept columns quantize the same either way, bit for bit
    cfg = tiny_config("qwen2", vocab_size=V)
    params = random_params(cfg, 2)
    a = truncate_head(quantize_params(params), N)
    b = quantize_params(truncate_head(params, N))
    assert isinstance(a.lm_head, Int8Weight) and head_width(a) == N
    np.testing.assert_array_equal(np.asarray(a.lm_head.q), np.asarray(b.lm_head.q))
    np.testing.assert_array_equal(np.asarray(a.lm_head.scale), np.asarray(b.lm_head.scale))
    np.testing.assert_array_equal(_logits(a, cfg), _logits(b, cfg))


def test_bad_cuts_name_the_problem():
    cfg = tiny_config("qwen2", vocab_size=V)
    model = Model(cfg, random_params(cfg, 0), name="tiny")
    for bad in (0, V + 1, -3, True, 2.5):
        with pytest.raises(ValueError, match=r"must be an int in \[1, 64\]"):
            truncate_head(model.params, bad)
    with pytest.raises(ValueError, match="cannot be widened"):
        truncate_head(truncate_head(model.params, N), N + 1)
    with pytest.raises(TypeError, match="Params"):
        truncate_head({"lm_head": None}, N)
    laid_out = model.params.replace(lm_head=type("Layout", (), {"shape": (32, V)})())
    with pytest.raises(TypeError, match="backend's layout.*before the backend's `prepare`"):
        truncate_head(laid_out, N)
    cut = truncate_model_head(model, N)
    assert cut.name == f"tiny+head{N}" and truncate_model_head(cut, N) is cut
    assert truncate_model_head(model, V) is model
    with pytest.raises(ValueError, match="target's head scores only 24 of 64"):
        Engine(cut, model, compilation_cache=False)


def test_greedy_sd_and_ssd_with_a_cut_int8_draft_equal_plain_decoding():
    # draft = the target with its head cut to 24 of 64 ids: whenever the target's next token is
    # >= 24 the draft cannot propose it, so it is rejected and the token comes from the residual.
    cfg = tiny_config("qwen2", vocab_size=V)
    target = Model(cfg, random_params(cfg, 0, scale=1.0), name="tiny")
    draft = prepare_draft(target, "int8", N)
    assert draft.name == f"tiny+head{N}+int8" and head_width(draft.params) == N
    hists, want = assert_sd_and_ssd_match_ar(target, draft, [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21]], 24)
    assert any(t >= N for w in want for t in w), "the test needs target tokens the draft cannot propose"
    for mode, hist in hists.items():
        assert hist[0] > 0 and hist[-1] > 0, (mode, hist)  # rejections (cut ids) and full accepts


def test_proposal_rows_of_a_cut_draft_are_zero_past_the_cut():
    from ssd_jax.algorithm.sampling import SamplingParams, probs_from_logits

    cfg = tiny_config("qwen2", vocab_size=V)
    cut = truncate_head(random_params(cfg, 4), N)
    rows = probs_from_logits(jnp.asarray(_logits(cut, cfg)), SamplingParams(temperature=1.0), V)
    assert np.all(np.asarray(rows)[..., N:] == 0.0)
    np.testing.assert_allclose(np.asarray(rows).sum(-1), 1.0, rtol=1e-5)


def test_load_draft_cuts_then_quantizes_logical_weights(tmp_path):
    import json

    from safetensors.numpy import save_file

    from ssd_jax.models.load import load_draft
    from ssd_jax.models.params import random_hf_tensors

    cfg = tiny_config("qwen2", vocab_size=256)
    save_file(random_hf_tensors(cfg, 0), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    kw = dict(use_cache=False, with_tokenizer=False)
    d = load_draft(tmp_path, "bfloat16", "int8", 96, **kw)
    assert isinstance(d.params.lm_head, Int8Weight) and head_width(d.params) == 96
    assert type(d.params.lm_head) is Int8Weight and d.name.endswith("+head96+int8")
    plain = load_draft(tmp_path, "bfloat16", **kw)
    assert head_width(plain.params) == 256
    # logical: arrays, for a backend's prepare to lay out
    assert all(isinstance(getattr(lp, n), jax.Array) for lp in plain.params.layers
               for n in ("wqkv", "wo", "w_gate_up", "w_down"))
