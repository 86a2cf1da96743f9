"""Small-M fp32 / bf16 / int8-weight matmuls on the CPU: the FFI calls of kernels/small_m_matmul.cc
and where the cpu backend's `dense` uses them.

Why: XLA:CPU streams a one-row matmul (decode) at memory bandwidth but runs 2..16 rows (a K+1-token
verify, a few tree branches) as a GEMM that costs 1.5-2.8x as much, although the weights are read
once either way (benchmarks/decode_vs_hf.py). The kernel streams each weight once for every row,
so a verify costs little more than a decode; on two cores it also reads the weights faster than
XLA's GEMV.

Every output element is accumulated in the same order whatever the number of rows, so a token's
logits in a verify equal its logits in a one-token decode bit for bit (tests/cpu/test_cpu_matmul.py).

`kernel_int8` is the same kernel over int8 weights with one fp32 scale per column (a quantized
draft, models/quant.py): a quarter of fp32's bytes per decode step. Its activations are quantized
per row to int16 so that, with AVX512_VNNI, the products are integer dot products (vpdpwssd): that
streams int8 weights at memory bandwidth where widening them to fp32 did not.

bf16 weights can be packed in strips (`layouts.pack_bf16`): a one-row decode reads them ~1.5x as
fast as row-major ones and a 5-row verify ~1.9x, with the same sums bit for bit
(kernels/bf16_strips.h). Narrow int8 weights can be tiled (`layouts.tile_int8`): a pass of the
kernel reads one sequential stream instead of 16 short ones, about twice as fast on a Zen 4 core,
with the same integer sums. The backend's `prepare` applies both where `has_feature` says so.

The custom call has no partitioning rule: on a mesh of several devices XLA would gather its
operands, so the backend selection (models/backends.py) uses XLA there.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ssd_jax.models.cpu import layouts
from ssd_jax.models.cpu.build import (DTYPES, TARGET_INT8, TARGET_MATMUL, _FEATURES, available,
                                      dispatch, require)
from ssd_jax.models.ops import xla_dense
from ssd_jax.models.weights import Int8Weight

MAX_ROWS = 16  # fp32: past this XLA's GEMM is as fast (measured: equal at 32 rows on 1536 x 17920)


def kernel(x: jax.Array, w: jax.Array, transpose_w: bool = False, out_dtype=None,
           packed: bool = False) -> jax.Array:
    """The FFI call itself (CPU only): x [..., K], w [K, N] (or [N, K]; or bf16 laid out by
    `layouts.pack_bf16` where `packed`) -> [..., N] in `out_dtype` (default x's). Each of them fp32
    or bf16; the sums are fp32 (bf16 weights are widened in registers, so a bf16 model streams half
    the bytes), rounded to nearest even for a bf16 out."""
    require()
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if x.dtype not in DTYPES or w.dtype not in DTYPES or out_dtype not in DTYPES or w.ndim != 2:
        raise ValueError(f"kernel takes fp32/bf16 x [..., K], a 2-D fp32/bf16 w and an fp32/bf16 "
                         f"out, got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, "
                         f"out {out_dtype}")
    K = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[-1] != K:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, w {list(w.shape)}"
                         f"{' (transposed)' if transpose_w else ''}")
    if packed:
        layouts.check_packable(w)
        if transpose_w or x.dtype != jnp.bfloat16:
            raise ValueError(f"a packed w takes bf16 x and no transpose, got x {x.dtype}"
                             f"{', transpose_w' if transpose_w else ''}")
        if not _FEATURES["bf16_strips"]:
            raise RuntimeError("this CPU's kernel takes no packed w (it needs AVX512_BF16): "
                               "use the row-major weight (`layouts.unpack_bf16`)")
    N = w.shape[0] if transpose_w else w.shape[1]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], N), out_dtype)
    return jax.ffi.ffi_call(TARGET_MATMUL, out)(x, w, transpose_w=bool(transpose_w),
                                                packed=bool(packed))


def serves(x: jax.Array, w_dtype, out_dtype, packed: bool = False) -> bool:
    """Whether `matmul` runs the kernel: fp32 operands with at most MAX_ROWS rows (the product of
    x's leading dims) and bf16 operands with any number (XLA:CPU's bf16 GEMM is ~10x slower than
    its fp32 one, so a bf16 prefill is faster in the kernel, compute-bound), when the default
    backend is the CPU and the kernel built (with AVX512_BF16 for a packed w)."""
    rows = math.prod(x.shape[:-1])
    return (x.dtype == w_dtype and x.dtype in DTYPES and jnp.dtype(out_dtype) in DTYPES
            and 0 < rows and (rows <= MAX_ROWS or x.dtype == jnp.bfloat16)
            and jax.default_backend() == "cpu" and available()
            and (not packed or _FEATURES["bf16_strips"]))


def matmul(x: jax.Array, w, *, transpose_w: bool = False, preferred_element_type=None):
    """x [..., K] @ w [K, N] (w [N, K] with `transpose_w`; w a `layouts.PackedWeight`) -> [..., N],
    in x's dtype (or `preferred_element_type`): `kernel` where it `serves`, else `xla_dense` (on
    w unpacked). Differentiable: the grad is xla_dense's."""
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    packed = isinstance(w, layouts.PackedWeight)
    arr = w.w if packed else w
    ref = functools.partial(_reference, transpose_w=transpose_w, packed=packed,
                            preferred_element_type=preferred_element_type)
    if not serves(x, arr.dtype, out_dtype, packed):
        return ref(x, arr)
    return dispatch(functools.partial(kernel, transpose_w=transpose_w, out_dtype=out_dtype,
                                      packed=packed), ref, x, arr)


def _reference(x, w, *, transpose_w, packed, preferred_element_type):
    return xla_dense(x, layouts.unpack_bf16(w) if packed else w, transpose_w=transpose_w,
                     preferred_element_type=preferred_element_type)


def quantize_rows_int16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (xq [..., K] int16, sx [..., 1] fp32) with x ~= xq * sx, one scale per row:
    xq = round(x * 32767 / max|x|). A row holding NaN or Inf gets xq = 0 and sx = NaN (its products
    are NaN, as they would be unquantized). What the int8 kernel does to its activations: it then
    sums exact integer products (vpdpwssd), |x - xq * sx| <= sx / 2, 2^-16 of the row's largest."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    finite = jnp.isfinite(amax)
    safe = jnp.where(finite & (amax > 0), amax, 1.0)
    xq = jnp.where(finite, jnp.clip(jnp.round(x * (32767.0 / safe)), -32767, 32767), 0.0)
    return xq.astype(jnp.int16), jnp.where(finite, safe / 32767.0, jnp.nan)


def reference_int8(x: jax.Array, q: jax.Array, scale: jax.Array,
                   preferred_element_type=None) -> jax.Array:
    """((xq [..., K] @ q [K, N]) * scale [N]) * sx in fp32 -> [..., N] in x's dtype (or
    `preferred_element_type`), with x's rows as int16 (`quantize_rows_int16`): what `kernel_int8`
    computes, up to the order of its fp32 roundings (for the kernel tests; the backend's fallback
    and grad are `xla_dense`'s)."""
    xq, sx = quantize_rows_int16(x)
    out = jnp.einsum("...k,kn->...n", xq.astype(jnp.float32), q.astype(jnp.float32)) * scale * sx
    return out.astype(x.dtype if preferred_element_type is None else preferred_element_type)


def kernel_int8(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None,
                tiled: bool = False) -> jax.Array:
    """The FFI call (CPU only): x [..., K] fp32/bf16, q [K, N] int8 (laid out by
    `layouts.tile_int8` if `tiled`), scale [N] fp32 -> (x @ q) * scale [..., N] in `out_dtype`
    (default x's), x's rows taken as int16 (`quantize_rows_int16`) and the products summed exactly
    in int32 (fp32 without AVX512_VNNI, which takes no tiled q)."""
    require()
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if (x.dtype not in DTYPES or out_dtype not in DTYPES or q.dtype != jnp.int8 or q.ndim != 2
            or scale.dtype != jnp.float32 or scale.shape != q.shape[1:]):
        raise ValueError(f"kernel_int8 takes fp32/bf16 x [..., K], int8 q [K, N], fp32 scale [N] "
                         f"and an fp32/bf16 out, got x {x.dtype}{list(x.shape)}, q {q.dtype}"
                         f"{list(q.shape)}, scale {scale.dtype}{list(scale.shape)}, out {out_dtype}")
    if x.shape[-1] != q.shape[0]:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, q {list(q.shape)}")
    if tiled:
        layouts.check_tileable(q)
        if not _FEATURES["int8_tiles"]:
            raise RuntimeError("this CPU's int8 kernel takes no tiled q (it needs AVX512_VNNI): "
                               "use the row-major q (`layouts.untile_int8`)")
    out = jax.ShapeDtypeStruct((*x.shape[:-1], q.shape[1]), out_dtype)
    return jax.ffi.ffi_call(TARGET_INT8, out)(x, q, scale, tiled=bool(tiled))


def matmul_int8(x: jax.Array, w, *, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w, w an `Int8Weight` or a `layouts.TiledInt8Weight`: `kernel_int8` for any
    number of rows where the CPU kernel serves (XLA would widen all of q first; a tiled q needs
    AVX512_VNNI), else `xla_dense` (on q untiled). Differentiable: the grad is xla_dense's."""
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    tiled = isinstance(w, layouts.TiledInt8Weight)
    ref = functools.partial(_reference_int8, tiled=tiled,
                            preferred_element_type=preferred_element_type)
    if not (x.dtype in DTYPES and out_dtype in DTYPES and math.prod(x.shape[:-1]) > 0
            and jax.default_backend() == "cpu" and available()
            and (not tiled or _FEATURES["int8_tiles"])):
        return ref(x, w.q, w.scale)
    return dispatch(functools.partial(kernel_int8, out_dtype=out_dtype, tiled=tiled), ref,
                    x, w.q, w.scale)


def _reference_int8(x, q, scale, *, tiled, preferred_element_type):
    w = Int8Weight(q=layouts.untile_int8(q) if tiled else q, scale=scale)
    return xla_dense(x, w, preferred_element_type=preferred_element_type)


__all__ = ["MAX_ROWS", "kernel", "kernel_int8", "matmul", "matmul_int8", "quantize_rows_int16",
           "reference_int8", "serves"]
