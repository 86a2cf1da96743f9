"""Gradients through the cpu backend (models/cpu): every kernel op is a `jax.custom_vjp` whose
backward is its XLA reference's vjp, so `jax.grad` of a loss through `forward(..., ops=cpu.backend())`
equals the grad through `ops=XLA`, on logical and on prepared (packed bf16, tiled int8) params."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import cpu
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import layouts
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_attend, xla_dense
from ssd_jax.models.params import random_params
from ssd_jax.models.quant import quantize_params
from ssd_jax.models.transformer import forward


def _loss(params, cfg, toks, ops):
    logits, _ = forward(params, cfg, toks, init_cache(cfg, 2, 16), ops=ops)
    return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 3])


_grad = jax.jit(jax.grad(_loss), static_argnames=("cfg", "ops"))


def _assert_close(a, b, tol):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * max(1.0, float(np.abs(y).max())))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_grad_through_the_cpu_ops_equals_xla(arch):
    cfg = tiny_config(arch, vocab_size=96, tie_embeddings=(arch == "llama"))
    params = random_params(cfg, seed=1)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    ops = cpu.backend()
    hlo = jax.jit(jax.grad(_loss), static_argnames=("cfg", "ops")).lower(
        params, cfg=cfg, toks=toks, ops=ops).as_text()
    assert "ssd_jax_small_m_matmul" in hlo and "ssd_jax_cache_attention" in hlo  # kernels forward
    got = _grad(params, cfg=cfg, toks=toks, ops=ops)
    want = _grad(params, cfg=cfg, toks=toks, ops=XLA)
    _assert_close(got, want, 1e-4)
    # prepared (the head untied): the head's grad is the tied embedding's share
    prepared = ops.prepare(params)
    gp = _grad(prepared, cfg=cfg, toks=toks, ops=ops)
    gx = _grad(prepared, cfg=cfg, toks=toks, ops=XLA)
    _assert_close(gp, gx, 1e-4)


def test_grad_through_a_prepared_bf16_model():
    cfg = tiny_config("qwen2", vocab_size=96, dtype="bfloat16")
    params = random_params(cfg, seed=2)
    ops = cpu.backend()
    prepared = ops.prepare(params)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 5)), jnp.int32)
    got = _grad(prepared, cfg=cfg, toks=toks, ops=ops)
    want = _grad(params, cfg=cfg, toks=toks, ops=XLA)
    # a packed weight's cotangent is in its layout: unpack it to compare with the row-major grad
    _assert_close(layouts.to_logical(got), want, 3e-2)
    if isinstance(prepared.layers[0].wo, layouts.PackedWeight):
        assert isinstance(got.layers[0].wo, layouts.PackedWeight)


def test_grad_of_quantized_and_attention_ops_is_the_references():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    qw = quantize_params(random_params(tiny_config("qwen2", vocab_size=96), 0)).layers[0].wo
    for w in (qw, layouts.tile_weight(qw)):
        f = lambda x, w: jnp.sum(jnp.sin(cpu.dense(x, w)))  # noqa: E731
        g = lambda x, w: jnp.sum(jnp.sin(xla_dense(x, w.logical() if hasattr(w, "logical") else w)))  # noqa: E731
        gx, gw = jax.grad(f, argnums=(0, 1), allow_int=True)(x[:, :w.shape[0]], w)
        rx, _ = jax.grad(g, argnums=(0, 1), allow_int=True)(x[:, :w.shape[0]], w)
        np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-3, atol=1e-3)
        assert gw.q.dtype == jax.dtypes.float0  # integer operands: float0 cotangents
    B, T, H, KVH, D, S = 2, 3, 4, 2, 16, 8
    a = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, kn, vn, kc, vc = a(B, T, H, D), a(B, T, KVH, D), a(B, T, KVH, D), a(B, S, KVH, D), a(B, S, KVH, D)
    pos = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)

    def loss(attend, q, kn, vn, kc, vc):
        out, k2, v2 = attend(q, kn, vn, pos, kc, vc, window=S)
        return jnp.sum(jnp.sin(out)) + jnp.sum(k2 * v2)

    got = jax.grad(lambda *z: loss(cpu.backend().attend, *z), argnums=range(5))(q, kn, vn, kc, vc)
    want = jax.grad(lambda *z: loss(xla_attend, *z), argnums=range(5))(q, kn, vn, kc, vc)
    _assert_close(got, want, 1e-5)
