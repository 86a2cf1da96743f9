"""Int4 weights in groups of 32 on the CPU: the FFI call of kernels/int4_groups.h and where the cpu
backend's `dense` uses it (the tile layout is `layouts.Int4Tiles`).

Why: a draft step reads every weight once, so its time is its bytes. Int8 (models/quant.py) halves
bf16's; int4 with one bf16 scale and one bf16 offset per 32 weights of a column is 5 bits a weight,
5/8 of int8's. On a Zen 4 core the kernel streams the 0.5B draft's layers in ~10 ms where int8
took ~15-18 (kernels/int4_groups.h says how). The draft's proposal rows come from the int4 model
itself, so SD stays exact; only acceptance can change (ALGORITHM.md §3).

Activations: each row of x is taken in groups of 32 as int8 with one scale per group
(`quantize_groups_int8`, as llama.cpp's Q8_0), so the products are u8 x s8 integer dot products
(vpdpbusd). `reference_int4` computes the same sums in fp32 from the dequantized operands.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ssd_jax.models.cpu import layouts
from ssd_jax.models.cpu.build import DTYPES, TARGET_INT4, dispatch, has_feature
from ssd_jax.models.ops import xla_dense
from ssd_jax.models.weights import GROUP, Int4Weight


def quantize_groups_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] (K a multiple of 32) -> (xq [..., K] int8, sx [..., K/32] fp32): each group of 32
    as round(x * 127 / max|x|) with scale max|x| / 127 (a zero group: scale 1). A row holding NaN or
    Inf gets xq = 0 and sx = NaN everywhere (its products are NaN, as they would be unquantized).
    What the int4 kernel does to its activations."""
    x = x.astype(jnp.float32)
    *lead, K = x.shape
    xg = x.reshape(*lead, K // GROUP, GROUP)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    finite = jnp.all(jnp.isfinite(amax), axis=-1, keepdims=True)
    safe = jnp.where(finite & (amax > 0), amax, 1.0)
    xq = jnp.clip(jnp.round(xg * (127.0 / safe[..., None])), -127, 127)
    xq = jnp.where(finite[..., None], xq, 0.0).reshape(*lead, K).astype(jnp.int8)
    return xq, jnp.where(finite, safe / 127.0, jnp.nan)


def reference_int4(x: jax.Array, tiles: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] with w the dequantized tiles and x's groups as int8
    (`quantize_groups_int8`), in fp32 -> [..., N] in x's dtype (or `preferred_element_type`):
    what `kernel_int4` computes, up to the order of its fp32 roundings (for the kernel tests; the
    backend's fallback and grad are `xla_dense`'s)."""
    w = layouts.Int4Tiles(tiles=tiles).dequantize()
    K = w.shape[0]
    if x.shape[-1] != K:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, int4 w {list(w.shape)}")
    xq, sx = quantize_groups_int8(x)
    xd = (xq.astype(jnp.float32).reshape(*x.shape[:-1], K // GROUP, GROUP) * sx[..., None])
    out = jnp.einsum("...k,kn->...n", xd.reshape(x.shape), w)
    return out.astype(x.dtype if preferred_element_type is None else preferred_element_type)


def kernel_available() -> bool:
    """Whether the CPU kernel takes int4 tiles on this machine (it built, with AVX512_VNNI)."""
    return jax.default_backend() == "cpu" and has_feature("int4")


def kernel_int4(x: jax.Array, tiles: jax.Array, out_dtype=None) -> jax.Array:
    """The FFI call (CPU only): x [..., K] fp32/bf16, tiles [K/32, N/32, 640] -> x @ w [..., N]
    in `out_dtype` (default x's), x's groups taken as int8 and each group's products summed
    exactly in int32 before its scale and offset are applied in fp32."""
    if not kernel_available():
        raise RuntimeError("the int4 CPU kernel is not available on this machine (it needs the "
                           "CPU kernels built, and AVX512_VNNI)")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    K, N = layouts.Int4Tiles(tiles=tiles).shape
    if x.dtype not in DTYPES or out_dtype not in DTYPES:
        raise ValueError(f"kernel_int4 takes fp32/bf16 x and out, got x {x.dtype}, out {out_dtype}")
    if x.shape[-1] != K:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, int4 w {[K, N]}")
    out = jax.ShapeDtypeStruct((*x.shape[:-1], N), out_dtype)
    return jax.ffi.ffi_call(TARGET_INT4, out)(x, tiles)


def matmul_int4(x: jax.Array, w, *, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w, w `layouts.Int4Tiles` or a logical `Int4Weight` (laid out as tiles in the
    call: `prepare` does it once instead): `kernel_int4` where the CPU kernel serves (any number of
    rows), else `xla_dense` (on w's logical value, dequantized every call: correct, slow).
    Differentiable: the grad is xla_dense's."""
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    tiled = isinstance(w, layouts.Int4Tiles)
    args = (w.tiles,) if tiled else (w.q, w.scale, w.offset)

    def ref(x, *a):
        logical = layouts.Int4Tiles(tiles=a[0]).logical() if tiled else Int4Weight(*a)
        return xla_dense(x, logical, preferred_element_type=preferred_element_type)

    def kern(x, *a):
        return kernel_int4(x, a[0] if tiled else layouts.pack_int4(*a), out_dtype)

    if not (x.dtype in DTYPES and out_dtype in DTYPES and math.prod(x.shape[:-1]) > 0
            and kernel_available()):
        return ref(x, *args)
    return dispatch(kern, ref, x, *args)


__all__ = ["kernel_available", "kernel_int4", "matmul_int4", "quantize_groups_int8",
           "reference_int4"]
