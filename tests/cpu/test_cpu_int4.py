"""Int4 draft weights (models/int4.py): the tile layout, the quantizer's error bound, the kernel
against the plain-`jnp` reference, its row-count invariance and dispatch, and SD / SSD staying
exact with an int4 draft (its proposal rows are its own, so verification is unchanged)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import int4
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import decode_bytes, random_params
from ssd_jax.models.quant import Int4Weight, Int8Weight, quantize_model, quantize_params
from ssd_jax.models.transformer import forward

from _greedy_modes import assert_sd_and_ssd_match_ar

needs_kernel = pytest.mark.skipif(not int4.kernel_available(),
                                  reason="no int4 kernel here: the CPU kernel is off "
                                         "(SSD_JAX_CPU_KERNELS=0) or lacks AVX512_VNNI")


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_pack_int4_round_trips_in_the_documented_layout():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(0, 16, (64, 96)), jnp.uint8)
    scale = _rand((2, 96), 1).astype(jnp.bfloat16).astype(jnp.float32)
    offset = _rand((2, 96), 2).astype(jnp.bfloat16).astype(jnp.float32)
    tiles = int4.pack_int4(q, scale, offset)
    assert tiles.shape == (2, 3, 640) and tiles.dtype == jnp.uint8
    for got, want in zip(int4.unpack_int4(tiles), (q, scale, offset)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    t = np.asarray(tiles)
    # tile (group 1, block 2), line 3 holds rows 32 + 12 .. 32 + 15: byte 4 * 5 + 2 is row 46, whose
    # low nibble is column 64 + 5 and high nibble column 64 + 16 + 5
    byte = int(t[1, 2, 3 * 64 + 4 * 5 + 2])
    assert byte & 0x0F == int(q[46, 69]) and byte >> 4 == int(q[46, 85])
    # then the block's 32 scales and 32 offsets as little-endian bf16
    s = t[1, 2, 512:576].view(np.uint16)[7]
    assert np.uint32(s) << 16 == np.asarray(scale[1, 64 + 7]).view(np.uint32)
    o = t[1, 2, 576:640].view(np.uint16)[31]
    assert np.uint32(o) << 16 == np.asarray(offset[1, 95]).view(np.uint32)


def test_quantize_int4_error_bound_and_constant_groups():
    w = _rand((96, 64), 3).at[32:64, 5].set(0.75).at[:, 9].set(0.0)
    qw = int4.quantize_int4(w)
    assert isinstance(qw, Int4Weight) and qw.shape == (96, 64)
    q, scale, offset = (np.asarray(a, np.float64) for a in int4.unpack_int4(qw.tiles))
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
    qw = int4.quantize_int4(w)
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
    qw = int4.quantize_int4(_rand((K, N), 8))
    got = jax.jit(lambda x, t: int4.kernel_int4(x, t, out_dtype))(x, qw.tiles)
    assert got.shape == (*lead, N) and got.dtype == out_dtype
    ref = int4.reference_int4(x, qw.tiles, out_dtype)
    assert ref.dtype == out_dtype and ref.shape == got.shape
    # both quantize x the same way and sum the same integers; only fp32 rounding order differs
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    tol = (2.0 ** -7 if out_dtype == jnp.bfloat16 else 1e-5) * scale
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=0, atol=tol)


@needs_kernel
@pytest.mark.parametrize("K,N", [(896, 1152), (64, 8224), (4864, 96)])  # thread splits by group and by column
def test_int4_kernel_row_is_the_same_whatever_the_row_count(K, N):
    qw = int4.quantize_int4(_rand((K, N), 9))
    x = _rand((9, K), 10).astype(jnp.bfloat16)
    f = jax.jit(lambda x: int4.kernel_int4(x, qw.tiles))
    one = np.stack([np.asarray(f(x[m:m + 1]))[0] for m in range(9)])
    for M in (2, 4, 5, 9):
        np.testing.assert_array_equal(np.asarray(f(x[:M])), one[:M])


@needs_kernel
def test_int4_kernel_zero_and_non_finite_rows():
    x = _rand((4, 64), 11).at[1].set(0.0).at[2, 3].set(jnp.nan).at[3, 60].set(jnp.inf)
    qw = int4.quantize_int4(_rand((64, 32), 12))
    got = np.asarray(int4.kernel_int4(x, qw.tiles))
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.all(np.isnan(got[2:])) and np.all(np.isfinite(got[0]))
    np.testing.assert_array_equal(got[0], np.asarray(int4.kernel_int4(x[:1], qw.tiles))[0])


@needs_kernel
def test_matmul_int4_dispatch_and_reference_agree():
    qw = int4.quantize_int4(_rand((64, 32), 13))
    x = _rand((20, 64), 14)

    def lowered(enabled):
        return jax.jit(lambda x: int4.matmul_int4(x, qw.tiles, enabled=enabled)).lower(x).as_text()

    assert "ssd_jax_small_m_matmul_int4" in lowered(True)
    assert "ssd_jax_small_m_matmul_int4" not in lowered(False)
    np.testing.assert_allclose(np.asarray(int4.matmul_int4(x, qw.tiles)),
                               np.asarray(int4.matmul_int4(x, qw.tiles, enabled=False)),
                               rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(x @ qw.dequantize()))))


def test_int4_errors_name_the_problem():
    with pytest.raises(ValueError, match="multiples of 32"):
        int4.quantize_int4(_rand((40, 64), 0))
    with pytest.raises(ValueError, match="multiples of 32"):
        int4.quantize_int4(_rand((64, 48), 0))
    with pytest.raises(ValueError, match="pack_int4 takes"):
        int4.pack_int4(jnp.zeros((64, 32), jnp.uint8), jnp.zeros((1, 32)), jnp.zeros((2, 32)))
    qw = int4.quantize_int4(_rand((64, 32), 0))
    with pytest.raises(ValueError, match="int4 tiles are uint8"):
        int4.unpack_int4(qw.tiles[..., :600])
    with pytest.raises(ValueError, match="contraction sizes differ"):
        int4.reference_int4(_rand((2, 32), 1), qw.tiles)
    if int4.kernel_available():
        with pytest.raises(ValueError, match="contraction sizes differ"):
            int4.kernel_int4(_rand((2, 32), 1), qw.tiles)
        with pytest.raises(ValueError, match="int4 tiles are uint8"):
            int4.kernel_int4(_rand((2, 64), 1), qw.tiles.astype(jnp.int8))


def test_quantize_params_int4_layers_int8_head_and_int8_where_shapes_do_not_fit():
    cfg = tiny_config("qwen2", vocab_size=96, intermediate_size=112)  # w_down [112, 64]: not int4
    params = random_params(cfg, seed=2)
    qp = quantize_params(params, mode="int4")
    assert isinstance(qp.lm_head, Int8Weight)
    for lp in qp.layers:
        assert all(isinstance(w, Int4Weight) for w in (lp.wqkv, lp.wo, lp.w_gate_up))
        assert isinstance(lp.w_down, Int8Weight)
    # the layers' int4 weights are 5 bits each: a decode streams less than the int8 model's
    assert decode_bytes(qp) < decode_bytes(quantize_params(params))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(qp, mode="int4")


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_int4_forward_kernel_matches_reference_and_stays_near_the_float_model(arch, tied):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=tied)
    params = random_params(cfg, seed=1)
    qp = quantize_params(params, mode="int4")
    assert all(isinstance(lp.w_down, Int4Weight) for lp in qp.layers)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    fwd = jax.jit(forward, static_argnums=1)
    outs = {}
    for on in ((True, False) if int4.kernel_available() else (False,)):
        c = cfg.replace(cpu_kernels=on)
        assert ("ssd_jax_small_m_matmul_int4" in fwd.lower(qp, c, toks, init_cache(c, 2, 16)).as_text()) == on
        outs[on], _ = fwd(qp, c, toks, init_cache(c, 2, 16))
    if True in outs:
        # Both quantize activations to int8 groups the same way; their sums differ in fp32 rounding
        # order, and a rounding that moves an activation across an int8 step moves it by 1/254 of
        # its group's largest value.
        rel = float(jnp.max(jnp.abs(outs[True] - outs[False])) / jnp.max(jnp.abs(outs[False])))
        assert rel < 1e-4, rel
    full, _ = fwd(params, cfg, toks, init_cache(cfg, 2, 16))
    rel = float(jnp.max(jnp.abs(outs[False] - full)) / jnp.max(jnp.abs(full)))
    assert rel < 0.1, rel  # int4 groups of 32: close, not equal (int8: ~0.01 on these)


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
