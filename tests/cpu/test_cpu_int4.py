"""Int4 weights on the CPU (models/cpu/int4.py, layouts.Int4Tiles): the tile layout, the kernel
against the plain-`jnp` reference of its sums and against XLA's dense, its row-count invariance
and dispatch, and the int4 model with the cpu backend against the reference. The logical format
and its quantizer are tests/unit/test_quant.py's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses

from ssd_jax.models import cpu
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import int4, layouts
from ssd_jax.models.cpu.layouts import Int4Tiles, pack_int4, unpack_int4
from ssd_jax.models.cpu.matmul import reference_int8
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_dense
from ssd_jax.models.params import decode_bytes, random_params
from ssd_jax.models.quant import quantize_params
from ssd_jax.models.transformer import forward
from ssd_jax.models.weights import Int4Weight, Int8Weight, quantize_int4

needs_kernel = pytest.mark.skipif(not int4.kernel_available(),
                                  reason="no int4 kernel here: the CPU kernel is off "
                                         "(SSD_JAX_CPU_KERNELS=0) or lacks AVX512_VNNI")


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _tiles(w):
    """w [K, N] quantized to int4 and laid out as the kernel's tiles."""
    return layouts.tile_int4(quantize_int4(w))


def _kernel_reference_dense(x, w, *, transpose_w=False, preferred_element_type=None):
    """XLA's dense, but for quantized w the sums the kernels compute (activations quantized as
    theirs): what the cpu backend's dense equals up to fp32 rounding order."""
    if isinstance(w, Int4Weight):
        return int4.reference_int4(x, pack_int4(w.q, w.scale, w.offset), preferred_element_type)
    if isinstance(w, Int8Weight):
        return reference_int8(x, w.q, w.scale, preferred_element_type)
    return xla_dense(x, w, transpose_w=transpose_w, preferred_element_type=preferred_element_type)


KERNEL_REFERENCE = dataclasses.replace(XLA, name="kernel-reference", dense=_kernel_reference_dense)


def test_pack_int4_round_trips_in_the_documented_layout():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(0, 16, (64, 96)), jnp.uint8)
    scale = _rand((2, 96), 1).astype(jnp.bfloat16).astype(jnp.float32)
    offset = _rand((2, 96), 2).astype(jnp.bfloat16).astype(jnp.float32)
    tiles = pack_int4(q, scale, offset)
    assert tiles.shape == (2, 3, 640) and tiles.dtype == jnp.uint8
    assert Int4Tiles(tiles).shape == (64, 96)
    for got, want in zip(unpack_int4(tiles), (q, scale, offset)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    t = np.asarray(tiles)
    # tile (group 1, block 2), line 3 holds rows 32 + 12 .. 32 + 15: byte 4 * 5 + 2 is row 46, whose
    # low nibble is column 64 + 5 and high nibble column 64 + 16 + 5
    byte = int(t[1, 2, 3 * 64 + 4 * 5 + 2])
    assert byte & 0x0F == int(q[46, 69]) and byte >> 4 == int(q[46, 85])
    # then the block's 32 scales and 32 offsets as little-endian bf16
    back = Int4Tiles(tiles).logical()
    for got, want in zip((back.q, back.scale, back.offset), (q, scale, offset)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    s = t[1, 2, 512:576].view(np.uint16)[7]
    assert np.uint32(s) << 16 == np.asarray(scale[1, 64 + 7]).view(np.uint32)
    o = t[1, 2, 576:640].view(np.uint16)[31]
    assert np.uint32(o) << 16 == np.asarray(offset[1, 95]).view(np.uint32)


def test_quantize_groups_int8_error_bound_zero_and_non_finite_rows():
    x = _rand((4, 96), 4).at[1].set(0.0).at[2, 5].set(jnp.nan).at[3, 90].set(-jnp.inf)
    xq, sx = int4.quantize_groups_int8(x)
    assert xq.dtype == jnp.int8 and xq.shape == x.shape and sx.shape == (4, 3)
    g = np.asarray(xq[0], np.int32).reshape(3, 32)
    assert np.all(np.max(np.abs(g), axis=1) == 127)  # each group uses its full range
    err = np.abs(g * np.asarray(sx[0])[:, None] - np.asarray(x[0]).reshape(3, 32))
    assert np.all(err <= np.asarray(sx[0])[:, None] / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(np.asarray(xq[1]), 0)
    assert np.all(np.isfinite(np.asarray(sx[:2]))) and np.all(np.isnan(np.asarray(sx[2:])))


def test_reference_int4_is_the_product_of_the_dequantized_operands():
    x, w = _rand((3, 128), 5), _rand((128, 64), 6)
    qw = _tiles(w)
    got = np.asarray(int4.reference_int4(x, qw.tiles), np.float64)
    xq, sx = int4.quantize_groups_int8(x)
    xd = np.asarray(xq, np.float64).reshape(3, 4, 32) * np.asarray(sx, np.float64)[..., None]
    exact = xd.reshape(3, 128) @ np.asarray(qw.dequantize(), np.float64)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.max(np.abs(exact)))
    # and x's int8 groups cost at most half a step of each group's scale per product
    near = np.asarray(x, np.float64) @ np.asarray(qw.dequantize(), np.float64)
    step = np.repeat(np.asarray(sx, np.float64), 32, axis=1) / 2
    assert np.all(np.abs(exact - near) <= step @ np.abs(np.asarray(qw.dequantize(), np.float64)) + 1e-9)


@needs_kernel
@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("lead,K,N", [((1,), 32, 32), ((5,), 896, 1152), ((2,), 4864, 896),
                                      ((3, 3), 96, 224), ((7,), 64, 8224), ((17,), 128, 64)])
def test_int4_kernel_matches_the_reference(x_dtype, out_dtype, lead, K, N):
    x = _rand((*lead, K), 7).astype(x_dtype)
    qw = _tiles(_rand((K, N), 8))
    got = jax.jit(lambda x, t: int4.kernel_int4(x, t, out_dtype))(x, qw.tiles)
    assert got.shape == (*lead, N) and got.dtype == out_dtype
    ref = int4.reference_int4(x, qw.tiles, out_dtype)
    assert ref.dtype == out_dtype and ref.shape == got.shape
    # both quantize x the same way and sum the same integers; only fp32 rounding order differs
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    tol = (2.0 ** -7 if out_dtype == jnp.bfloat16 else 1e-5) * scale
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=0, atol=tol)
    # XLA's dense takes x unquantized: within the int8 groups' half step of each product
    xla = xla_dense(x, qw.logical(), preferred_element_type=out_dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32), rtol=0,
                               atol=2e-2 * scale + tol)


@needs_kernel
@pytest.mark.parametrize("K,N", [(896, 1152), (64, 8224), (4864, 96)])  # thread splits by group and by column
def test_int4_kernel_row_is_the_same_whatever_the_row_count(K, N):
    qw = _tiles(_rand((K, N), 9))
    x = _rand((9, K), 10).astype(jnp.bfloat16)
    f = jax.jit(lambda x: int4.kernel_int4(x, qw.tiles))
    one = np.stack([np.asarray(f(x[m:m + 1]))[0] for m in range(9)])
    for M in (2, 4, 5, 9):
        np.testing.assert_array_equal(np.asarray(f(x[:M])), one[:M])


@needs_kernel
def test_int4_kernel_zero_and_non_finite_rows():
    x = _rand((4, 64), 11).at[1].set(0.0).at[2, 3].set(jnp.nan).at[3, 60].set(jnp.inf)
    qw = _tiles(_rand((64, 32), 12))
    got = np.asarray(int4.kernel_int4(x, qw.tiles))
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.all(np.isnan(got[2:])) and np.all(np.isfinite(got[0]))
    np.testing.assert_array_equal(got[0], np.asarray(int4.kernel_int4(x[:1], qw.tiles))[0])


@needs_kernel
def test_dense_int4_dispatch_and_reference_agree():
    w = _rand((64, 32), 13)
    logical = quantize_int4(w)
    tiled = layouts.tile_int4(logical)
    x = _rand((20, 64), 14)

    def lowered(op, w):
        return jax.jit(lambda x, w: op(x, w)).lower(x, w).as_text()

    assert "ssd_jax_small_m_matmul_int4" in lowered(cpu.dense, tiled)
    assert "ssd_jax_small_m_matmul_int4" in lowered(cpu.dense, logical)  # tiled in the call
    assert "ssd_jax_small_m_matmul_int4" not in lowered(xla_dense, logical)
    got = np.asarray(cpu.dense(x, tiled))
    np.testing.assert_array_equal(np.asarray(cpu.dense(x, logical)), got)
    ref = int4.reference_int4(x, tiled.tiles)
    np.testing.assert_allclose(got, np.asarray(ref), rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(x @ logical.dequantize()))))


def test_int4_errors_name_the_problem():
    with pytest.raises(ValueError, match="pack_int4 takes"):
        pack_int4(jnp.zeros((64, 32), jnp.uint8), jnp.zeros((1, 32)), jnp.zeros((2, 32)))
    qw = _tiles(_rand((64, 32), 0))
    with pytest.raises(ValueError, match="int4 tiles are uint8"):
        unpack_int4(qw.tiles[..., :600])
    with pytest.raises(ValueError, match="contraction sizes differ"):
        int4.reference_int4(_rand((2, 32), 1), qw.tiles)
    if int4.kernel_available():
        with pytest.raises(ValueError, match="contraction sizes differ"):
            int4.kernel_int4(_rand((2, 32), 1), qw.tiles)
        with pytest.raises(ValueError, match="int4 tiles are uint8"):
            int4.kernel_int4(_rand((2, 64), 1), qw.tiles.astype(jnp.int8))


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_int4_forward_kernel_matches_reference_and_stays_near_the_float_model(arch, tied):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=tied)
    params = random_params(cfg, seed=1)
    qp = quantize_params(params, mode="int4")
    assert all(isinstance(lp.w_down, Int4Weight) for lp in qp.layers)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "ops"))
    ops = cpu.backend()
    prepared = ops.prepare(qp)
    kernel = int4.kernel_available()
    assert all(isinstance(lp.w_down, Int4Tiles if kernel else Int4Weight) for lp in prepared.layers)
    hlo = fwd.lower(prepared, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=ops).as_text()
    assert ("ssd_jax_small_m_matmul_int4" in hlo) == kernel
    if kernel:  # the tiles are 5 bits a weight: a decode streams less than the int8 model's
        assert decode_bytes(prepared) < decode_bytes(ops.prepare(quantize_params(params)))
    got, _ = fwd(prepared, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=ops)
    want, _ = fwd(qp, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=KERNEL_REFERENCE)
    xla, _ = fwd(qp, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=XLA)
    if kernel:
        # Both quantize activations to int8 groups the same way; their sums differ in fp32 rounding
        # order, and a rounding that moves an activation across an int8 step moves it by 1/254 of
        # its group's largest value.
        rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        assert rel < 1e-4, rel
    else:  # int4 stays logical and is XLA's dense; the backend's other kernels (the attention,
        # the fp32 matmuls of a CPU without AVX512-VNNI) sum in their own fp32 order
        rel = float(jnp.max(jnp.abs(got - xla)) / jnp.max(jnp.abs(xla)))
        assert rel < 1e-4, rel
    rel = float(jnp.max(jnp.abs(got - xla)) / jnp.max(jnp.abs(xla)))
    assert rel < 2e-2, rel  # XLA's dense takes the activations unquantized
    full, _ = fwd(params, cfg=cfg, tokens=toks, cache=init_cache(cfg, 2, 16), ops=XLA)
    rel = float(jnp.max(jnp.abs(got - full)) / jnp.max(jnp.abs(full)))
    assert rel < 0.1, rel  # int4 groups of 32: close, not equal (int8: ~0.01 on these)
