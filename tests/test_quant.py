"""Int8 draft weights (models/quant.py): the quantizer's error bound, the int8 CPU kernel against
the exact product, its row-count invariance and dispatch, and SD / SSD staying exact with an int8
draft (its proposal rows are its own, so verification is unchanged)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import cpu_matmul
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import decode_bytes, random_params
from ssd_jax.models.quant import Int8Weight, is_quantized, quantize_int8, quantize_model, quantize_params
from ssd_jax.models.transformer import forward

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


@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("lead,K,N", [((1,), 1, 1), ((1,), 64, 200), ((5,), 300, 1000),
                                      ((3, 4), 17, 33), ((16,), 1536, 96), ((2, 40), 80, 3000)])
def test_int8_kernel_matches_the_exact_product(x_dtype, out_dtype, lead, K, N):
    x = _rand((*lead, K), 1).astype(x_dtype)
    qw = quantize_int8(_rand((K, N), 2))
    got = jax.jit(lambda x, q, s: cpu_matmul.kernel_int8(x, q, s, out_dtype))(x, qw.q, qw.scale)
    assert got.shape == (*lead, N) and got.dtype == out_dtype
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    q64, s64 = np.asarray(qw.q, np.float64), np.asarray(qw.scale, np.float64)
    exact = (x64 @ q64) * s64
    # x's rows as int16 (|x - xq * sx| <= sx / 2, sx = max|x| / 32767), K fp32 roundings of the
    # running sum, then one for the scale (and one to bf16 if asked)
    sx = np.max(np.abs(x64), axis=-1, keepdims=True) / 32767
    bound = ((sx / 2 + K * 2.0 ** -24 * np.abs(x64)) @ np.abs(q64) + 2.0 ** -24 * np.abs(x64 @ q64)) * s64
    if out_dtype == jnp.bfloat16:
        bound = bound + 2.0 ** -8 * np.abs(exact)
    assert np.all(np.abs(np.asarray(got.astype(jnp.float32), np.float64) - exact) <= bound + 1e-30)
    ref = cpu_matmul.reference_int8(x, qw.q, qw.scale, out_dtype)
    assert ref.dtype == out_dtype and ref.shape == got.shape
    # the reference quantizes x the same way: only the order of fp32 roundings differs
    tol = (2.0 ** -7 if out_dtype == jnp.bfloat16 else 1e-5) * float(np.max(np.abs(exact))) + 1e-30
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=0, atol=tol)


def test_quantize_rows_int16_error_bound_zero_and_non_finite_rows():
    x = _rand((4, 300), 7).at[1].set(0.0).at[2, 5].set(jnp.nan).at[3, 9].set(jnp.inf)
    xq, sx = cpu_matmul.quantize_rows_int16(x)
    assert xq.dtype == jnp.int16 and xq.shape == x.shape and sx.shape == (4, 1)
    assert int(jnp.max(jnp.abs(xq[0].astype(jnp.int32)))) == 32767
    err = np.abs(np.asarray(xq[0], np.float64) * float(sx[0, 0]) - np.asarray(x[0], np.float64))
    assert np.all(err <= float(sx[0, 0]) / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(np.asarray(xq[1]), 0)
    assert np.isfinite(float(sx[1, 0])) and np.all(np.isnan(np.asarray(sx[2:])))
    # the kernel: a zero row gives zeros, a row holding NaN or Inf gives NaN, the others are untouched
    qw = quantize_int8(_rand((300, 40), 8))
    got = np.asarray(cpu_matmul.kernel_int8(x, qw.q, qw.scale))
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.all(np.isnan(got[2:])) and np.all(np.isfinite(got[0]))
    np.testing.assert_array_equal(got[0], np.asarray(cpu_matmul.kernel_int8(x[:1], qw.q, qw.scale))[0])


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K", [300, 1100])  # 1100: three int32 chunks of at most 512 rows
def test_int8_kernel_row_is_the_same_whatever_the_row_count(x_dtype, K):
    N = 1000
    qw = quantize_int8(_rand((K, N), 3))
    x = _rand((16, K), 4).astype(x_dtype)
    f = jax.jit(lambda x: cpu_matmul.kernel_int8(x, qw.q, qw.scale))
    one = np.stack([np.asarray(f(x[m:m + 1]))[0] for m in range(16)])
    for M in (2, 5, 7, 16):
        np.testing.assert_array_equal(np.asarray(f(x[:M])), one[:M])


def test_tile_int8_round_trips_and_names_bad_shapes():
    q = quantize_int8(_rand((48, 96), 9)).q
    t = cpu_matmul.tile_int8(q)
    assert t.shape == q.shape and t.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(cpu_matmul.untile_int8(t)), np.asarray(q))
    # tile (rows 16-31, columns 64-95) is the 5th block of 512 bytes; its line 3 holds rows 22, 23,
    # column by column: byte 2 * 5 + 1 of it is row 23, column 69
    assert np.asarray(t).reshape(-1)[5 * 512 + 3 * 64 + 2 * 5 + 1] == np.asarray(q)[23, 69]
    for shape in [(40, 96), (48, 100), (16, 4128)]:
        assert not cpu_matmul.tileable(*shape)
        with pytest.raises(ValueError, match="tiled int8 q"):
            cpu_matmul.tile_int8(jnp.zeros(shape, jnp.int8))
    with pytest.raises(ValueError, match="tiled int8 q"):
        quantize_int8(_rand((40, 96), 0), tiled=True)


needs_tiles = pytest.mark.skipif(not cpu_matmul.int8_tiles(),
                                 reason="nothing is tiled here: the CPU kernel is off "
                                        "(SSD_JAX_CPU_KERNELS=0) or lacks AVX512_VNNI")


@needs_tiles
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("K,N", [(64, 32), (896, 1152), (1040, 96)])  # 1040: three int32 chunks
def test_tiled_int8_kernel_equals_the_row_major_one(K, N, M):
    w = _rand((K, N), 10)
    rm, tl = quantize_int8(w), quantize_int8(w, tiled=True)
    assert tl.tiled and not rm.tiled
    np.testing.assert_array_equal(np.asarray(tl.dequantize()), np.asarray(rm.dequantize()))
    x = _rand((M, K), 11)
    want = np.asarray(cpu_matmul.kernel_int8(x, rm.q, rm.scale))
    np.testing.assert_array_equal(np.asarray(cpu_matmul.kernel_int8(x, tl.q, tl.scale, tiled=True)), want)
    np.testing.assert_allclose(  # the reference untiles
        np.asarray(cpu_matmul.matmul_int8(x, tl.q, tl.scale, tiled=True, enabled=False)), want,
        rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
    with pytest.raises(ValueError, match="tiled int8 q"):
        cpu_matmul.kernel_int8(x[:, :K - 8], rm.q[:K - 8], rm.scale, tiled=True)


def test_matmul_int8_dispatch_and_reference_agree():
    qw = quantize_int8(_rand((64, 32), 5))
    x = _rand((20, 64), 6)  # past MAX_ROWS: int8 is served at any row count

    def lowered(enabled):
        return jax.jit(lambda x: cpu_matmul.matmul_int8(x, qw.q, qw.scale, enabled=enabled)).lower(x).as_text()

    assert "ssd_jax_small_m_matmul_int8" in lowered(True)
    assert "ssd_jax_small_m_matmul_int8" not in lowered(False)
    np.testing.assert_allclose(np.asarray(cpu_matmul.matmul_int8(x, qw.q, qw.scale)),
                               np.asarray(cpu_matmul.matmul_int8(x, qw.q, qw.scale, enabled=False)),
                               rtol=1e-5, atol=1e-5)


def test_int8_errors_name_the_problem():
    qw = quantize_int8(_rand((8, 4), 0))
    x = _rand((2, 8), 1)
    with pytest.raises(ValueError, match="int8 q"):
        cpu_matmul.kernel_int8(x, qw.q.astype(jnp.int32), qw.scale)
    with pytest.raises(ValueError, match="fp32 scale"):
        cpu_matmul.kernel_int8(x, qw.q, qw.scale[:3])
    with pytest.raises(ValueError, match="contraction sizes differ"):
        cpu_matmul.kernel_int8(_rand((2, 9), 1), qw.q, qw.scale)
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
def test_int8_forward_kernel_matches_reference_and_stays_near_the_float_model(arch, tied):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=tied)
    params = random_params(cfg, seed=1)
    qp = quantize_params(params)
    assert is_quantized(qp) and isinstance(qp.lm_head, Int8Weight)
    assert all(isinstance(lp.w_down, Int8Weight) for lp in qp.layers)
    # a decode streams the int8 weights, not the embedding (now only a lookup table)
    assert decode_bytes(qp) < 0.3 * decode_bytes(params)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    fwd = jax.jit(forward, static_argnums=1)
    outs = {}
    for on in (True, False):
        c = cfg.replace(cpu_kernels=on)
        assert ("ssd_jax_small_m_matmul_int8" in fwd.lower(qp, c, toks, init_cache(c, 2, 16)).as_text()) == on
        outs[on], _ = fwd(qp, c, toks, init_cache(c, 2, 16))
    # Both quantize activations to int16 the same way; their sums differ in fp32 rounding order, and
    # a rounding that moves an activation across an int16 step moves it by 2^-16 of its row's max.
    rel = float(jnp.max(jnp.abs(outs[True] - outs[False])) / jnp.max(jnp.abs(outs[False])))
    assert rel < 1e-4, rel
    # tiling (where this CPU's kernel reads it: every weight of a tiny model is narrow) moves bytes,
    # not values: the row-major int8 model gives the same logits bit for bit
    assert all(lp.w_down.tiled == cpu_matmul.int8_tiles() for lp in qp.layers)
    rm = quantize_params(params, tile=False)
    assert not any(lp.wo.tiled for lp in rm.layers)
    np.testing.assert_array_equal(np.asarray(fwd(rm, cfg, toks, init_cache(cfg, 2, 16))[0]),
                                  np.asarray(outs[True]))
    full, _ = fwd(params, cfg, toks, init_cache(cfg, 2, 16))
    rel = float(jnp.max(jnp.abs(outs[True] - full)) / jnp.max(jnp.abs(full)))
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
