"""The cpu backend's layouts (models/cpu/layouts.py) and `prepare`: packed bf16 strips
(kernels/bf16_strips.h): the layout's round trip, the packed kernel against the row-major one and
the exact product, its row-count invariance, its dispatch and errors; prepare's layouts (packed,
tiled, int4 tiles, the untied head) and their round trip back to the logical params; a prepared
model giving the same logits and greedy tokens."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import cpu, registry
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import layouts, matmul
from ssd_jax.models.cpu.build import has_feature
from ssd_jax.models.cpu.layouts import (Int4Tiles, PackedWeight, TiledInt8Weight, is_prepared,
                                        pack_weight, prepare, to_logical)
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.load import load_model
from ssd_jax.models.ops import XLA, xla_dense
from ssd_jax.models.params import decode_bytes, random_params
from ssd_jax.models.quant import quantize_params
from ssd_jax.models.transformer import forward
from ssd_jax.models.weights import Int4Weight, Int8Weight
from ssd_jax.algorithm.near_tie import assert_greedy_agreement


def _rand(shape, seed, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


needs_strips = pytest.mark.skipif(not has_feature("bf16_strips"),
                                  reason="nothing is packed here: the CPU kernel is off "
                                         "(SSD_JAX_CPU_KERNELS=0) or lacks AVX512_BF16")


def test_pack_bf16_round_trips_and_names_bad_shapes():
    w = _rand((6, 96), 0)
    p = layouts.pack_bf16(w)
    assert p.shape == w.shape and p.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(layouts.unpack_bf16(p)), np.asarray(w))
    # strip 1, pair 2, second half, column 3, odd row: w[2*2 + 1, 32 + 16 + 3], at flat index
    # ((1 * 3 + 2) * 2 + 1) * 32 + 3 * 2 + 1 in strip order
    assert p.reshape(-1)[((1 * 3 + 2) * 2 + 1) * 32 + 7] == w[5, 51]
    assert layouts.packable(2, 32) and not layouts.packable(3, 32)
    assert not layouts.packable(4, 48) and not layouts.packable(0, 32)
    for bad in ((3, 32), (4, 48), (4,)):
        with pytest.raises(ValueError, match="K even and N a multiple of 32"):
            layouts.pack_bf16(jnp.zeros(bad, jnp.bfloat16))
    assert not isinstance(pack_weight(jnp.zeros((4, 48), jnp.bfloat16)), PackedWeight)  # left as is
    assert not isinstance(pack_weight(jnp.zeros((4, 64), jnp.float32)), PackedWeight)  # fp32: as is
    assert isinstance(pack_weight(jnp.zeros((4, 64), jnp.bfloat16)), PackedWeight)


@needs_strips
@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("K,N", [(16, 96), (24, 1536), (2056, 8288)])
def test_packed_kernel_equals_the_row_major_one(K, N, M):
    # These shapes the row-major kernel sums over all of K in one range on any thread count (K
    # under 32 rows, or N past 8192 columns), as the packed one always does, and all with
    # vdpbf16ps (K a multiple of its 8 rows a pass): the same sequence, so equal bit for bit. 2056 x 8288: 259 strips (not a multiple of 2 or 4) and 1028
    # pairs, past one K-block for the 40-row prefill.
    w, x = _rand((K, N), 1), _rand((M, K), 2)
    got = matmul.kernel(x, layouts.pack_bf16(w), packed=True, out_dtype=jnp.float32)
    want = matmul.kernel(x, w, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@needs_strips
@pytest.mark.parametrize("lead,K,N", [((1,), 8960, 1536), ((5,), 1536, 2048), ((3, 4), 64, 96),
                                      ((2, 20), 2050, 160)])
def test_packed_kernel_matches_the_exact_product_and_every_row_count(lead, K, N):
    w, x = _rand((K, N), 3), _rand((*lead, K), 4)
    wp = layouts.pack_bf16(w)
    got = np.asarray(matmul.kernel(x, wp, packed=True, out_dtype=jnp.float32), np.float64)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = K * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))  # products of bf16 are exact in fp32
    assert np.all(np.abs(got - x64 @ w64) <= bound + 1e-30)
    rows = x.reshape(-1, K)
    one = np.concatenate([np.asarray(matmul.kernel(rows[i:i + 1], wp, packed=True,
                                                       out_dtype=jnp.float32))
                          for i in range(rows.shape[0])])
    np.testing.assert_array_equal(got.reshape(-1, N), one)  # a row is the same whatever M


@needs_strips
def test_packed_matmul_dispatch_and_its_reference():
    w, x = _rand((64, 96), 5), _rand((5, 64), 6)
    wp = layouts.pack_bf16(w)
    f = jax.jit(lambda x, w: cpu.dense(x, w))
    assert "ssd_jax_small_m_matmul" in f.lower(x, PackedWeight(wp)).as_text()
    # where the kernel does not serve (fp16 x here), the packed w is unpacked, then XLA's dense
    xh = x.astype(jnp.float16)
    off = cpu.dense(xh, PackedWeight(wp), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(
        xla_dense(xh, w, preferred_element_type=jnp.float32)))
    want = xla_dense(x, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(f(x, PackedWeight(wp)), np.float32), np.asarray(want),
                               rtol=1e-2, atol=1e-2)


@needs_strips
def test_packed_kernel_errors_name_the_problem():
    w, x = _rand((64, 96), 5), _rand((5, 64), 6)
    wp = layouts.pack_bf16(w)
    with pytest.raises(ValueError, match="bf16 x and no transpose"):
        matmul.kernel(x.astype(jnp.float32), wp.astype(jnp.float32), packed=True)
    with pytest.raises(ValueError, match="K even and N a multiple of 32"):
        matmul.kernel(_rand((5, 64), 6), _rand((64, 80), 5), packed=True)
    with pytest.raises(ValueError, match="bf16 x and no transpose"):
        matmul.kernel(x, jnp.zeros((96, 64), jnp.bfloat16), transpose_w=True, packed=True)


def _tiny(arch="qwen2", seed=7):
    cfg = tiny_config(arch, vocab_size=96, dtype="bfloat16")
    return cfg, random_params(cfg, seed=seed)


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_prepare_lays_out_bf16_and_round_trips_to_the_logical_params():
    cfg, params = _tiny()
    prepared = prepare(params)
    strips = has_feature("bf16_strips")
    assert is_prepared(prepared) == strips and not is_prepared(params)
    assert all(isinstance(getattr(lp, n), PackedWeight) == strips for lp in prepared.layers
               for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(prepared.lm_head, PackedWeight) == strips
    assert prepared.embed is params.embed and prepared.layers[0].attn_norm is params.layers[0].attn_norm
    assert decode_bytes(prepared) == decode_bytes(params)
    _leaves_equal(to_logical(prepared), params)
    _leaves_equal(prepare(prepared), prepared)  # prepared once: a second pass changes nothing
    fp32 = random_params(tiny_config("qwen2", vocab_size=96), seed=7)
    assert not is_prepared(prepare(fp32))  # the kernel packs bf16 only
    _leaves_equal(prepare(fp32), fp32)
    assert cpu.backend().prepare is prepare
    # quantizing starts from the logical values: the prepared model's, given back, are the same
    _leaves_equal(quantize_params(to_logical(prepared)), quantize_params(params))


def test_prepare_unties_a_tied_head():
    cfg = tiny_config("llama", vocab_size=96, tie_embeddings=True, dtype="bfloat16")
    params = random_params(cfg, seed=2)
    assert params.lm_head is None
    prepared = prepare(params)
    head = prepared.lm_head.unpack() if isinstance(prepared.lm_head, PackedWeight) else prepared.lm_head
    np.testing.assert_array_equal(np.asarray(head), np.asarray(params.embed).T)
    assert to_logical(prepared).lm_head is not None  # the untied head is a logical head too


def test_prepare_lays_out_quantized_weights_where_the_kernels_read_them():
    cfg = tiny_config("qwen2", vocab_size=96)
    params = random_params(cfg, seed=3)
    for mode, layout, feature in (("int8", TiledInt8Weight, "int8_tiles"),
                                  ("int4", Int4Tiles, "int4")):
        qp = quantize_params(params, mode=mode)
        prepared = prepare(qp)
        logical = Int8Weight if mode == "int8" else Int4Weight
        want = layout if has_feature(feature) else logical
        assert all(type(lp.wo) is want for lp in prepared.layers), (mode, type(prepared.layers[0].wo))
        head = TiledInt8Weight if has_feature("int8_tiles") else Int8Weight
        assert type(prepared.lm_head) is head  # the head stays int8 (tiled where narrow)
        _leaves_equal(to_logical(prepared), qp)
        for lp, lq in zip(prepared.layers, qp.layers):
            np.testing.assert_array_equal(np.asarray(lp.wo.dequantize()), np.asarray(lq.wo.dequantize()))
    wide = quantize_params(random_params(tiny_config("qwen2", vocab_size=4160), seed=3))
    assert type(prepare(wide).lm_head) is Int8Weight  # a head wider than 4096 columns: row-major


@needs_strips
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_model_logits_and_a_verify_equal_to_its_decodes(arch):
    cfg, params = _tiny(arch)
    ops = cpu.backend()
    packed = ops.prepare(params)
    assert isinstance(packed.layers[0].wqkv, PackedWeight)
    fwd = jax.jit(functools.partial(forward, ops=ops), static_argnums=1)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 9)), jnp.int32)
    want, _ = jax.jit(forward, static_argnums=1)(params, cfg, toks, init_cache(cfg, 2, 16))  # XLA
    got, _ = fwd(packed, cfg, toks, init_cache(cfg, 2, 16))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)  # bf16 activations; sums in another split
    # a 5-token verify after a 4-token prefill equals five one-token decodes, bit for bit
    _, cache = fwd(packed, cfg, toks[:, :4], init_cache(cfg, 2, 16))
    verify, _ = fwd(packed, cfg, toks[:, 4:], cache)
    steps = []
    for t in range(4, 9):
        lg, cache = fwd(packed, cfg, toks[:, t:t + 1], cache)
        steps.append(lg)
    np.testing.assert_array_equal(np.asarray(verify), np.asarray(jnp.concatenate(steps, axis=1)))


@pytest.mark.slow
@needs_strips
def test_smollm2_bf16_prepared_decodes_the_same_tokens():
    registry.fetch("smollm2-135m", progress=False)
    from ssd_jax.runtime.engine import Engine
    plain = load_model("smollm2-135m", "bfloat16")
    assert not is_prepared(plain.params)  # load_model gives logical params
    assert is_prepared(prepare(plain.params))
    ids = [plain.tokenizer.encode(p) for p in ("def quicksort(arr):\n", "The capital of France is")]
    got = Engine(plain, None, backend="cpu").generate(ids, mode="ar", max_new_tokens=24,
                                                      eos_ids=[]).token_ids
    want = Engine(plain, None, backend="xla").generate(ids, mode="ar", max_new_tokens=24,
                                                       eos_ids=[]).token_ids
    for p, g, w in zip(ids, got, want):
        assert_greedy_agreement(plain.params, plain.cfg, p, g, w)


def test_a_cut_head_is_cut_logical_then_laid_out():
    from ssd_jax.models.draft_head import head_width, truncate_head
    cfg = tiny_config("qwen2", vocab_size=256, dtype="bfloat16")
    params = random_params(cfg, 3)
    ops = cpu.backend()
    cut = ops.prepare(truncate_head(params, 96))
    assert head_width(cut) == 96
    assert isinstance(cut.lm_head, PackedWeight) == has_feature("bf16_strips")
    if isinstance(cut.lm_head, PackedWeight):
        with pytest.raises(TypeError, match="before the backend's `prepare`"):
            truncate_head(cut, 64)
    np.testing.assert_array_equal(np.asarray(to_logical(cut).lm_head),
                                  np.asarray(truncate_head(params, 96).lm_head))
    toks = jax.random.randint(jax.random.key(0), (2, 5), 0, cfg.vocab_size)
    got = forward(cut, cfg, toks, init_cache(cfg, 2, 16), ops=ops)[0]
    full = forward(params, cfg, toks, init_cache(cfg, 2, 16), ops=XLA)[0]
    assert np.all(np.asarray(got)[..., 96:] == -np.inf)
    np.testing.assert_allclose(np.asarray(got)[..., :96], np.asarray(full)[..., :96], rtol=2e-2, atol=2e-2)
    q8 = ops.prepare(truncate_head(quantize_params(params), 96))  # an int8 cut head, tiled where narrow
    assert head_width(q8) == 96
    assert isinstance(q8.lm_head, TiledInt8Weight) == has_feature("int8_tiles")
