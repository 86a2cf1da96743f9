"""Int8 weights on the CPU (models/cpu/matmul.py, layouts.TiledInt8Weight): the int8 kernel against
the exact product, its activation quantization, its row-count invariance, the tile layout, where
the cpu backend's dense dispatches to it, and the int8 model with the cpu backend against the
reference. The logical format and its quantizer are tests/unit/test_quant.py's."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import cpu
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import layouts, matmul
from ssd_jax.models.cpu.build import has_feature
from ssd_jax.models.cpu.layouts import untile_int8
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_dense
from ssd_jax.models.params import random_params
from ssd_jax.models.quant import is_quantized, quantize_params
from ssd_jax.models.transformer import forward
from ssd_jax.models.weights import Int8Weight, quantize_int8


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _kernel_reference_dense(x, w, *, transpose_w=False, preferred_element_type=None):
    """XLA's dense, but for an int8 w the sums the kernel computes (x's rows as int16)."""
    if isinstance(w, Int8Weight):
        return matmul.reference_int8(x, w.q, w.scale, preferred_element_type)
    return xla_dense(x, w, transpose_w=transpose_w, preferred_element_type=preferred_element_type)


KERNEL_REFERENCE = dataclasses.replace(XLA, name="kernel-reference", dense=_kernel_reference_dense)


@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("lead,K,N", [((1,), 1, 1), ((1,), 64, 200), ((5,), 300, 1000),
                                      ((3, 4), 17, 33), ((16,), 1536, 96), ((2, 40), 80, 3000)])
def test_int8_kernel_matches_the_exact_product(x_dtype, out_dtype, lead, K, N):
    x = _rand((*lead, K), 1).astype(x_dtype)
    qw = quantize_int8(_rand((K, N), 2))
    got = jax.jit(lambda x, q, s: matmul.kernel_int8(x, q, s, out_dtype))(x, qw.q, qw.scale)
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
    ref = matmul.reference_int8(x, qw.q, qw.scale, out_dtype)
    assert ref.dtype == out_dtype and ref.shape == got.shape
    # the reference quantizes x the same way: only the order of fp32 roundings differs
    tol = (2.0 ** -7 if out_dtype == jnp.bfloat16 else 1e-5) * float(np.max(np.abs(exact))) + 1e-30
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=0, atol=tol)


def test_quantize_rows_int16_error_bound_zero_and_non_finite_rows():
    x = _rand((4, 300), 7).at[1].set(0.0).at[2, 5].set(jnp.nan).at[3, 9].set(jnp.inf)
    xq, sx = matmul.quantize_rows_int16(x)
    assert xq.dtype == jnp.int16 and xq.shape == x.shape and sx.shape == (4, 1)
    assert int(jnp.max(jnp.abs(xq[0].astype(jnp.int32)))) == 32767
    err = np.abs(np.asarray(xq[0], np.float64) * float(sx[0, 0]) - np.asarray(x[0], np.float64))
    assert np.all(err <= float(sx[0, 0]) / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(np.asarray(xq[1]), 0)
    assert np.isfinite(float(sx[1, 0])) and np.all(np.isnan(np.asarray(sx[2:])))
    # the kernel: a zero row gives zeros, a row holding NaN or Inf gives NaN, the others are untouched
    qw = quantize_int8(_rand((300, 40), 8))
    got = np.asarray(matmul.kernel_int8(x, qw.q, qw.scale))
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.all(np.isnan(got[2:])) and np.all(np.isfinite(got[0]))
    np.testing.assert_array_equal(got[0], np.asarray(matmul.kernel_int8(x[:1], qw.q, qw.scale))[0])


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K", [300, 1100])  # 1100: three int32 chunks of at most 512 rows
def test_int8_kernel_row_is_the_same_whatever_the_row_count(x_dtype, K):
    N = 1000
    qw = quantize_int8(_rand((K, N), 3))
    x = _rand((16, K), 4).astype(x_dtype)
    f = jax.jit(lambda x: matmul.kernel_int8(x, qw.q, qw.scale))
    one = np.stack([np.asarray(f(x[m:m + 1]))[0] for m in range(16)])
    for M in (2, 5, 7, 16):
        np.testing.assert_array_equal(np.asarray(f(x[:M])), one[:M])


def test_tile_int8_round_trips_and_names_bad_shapes():
    q = quantize_int8(_rand((48, 96), 9)).q
    t = layouts.tile_int8(q)
    assert t.shape == q.shape and t.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(layouts.untile_int8(t)), np.asarray(q))
    # tile (rows 16-31, columns 64-95) is the 5th block of 512 bytes; its line 3 holds rows 22, 23,
    # column by column: byte 2 * 5 + 1 of it is row 23, column 69
    assert np.asarray(t).reshape(-1)[5 * 512 + 3 * 64 + 2 * 5 + 1] == np.asarray(q)[23, 69]
    for shape in [(40, 96), (48, 100), (16, 4128)]:
        assert not layouts.tileable(*shape)
        with pytest.raises(ValueError, match="tiled int8 q"):
            layouts.tile_int8(jnp.zeros(shape, jnp.int8))
    tw = layouts.tile_weight(quantize_int8(_rand((48, 96), 9)))
    assert isinstance(tw, layouts.TiledInt8Weight) and tw.shape == (48, 96) and tw.is_int8
    np.testing.assert_array_equal(np.asarray(tw.logical().q), np.asarray(q))
    wide = quantize_int8(_rand((16, 4128), 0))
    assert layouts.tile_weight(wide) is wide  # rows past 4 KiB stay row-major


needs_tiles = pytest.mark.skipif(not has_feature("int8_tiles"),
                                 reason="nothing is tiled here: the CPU kernel is off "
                                        "(SSD_JAX_CPU_KERNELS=0) or lacks AVX512_VNNI")


@needs_tiles
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("K,N", [(64, 32), (896, 1152), (1040, 96)])  # 1040: three int32 chunks
def test_tiled_int8_kernel_equals_the_row_major_one(K, N, M):
    w = _rand((K, N), 10)
    rm = quantize_int8(w)
    tl = layouts.tile_weight(rm)
    assert isinstance(tl, layouts.TiledInt8Weight)
    np.testing.assert_array_equal(np.asarray(tl.dequantize()), np.asarray(rm.dequantize()))
    x = _rand((M, K), 11)
    want = np.asarray(matmul.kernel_int8(x, rm.q, rm.scale))
    np.testing.assert_array_equal(np.asarray(matmul.kernel_int8(x, tl.q, tl.scale, tiled=True)), want)
    np.testing.assert_array_equal(np.asarray(cpu.dense(x, tl)), want)
    np.testing.assert_allclose(  # the reference untiles
        np.asarray(matmul.reference_int8(x, untile_int8(tl.q), tl.scale)), want,
        rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
    with pytest.raises(ValueError, match="tiled int8 q"):
        matmul.kernel_int8(x[:, :K - 8], rm.q[:K - 8], rm.scale, tiled=True)


def test_int8_kernel_errors_name_the_problem():
    qw = quantize_int8(_rand((8, 4), 0))
    x = _rand((2, 8), 1)
    with pytest.raises(ValueError, match="int8 q"):
        matmul.kernel_int8(x, qw.q.astype(jnp.int32), qw.scale)
    with pytest.raises(ValueError, match="fp32 scale"):
        matmul.kernel_int8(x, qw.q, qw.scale[:3])
    with pytest.raises(ValueError, match="contraction sizes differ"):
        matmul.kernel_int8(_rand((2, 9), 1), qw.q, qw.scale)
    with pytest.raises(ValueError, match="transpose_w does not apply"):
        cpu.dense(x, qw, transpose_w=True)
    # a prepared model is the backend's: quantize the logical params
    cfg = tiny_config("llama", vocab_size=32)
    prepared = cpu.backend().prepare(quantize_params(random_params(cfg, 0)))
    with pytest.raises(ValueError, match="already quantized|backend's layout"):
        quantize_params(prepared)
    assert is_quantized(prepared)


def test_dense_int8_dispatch_and_reference_agree():
    qw = quantize_int8(_rand((64, 32), 5))
    x = _rand((20, 64), 6)  # past MAX_ROWS: int8 is served at any row count

    def lowered(op):
        return jax.jit(lambda x: op(x, qw)).lower(x).as_text()

    assert "ssd_jax_small_m_matmul_int8" in lowered(cpu.dense)
    assert "ssd_jax_small_m_matmul_int8" not in lowered(xla_dense)
    got = np.asarray(cpu.dense(x, qw))
    np.testing.assert_allclose(got, np.asarray(matmul.reference_int8(x, qw.q, qw.scale)),
                               rtol=1e-5, atol=1e-5)
    # XLA's dense takes x unquantized: within int16's half step of each product
    sx = np.max(np.abs(np.asarray(x, np.float64)), axis=-1, keepdims=True) / 32767
    bound = sx / 2 * np.sum(np.abs(np.asarray(qw.dequantize(), np.float64)), axis=0) + 1e-5
    assert np.all(np.abs(got - np.asarray(xla_dense(x, qw))) <= bound)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_int8_forward_kernel_matches_reference_and_stays_near_the_float_model(arch, tied):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=tied)
    params = random_params(cfg, seed=1)
    qp = quantize_params(params)
    ops = cpu.backend()
    prepared = ops.prepare(qp)
    # tiling where this CPU's kernel reads it: every weight of a tiny model is narrow
    tiles = has_feature("int8_tiles")
    assert all(isinstance(lp.w_down, layouts.TiledInt8Weight if tiles else Int8Weight)
               for lp in prepared.layers)
    assert is_quantized(prepared)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "ops"))
    run = lambda p, o: fwd(p, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=o)[0]  # noqa: E731
    hlo = fwd.lower(prepared, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=ops).as_text()
    assert "ssd_jax_small_m_matmul_int8" in hlo
    got = run(prepared, ops)
    # Both quantize activations to int16 the same way; their sums differ in fp32 rounding order, and
    # a rounding that moves an activation across an int16 step moves it by 2^-16 of its row's max.
    want = run(qp, KERNEL_REFERENCE)
    rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert rel < 1e-4, rel
    # tiling moves bytes, not values: the row-major int8 model gives the same logits bit for bit
    np.testing.assert_array_equal(np.asarray(run(qp, ops)), np.asarray(got))
    xla = run(qp, XLA)
    rel = float(jnp.max(jnp.abs(got - xla)) / jnp.max(jnp.abs(xla)))
    assert rel < 1e-3, rel  # XLA's dense takes the activations unquantized
    full = run(params, XLA)
    rel = float(jnp.max(jnp.abs(got - full)) / jnp.max(jnp.abs(full)))
    assert rel < 0.05, rel  # int8 per-column weights: close, not equal
