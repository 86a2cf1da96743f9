"""The CPU cache-attention kernel (models/cpu/attention.py) against XLA's attend (models/ops.py):
the written caches, the outputs, the token-count invariance, where the model with the cpu backend
dispatches to it, the in-place write, and its clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import cpu
from ssd_jax.models.config import tiny_config
from ssd_jax.models.cpu import attention
from ssd_jax.models.cpu.build import TARGET_ATTENTION
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.ops import XLA, xla_attend
from ssd_jax.models.params import random_params
from ssd_jax.models.transformer import forward


def _case(B, T, H, KVH, D, S, dtype, seed=0, start=None):
    rng = np.random.default_rng(seed)
    a = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)  # noqa: E731
    if start is None:
        start = rng.integers(0, S, size=B)
    positions = jnp.asarray(np.asarray(start)[:, None] + np.arange(T)[None], jnp.int32)
    return (a(B, T, H, D), a(B, T, KVH, D), a(B, T, KVH, D), positions, a(B, S, KVH, D),
            a(B, S, KVH, D))


SHAPES = [  # B, T, H, KVH, D, S
    (1, 1, 12, 2, 128, 256),  # the 1.5B target's decode
    (2, 5, 12, 2, 128, 300),  # a verify, a batch
    (3, 2, 4, 4, 64, 40),  # no GQA
    (2, 3, 6, 3, 20, 17),  # D not a multiple of 16
    (2, 16, 8, 1, 32, 64),  # MAX_TOKENS, one kv head
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype):
    args = _case(*shape, dtype)
    T = shape[1]
    want = jax.jit(xla_attend)(*args)
    got = jax.jit(attention.kernel)(*args)
    # the writes are copies: equal bit for bit, including the rows dropped past the cache
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    tol = 2e-6 if dtype == jnp.float32 else 1e-2  # sums in another order; bf16: one ulp of ~1
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=tol, rtol=tol)
    assert got[0].shape == (shape[0], T, shape[2] * shape[4]) and got[0].dtype == dtype


def test_writes_past_the_cache_are_dropped_and_the_rest_untouched():
    q, kn, vn, _, kc, vc = _case(2, 3, 4, 2, 16, 10, jnp.float32)
    positions = jnp.asarray([[8, 9, 10], [2, 3, 4]], jnp.int32)  # row 0's last token: slot 10
    _, k2, v2 = jax.jit(attention.kernel)(q, kn, vn, positions, kc, vc)
    want_k = np.array(kc)
    want_k[0, 8:10] = np.asarray(kn[0, :2])
    want_k[1, 2:5] = np.asarray(kn[1])
    np.testing.assert_array_equal(np.asarray(k2), want_k)
    want_v = np.array(vc)
    want_v[0, 8:10] = np.asarray(vn[0, :2])
    want_v[1, 2:5] = np.asarray(vn[1])
    np.testing.assert_array_equal(np.asarray(v2), want_v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_bounds_the_slots_read(dtype):
    args = _case(2, 2, 4, 2, 32, 64, dtype, start=[50, 20])
    for window in (8, 30, 64):
        want = xla_attend(*args, window=window)
        got = attention.kernel(*args, window=window)
        tol = 2e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                                   atol=tol, rtol=tol)
    # stale values past the window never reach the output, not even as NaN * 0
    q, kn, vn, pos, kc, vc = args
    kc = kc.at[:, 40:].set(jnp.nan)
    vc = vc.at[:, 40:].set(jnp.inf)
    out = attention.kernel(q, kn, vn, pos, kc, vc, window=30)[0]
    assert bool(jnp.isfinite(out).all())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_token_gives_the_same_output_in_a_five_token_call_as_alone(dtype):
    # What lets a verify reproduce a decode: each query's sums do not depend on T. The 5-token call
    # is enough work to take the thread pool, the one-token calls are not: the split must not
    # matter either.
    q, kn, vn, _, kc, vc = _case(2, 5, 12, 2, 128, 256, dtype)
    start = np.asarray([200, 137])
    positions = jnp.asarray(start[:, None] + np.arange(5)[None], jnp.int32)
    f = jax.jit(attention.kernel)
    whole, wk, wv = f(q, kn, vn, positions, kc, vc)
    outs = []
    for t in range(5):
        o, kc, vc = f(q[:, t:t + 1], kn[:, t:t + 1], vn[:, t:t + 1], positions[:, t:t + 1], kc, vc)
        outs.append(o)
    # token t of the whole call saw tokens after it written too, but they sit past its position
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(jnp.concatenate(outs, axis=1)))
    np.testing.assert_array_equal(np.asarray(wk), np.asarray(kc))
    np.testing.assert_array_equal(np.asarray(wv), np.asarray(vc))


def _decode_hlo(cfg, T, ops=None):
    ops = cpu.backend() if ops is None else ops
    params = ops.prepare(random_params(cfg, 0))
    cache = init_cache(cfg, 2, 32)
    f = jax.jit(lambda p, c, t: forward(p, cfg, t, c, ops=ops), donate_argnums=(1,))
    return f.lower(params, cache, jnp.zeros((2, T), jnp.int32)).compile().as_text()


def test_the_model_dispatches_to_the_kernel_and_writes_the_cache_in_place():
    cfg = tiny_config("qwen2", vocab_size=64)
    hlo = _decode_hlo(cfg, 1)
    assert hlo.count(f'custom_call_target="{TARGET_ATTENTION}"') == cfg.num_layers
    # donated caches aliased through the custom call: no copy of a cache-shaped buffer
    cache_shape = f"[2,32,{cfg.num_kv_heads},{cfg.head_dim}]"
    assert not [ln for ln in hlo.splitlines() if " copy(" in ln and cache_shape in ln]
    assert TARGET_ATTENTION not in _decode_hlo(
        cfg, attention.MAX_TOKENS + 1)  # a prefill past 16 tokens: XLA
    assert TARGET_ATTENTION not in _decode_hlo(cfg, 1, XLA)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_logits_with_and_without_the_kernel(arch):
    cfg = tiny_config(arch, vocab_size=96)
    params = random_params(cfg, 1, scale=1.0)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 7)), jnp.int32)
    out = {}
    fwd = jax.jit(forward, static_argnames=("cfg", "ops"))
    for on, ops in ((True, cpu.backend()), (False, XLA)):
        p = ops.prepare(params)
        _, cache = fwd(p, cfg=cfg, tokens=toks[:, :4], cache=init_cache(cfg, 2, 16), ops=ops)
        out[on], _ = fwd(p, cfg=cfg, tokens=toks[:, 4:], cache=cache, ops=ops)
    np.testing.assert_allclose(np.asarray(out[True]), np.asarray(out[False]), atol=2e-5, rtol=2e-5)


def test_clear_errors():
    q, kn, vn, pos, kc, vc = _case(1, 1, 4, 2, 16, 8, jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        attention.kernel(q.astype(jnp.bfloat16), kn, vn, pos, kc, vc)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        attention.kernel(q, kn, vn, pos, kc, vc[:, :4])
    with pytest.raises(ValueError, match="inconsistent shapes"):
        attention.kernel(q.reshape(1, 1, 2, 32), kn, vn, pos, kc, vc)
    with pytest.raises(ValueError, match="window 9"):
        attention.kernel(q, kn, vn, pos, kc, vc, window=9)
    # where the kernel does not serve, attend is the reference
    assert not attention.serves(q.astype(jnp.bfloat16), kc, vc)
    out = attention.attend(q.astype(jnp.bfloat16), kn, vn, pos, kc, vc)
    want = xla_attend(q.astype(jnp.bfloat16), kn, vn, pos, kc, vc)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(want[0]))
