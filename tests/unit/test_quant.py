"""Int8 and int4 draft weights (models/quant.py, the logical formats of models/weights.py): the
quantizers' error bounds, what quantize_params makes of each weight, its errors, the quantized
model staying near the float one, and SD / SSD staying exact with an int8 or int4 draft (its
proposal rows are its own, so verification is unchanged). The CPU kernels and layouts for these
formats are tests/cpu/test_cpu_int8.py's and test_cpu_int4.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import decode_bytes, random_params
from ssd_jax.models.quant import (Int4Weight, Int8Weight, is_quantized, quantize_int8, quantize_model,
                                  quantize_params)
from ssd_jax.models.transformer import forward
from ssd_jax.models.weights import quantize_int4

from _greedy_modes import assert_sd_and_ssd_match_ar


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_quantize_int8_error_bound_and_zero_columns():
    w = _rand((50, 30), 0).at[:, 7].set(0.0)
    qw = quantize_int8(w)
    assert qw.q.dtype == jnp.int8 and qw.q.shape == (50, 30)
    assert qw.scale.dtype == jnp.float32 and qw.scale.shape == (30,)
    assert int(jnp.max(jnp.abs(qw.q.astype(jnp.int32)))) == 127  # each column uses the full range
    err = np.abs(np.asarray(qw.dequantize()) - np.asarray(w))
    assert np.all(err <= np.asarray(qw.scale) / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(np.asarray(qw.dequantize())[:, 7], 0.0)
    assert np.all(np.isfinite(np.asarray(qw.scale)))


def test_quantize_int4_error_bound_and_constant_groups():
    w = _rand((96, 64), 3).at[32:64, 5].set(0.75).at[:, 9].set(0.0)
    qw = quantize_int4(w)
    assert isinstance(qw, Int4Weight) and qw.shape == (96, 64)
    q, scale, offset = (np.asarray(a, np.float64) for a in (qw.q, qw.scale, qw.offset))
    assert q.min() == 0 and q.max() == 15  # each group spans the range
    deq = np.asarray(qw.dequantize(), np.float64)
    np.testing.assert_array_equal(deq, np.repeat(scale, 32, 0) * q + np.repeat(offset, 32, 0))
    s, o = np.repeat(scale, 32, 0), np.repeat(offset, 32, 0)
    # |w - deq| <= scale / 2, plus what rounding the scale and the offset to bf16 costs at the ends
    bound = s / 2 + 15 * 2.0 ** -8 * s + 2.0 ** -8 * np.abs(o) + 1e-12
    assert np.all(np.abs(deq - np.asarray(w, np.float64)) <= bound)
    assert scale[1, 5] == 0 and np.all(deq[32:64, 5] == 0.75)  # a constant group: scale 0, exact
    np.testing.assert_array_equal(deq[:, 9], 0.0)
    assert qw.dequantize(jnp.bfloat16).dtype == jnp.bfloat16
    assert qw.q.dtype == jnp.uint8 and qw.scale.shape == qw.offset.shape == (3, 64)
    for bad in ((40, 64), (64, 48)):
        with pytest.raises(ValueError, match="multiples of 32"):
            quantize_int4(_rand(bad, 0))


def test_int8_errors_name_the_problem():
    cfg = tiny_config("llama", vocab_size=32)
    params = random_params(cfg, 0)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(quantize_params(params))
    bad = params.replace(layers=(params.layers[0].replace(wo=params.layers[0].wo.at[0, 0].set(jnp.nan)),
                                 *params.layers[1:]))
    with pytest.raises(ValueError, match=r"layers\[0\].wo contains NaN"):
        quantize_params(bad)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize_model(Model(cfg, params), "int3")
    with pytest.raises(ValueError, match="unknown quantization 'none'"):
        quantize_params(params, mode="none")
    with pytest.raises(TypeError, match="Params"):
        quantize_params({"w": 1})
    from ssd_jax.runtime.sharding import tp_layout
    with pytest.raises(ValueError, match="unquantized params"):
        tp_layout(quantize_params(params), cfg, 2)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_int8_forward_stays_near_the_float_model(arch, tied):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=tied)
    params = random_params(cfg, seed=1)
    qp = quantize_params(params)
    assert is_quantized(qp) and isinstance(qp.lm_head, Int8Weight)
    assert all(isinstance(lp.w_down, Int8Weight) for lp in qp.layers)
    # a decode streams the int8 weights, not the embedding (now only a lookup table)
    assert decode_bytes(qp) < 0.3 * decode_bytes(params)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    # logical: the q and scale of models/weights.py, no backend layout
    assert all(type(getattr(lp, n)) is Int8Weight and getattr(lp, n).q.dtype == jnp.int8
               for lp in qp.layers for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    fwd = jax.jit(forward, static_argnums=1)
    out, _ = fwd(qp, cfg, toks, init_cache(cfg, 2, 16))
    full, _ = fwd(params, cfg, toks, init_cache(cfg, 2, 16))
    rel = float(jnp.max(jnp.abs(out - full)) / jnp.max(jnp.abs(full)))
    assert rel < 0.05, rel  # int8 per-column weights: close, not equal


def test_greedy_sd_and_ssd_with_an_int8_draft_equal_plain_decoding():
    cfg = tiny_config("qwen2", vocab_size=64)
    target = Model(cfg, random_params(cfg, 0, scale=1.0), name="tiny")
    draft = quantize_model(target)
    assert draft.name == "tiny+int8" and quantize_model(draft) is draft
    assert quantize_model(target, "none") is target
    hists, _ = assert_sd_and_ssd_match_ar(target, draft, [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21]], 20)
    for mode, hist in hists.items():
        # the int8 copy agrees with its target most of the time: most rounds accept everything
        assert hist[-1] > sum(hist) / 2, (mode, hist)


def test_quantize_params_int4_layers_int8_head_and_int8_where_shapes_do_not_fit():
    cfg = tiny_config("qwen2", vocab_size=96, intermediate_size=112)  # w_down [112, 64]: not int4
    params = random_params(cfg, seed=2)
    qp = quantize_params(params, mode="int4")
    assert isinstance(qp.lm_head, Int8Weight)
    for lp in qp.layers:
        assert all(isinstance(w, Int4Weight) for w in (lp.wqkv, lp.wo, lp.w_gate_up))
        assert isinstance(lp.w_down, Int8Weight)
    # logical: one value 0..15 per uint8 (a backend packs them: tests/cpu/test_cpu_int4.py)
    assert all(int(jnp.max(lp.wqkv.q)) <= 15 and lp.wqkv.q.dtype == jnp.uint8 for lp in qp.layers)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(qp, mode="int4")


def test_greedy_sd_and_ssd_with_an_int4_draft_equal_plain_decoding():
    cfg = tiny_config("qwen2", vocab_size=64)
    target = Model(cfg, random_params(cfg, 0, scale=1.0), name="tiny")
    draft = quantize_model(target, "int4")
    assert draft.name == "tiny+int4" and quantize_model(draft, "int4") is draft
    assert isinstance(draft.params.layers[0].w_gate_up, Int4Weight)
    hists, _ = assert_sd_and_ssd_match_ar(target, draft, [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21]], 20)
    for mode, hist in hists.items():
        # the int4 copy still agrees with its target in most rounds, and disagrees in some
        assert hist[-1] > sum(hist) / 3 and hist[-1] < sum(hist), (mode, hist)
