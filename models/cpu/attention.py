"""Attention of a few new tokens over the KV cache, with the cache write: the CPU kernel's call
(kernels/cache_attention.h) and the cpu backend's `attend`, whose reference is
`ssd_jax.models.ops.xla_attend`.

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

from ssd_jax.models.cpu.build import DTYPES, TARGET_ATTENTION, available, dispatch, require
from ssd_jax.models.ops import xla_attend

MAX_TOKENS = 16  # new tokens per sequence the kernel serves (decode, verify, catch-up); more: XLA


def kernel(q, k_new, v_new, positions, k_cache, v_cache, window: int | None = None):
    """The FFI call itself (CPU only); arguments and results as `xla_attend`. The caches are
    aliased to the outputs: under a jit that donates them the write is in place."""
    require()
    B, T, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    W = S if window is None else int(window)
    dt = k_cache.dtype
    if q.dtype not in DTYPES or q.dtype != dt or v_cache.dtype != dt:
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
        TARGET_ATTENTION, outs, input_output_aliases={4: 1, 5: 2})(
        q, k_new.astype(dt), v_new.astype(dt), positions.astype(jnp.int32), k_cache, v_cache,
        window=W, scale=np.float32(D ** -0.5))
    return out.reshape(B, T, H * D), k_cache, v_cache


def serves(q, k_cache, v_cache) -> bool:
    """Whether `attend` runs the kernel: the CPU backend, the kernel built, q and caches of one
    fp32 / bf16 dtype, 1..MAX_TOKENS new tokens."""
    return (0 < q.shape[1] <= MAX_TOKENS and q.dtype in DTYPES
            and q.dtype == k_cache.dtype == v_cache.dtype and jax.default_backend() == "cpu"
            and available())


def attend(q, k_new, v_new, positions, k_cache, v_cache, *, window: int | None = None):
    """The cpu backend's `attend`: `kernel` where it `serves`, else `xla_attend`.
    Differentiable: the grad is xla_attend's."""
    ref = functools.partial(xla_attend, window=window)
    args = (q, k_new, v_new, positions, k_cache, v_cache)
    if not serves(q, k_cache, v_cache):
        return ref(*args)
    return dispatch(functools.partial(kernel, window=window), ref, *args)


__all__ = ["MAX_TOKENS", "attend", "kernel", "serves"]
