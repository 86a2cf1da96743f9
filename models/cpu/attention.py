"""Attention of a few new tokens over the KV cache, with the cache write: the plain-`jnp` reference
and the CPU kernel's call (models/cpu_kernels/cache_attention.h, built with the small-M matmul).

Why: a decode step's attention is tiny work, but XLA:CPU ran it per layer as ~15 small thunks: a
bounds-checked scatter into the cache (not in place, then copied into the output buffer), a
transposed copy of the whole K and V cache for each of the two dots, two YNNPACK dots and the
softmax's reductions: ~4 ms of a ~100 ms decode step of the 1.5B target on two cores at a 256-slot
cache, and the copies grow with the cache. The kernel writes the new K/V rows in place (the caches
are aliased to its outputs, and donated by the steps) and reads each query's visible slots once.

Both give, for q [B, T, H, D] at positions [B, T] (a query sees slots s <= its position and
s < window; kv head h // G for query head h): the new rows written at the positions (dropped
outside the cache), fp32 logits scaled by D^-0.5, an fp32 softmax, the probabilities rounded to
the cache dtype, p @ v summed in fp32. The kernel's sums run in an order that does not depend on
T, so a token's output in a K+1-token verify equals its output in a one-token decode bit for bit.
Positions are cache lengths plus offsets, so >= 0 (for a negative one the reference's scatter
would count from the end, while the kernel writes nothing and gives zeros).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.models import cpu_matmul

MAX_TOKENS = 16  # new tokens per sequence the kernel serves (decode, verify, catch-up); more: XLA
_NEG_INF = -1e30


@functools.partial(jax.vmap, in_axes=(0, 0, 0))
def write(c, positions, new):
    """c[b, positions[b, t]] = new[b, t] (slots past the buffer dropped). Written per sequence with
    `vmap`, so the scatter carries the batch as a batching dimension: a cache sharded over the batch
    (data-parallel draft) is updated on each shard without gathering the new KV across devices."""
    return c.at[positions].set(new.astype(c.dtype), mode="drop")


def attention(q, k, v, positions):
    """q [B, T, H, D] at positions [B, T] over cache k, v [B, W, KVH, D]: slot s visible iff
    s <= pos. Returns [B, T, H * D] in q's dtype."""
    B, T, H, D = q.shape
    W, KVH = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, KVH, H // KVH, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = s * (D ** -0.5)
    mask = jnp.arange(W)[None, None, :] <= positions[:, :, None]  # [B, T, W]
    s = jnp.where(mask[:, None, None], s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H * D).astype(q.dtype)


def reference(q, k_new, v_new, positions, k_cache, v_cache, window: int | None = None):
    """What the kernel computes: `write` the new rows, then `attention` over the first `window`
    slots (default all). q [B, T, H, D], k_new / v_new [B, T, KVH, D], positions [B, T] int32,
    caches [B, S, KVH, D]. Returns (out [B, T, H * D], k_cache, v_cache)."""
    W = k_cache.shape[1] if window is None else window
    k_cache = write(k_cache, positions, k_new)
    v_cache = write(v_cache, positions, v_new)
    return attention(q, k_cache[:, :W], v_cache[:, :W], positions), k_cache, v_cache


def kernel(q, k_new, v_new, positions, k_cache, v_cache, window: int | None = None):
    """The FFI call itself (CPU only); arguments and results as `reference`. The caches are
    aliased to the outputs: under a jit that donates them the write is in place."""
    if not cpu_matmul.available():
        raise RuntimeError("the CPU kernels are not available on this machine")
    B, T, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    W = S if window is None else int(window)
    dt = k_cache.dtype
    if q.dtype not in cpu_matmul.DTYPES or q.dtype != dt or v_cache.dtype != dt:
        raise ValueError(f"kernel takes q and caches of one dtype, float32 or bfloat16; got q "
                         f"{q.dtype}, k_cache {dt}, v_cache {v_cache.dtype}")
    if (k_cache.shape != (B, S, KVH, D) or v_cache.shape != k_cache.shape or KVH < 1
            or H % KVH or k_new.shape != (B, T, KVH, D) or v_new.shape != k_new.shape
            or positions.shape != (B, T)):
        raise ValueError(f"inconsistent shapes: q {q.shape}, k_new {k_new.shape}, v_new "
                         f"{v_new.shape}, positions {positions.shape}, caches {k_cache.shape}, "
                         f"{v_cache.shape}")
    if not 1 <= W <= S:
        raise ValueError(f"window {W} must be in [1, {S}]")
    outs = (jax.ShapeDtypeStruct(q.shape, dt), jax.ShapeDtypeStruct(k_cache.shape, dt),
            jax.ShapeDtypeStruct(v_cache.shape, dt))
    out, k_cache, v_cache = jax.ffi.ffi_call(
        cpu_matmul.TARGET_ATTENTION, outs, input_output_aliases={4: 1, 5: 2})(
        q, k_new.astype(dt), v_new.astype(dt), positions.astype(jnp.int32), k_cache, v_cache,
        window=W, scale=np.float32(D ** -0.5))
    return out.reshape(B, T, H * D), k_cache, v_cache


def attend(q, k_new, v_new, positions, k_cache, v_cache, *, window: int | None = None,
           enabled: bool = True):
    """`kernel` where it serves (the CPU backend, the kernel built, `enabled` - a static choice:
    `ModelConfig.cpu_kernels` - q and caches of one fp32 / bf16 dtype, at most MAX_TOKENS new
    tokens), else `reference`. `lax.platform_dependent` keeps the reference for any non-CPU
    lowering."""
    T = q.shape[1]
    if not (enabled and 0 < T <= MAX_TOKENS and q.dtype in cpu_matmul.DTYPES
            and q.dtype == k_cache.dtype == v_cache.dtype and jax.default_backend() == "cpu"
            and cpu_matmul.available()):
        return reference(q, k_new, v_new, positions, k_cache, v_cache, window)
    return jax.lax.platform_dependent(
        q, k_new, v_new, positions, k_cache, v_cache,
        cpu=functools.partial(kernel, window=window),
        default=functools.partial(reference, window=window))


__all__ = ["MAX_TOKENS", "attend", "attention", "kernel", "reference", "write"]
