"""Int4 weights in groups of 32 for a draft model: the layout, the quantizer, the plain-`jnp`
reference matmul and the CPU kernel's call (models/cpu_kernels/int4_groups.h).

Why: a draft step reads every weight once, so its time is its bytes. Int8 (models/quant.py) halves
bf16's; int4 with one bf16 scale and one bf16 offset per 32 weights of a column is 5 bits a weight,
5/8 of int8's. On a Zen 4 core the kernel streams the 0.5B draft's layers in ~10 ms where int8
took ~15-18 (cpu_kernels/int4_groups.h says how). The draft's proposal rows come from the int4
model itself, so SD stays exact; only acceptance can change (ALGORITHM.md §3).

Values: for rows k of group g = k // 32 and column n, w[k, n] ~= scale[g, n] * q[k, n] +
offset[g, n], q in 0..15 (asymmetric: a group's minimum and maximum are both kept, as in GGUF's
Q4_K whose sub-blocks are these same 32 weights of a column).

Layout (`pack_int4`): tiles [K/32, N/32, 640] uint8, one per (group, 32-column block), each one
contiguous run the kernel streams: 8 lines of 64 bytes, line i holding rows 32g + 4i .. 32g + 4i + 3
with the four rows of a column adjacent (byte 4c + j: low nibble q[32g + 4i + j, 32b + c], high
nibble q[32g + 4i + j, 32b + 16 + c]), then the block's 32 scales and 32 offsets as bf16.

Activations: each row of x is taken in groups of 32 as int8 with one scale per group
(`quantize_groups_int8`, as llama.cpp's Q8_0), so the products are u8 x s8 integer dot products
(vpdpbusd). The reference computes the same sums in fp32 from the dequantized operands.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models import cpu_matmul

GROUP = 32  # rows of a column per scale and offset; also the kernel's tile height
BLOCK = 32  # columns per tile
_NIBBLE_BYTES = GROUP * BLOCK // 2
TILE_BYTES = _NIBBLE_BYTES + 2 * BLOCK * 2  # nibbles, then bf16 scales and offsets


def quantizable(K: int, N: int) -> bool:
    """Whether a w [K, N] is one `quantize_int4` takes: whole groups of rows and blocks of columns."""
    return K > 0 and N > 0 and K % GROUP == 0 and N % BLOCK == 0


@struct.dataclass
class Int4Weight:
    """w [K, N] as int4 tiles (module docstring); `dequantize` gives it back as [K, N]."""
    tiles: jax.Array  # [K/32, N/32, 640] uint8

    @property
    def shape(self) -> tuple[int, int]:
        G, NB, _ = self.tiles.shape
        return G * GROUP, NB * BLOCK

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """scale * q + offset, [K, N] in `dtype` (computed in fp32)."""
        q, scale, offset = unpack_int4(self.tiles)
        G = q.shape[0] // GROUP
        w = q.astype(jnp.float32).reshape(G, GROUP, -1) * scale[:, None] + offset[:, None]
        return w.reshape(q.shape).astype(dtype)


def _check_tiles(tiles: jax.Array) -> tuple[int, int]:
    if tiles.ndim != 3 or tiles.shape[2] != TILE_BYTES or tiles.dtype != jnp.uint8:
        raise ValueError(f"int4 tiles are uint8 [K/{GROUP}, N/{BLOCK}, {TILE_BYTES}], got "
                         f"{tiles.dtype}{list(tiles.shape)}")
    return tiles.shape[0], tiles.shape[1]


def _bf16_bytes(x: jax.Array) -> jax.Array:
    """bf16 [G, N] -> uint8 [G, N/32, 64]: each block's 32 values, little-endian."""
    G, N = x.shape
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint8).reshape(G, N // BLOCK, 64)


def _bf16_values(b: jax.Array) -> jax.Array:
    """The inverse of `_bf16_bytes`: uint8 [G, NB, 64] -> fp32 [G, NB * 32]."""
    G, NB, _ = b.shape
    x = jax.lax.bitcast_convert_type(b.reshape(G, NB, BLOCK, 2), jnp.bfloat16)
    return x.reshape(G, NB * BLOCK).astype(jnp.float32)


def pack_int4(q: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    """q [K, N] (ints in 0..15), scale and offset [K/32, N] (rounded to bf16) -> tiles
    [K/32, N/32, 640] uint8 (module docstring). `unpack_int4` inverts it."""
    K, N = q.shape
    if not quantizable(K, N) or scale.shape != (K // GROUP, N) or offset.shape != scale.shape:
        raise ValueError(f"pack_int4 takes q [K, N] with K, N multiples of {GROUP}, {BLOCK} and "
                         f"scale, offset [K/{GROUP}, N]; got q {list(q.shape)}, scale "
                         f"{list(scale.shape)}, offset {list(offset.shape)}")
    G, NB = K // GROUP, N // BLOCK
    # q[g, i, j, b, h, c] = q[32g + 4i + j, 32b + 16h + c] -> [g, b, i, h, c, j]
    t = q.astype(jnp.uint8).reshape(G, GROUP // 4, 4, NB, 2, BLOCK // 2)
    t = t.transpose(0, 3, 1, 4, 5, 2).reshape(G, NB, GROUP // 4, 2, 64)
    nib = (t[:, :, :, 0] | (t[:, :, :, 1] << 4)).reshape(G, NB, _NIBBLE_BYTES)
    return jnp.concatenate([nib, _bf16_bytes(scale), _bf16_bytes(offset)], axis=-1)


def unpack_int4(tiles: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tiles -> (q [K, N] uint8 in 0..15, scale [K/32, N] fp32, offset [K/32, N] fp32)."""
    G, NB = _check_tiles(tiles)
    nib = tiles[..., :_NIBBLE_BYTES].reshape(G, NB, GROUP // 4, 1, 64)
    t = jnp.concatenate([nib & 0x0F, nib >> 4], axis=3).reshape(G, NB, GROUP // 4, 2, BLOCK // 2, 4)
    q = t.transpose(0, 2, 5, 1, 3, 4).reshape(G * GROUP, NB * BLOCK)
    scale = _bf16_values(tiles[..., _NIBBLE_BYTES:_NIBBLE_BYTES + 64])
    offset = _bf16_values(tiles[..., _NIBBLE_BYTES + 64:])
    return q, scale, offset


@jax.jit
def quantize_int4(w: jax.Array) -> Int4Weight:
    """w [K, N] (any float dtype; K, N multiples of 32) -> Int4Weight.

    Per group of 32 rows of a column: offset = the minimum, scale = (maximum - offset) / 15, both
    rounded to bf16, q = round((w - offset) / scale) clipped to 0..15, so |w - (scale q + offset)|
    <= scale / 2 up to the bf16 rounding of the two. A constant group gets scale 0 and q 0.
    """
    K, N = w.shape
    if not quantizable(K, N):
        raise ValueError(f"int4 weights need K, N multiples of {GROUP}, {BLOCK}; got {[K, N]}")
    wg = jnp.asarray(w, jnp.float32).reshape(K // GROUP, GROUP, N)
    lo, hi = jnp.min(wg, axis=1), jnp.max(wg, axis=1)
    offset = lo.astype(jnp.bfloat16).astype(jnp.float32)
    scale = ((hi - offset) / 15.0).astype(jnp.bfloat16).astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round((wg - offset[:, None]) / safe[:, None]), 0, 15)
    q = jnp.where(scale[:, None] > 0, q, 0).reshape(K, N)
    return Int4Weight(tiles=pack_int4(q, scale, offset))


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
    what `kernel_int4` computes, up to the order of its fp32 roundings."""
    w = Int4Weight(tiles=tiles).dequantize()
    K = w.shape[0]
    if x.shape[-1] != K:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, int4 w {list(w.shape)}")
    xq, sx = quantize_groups_int8(x)
    xd = (xq.astype(jnp.float32).reshape(*x.shape[:-1], K // GROUP, GROUP) * sx[..., None])
    out = jnp.einsum("...k,kn->...n", xd.reshape(x.shape), w)
    return out.astype(x.dtype if preferred_element_type is None else preferred_element_type)


def kernel_available() -> bool:
    """Whether the CPU kernel takes int4 tiles on this machine (it built, with AVX512_VNNI)."""
    return jax.default_backend() == "cpu" and cpu_matmul.has_feature("int4")


def kernel_int4(x: jax.Array, tiles: jax.Array, out_dtype=None) -> jax.Array:
    """The FFI call (CPU only): x [..., K] fp32/bf16, tiles [K/32, N/32, 640] -> x @ w [..., N]
    in `out_dtype` (default x's), x's groups taken as int8 and each group's products summed
    exactly in int32 before its scale and offset are applied in fp32."""
    if not kernel_available():
        raise RuntimeError("the int4 CPU kernel is not available on this machine (it needs the "
                           "small-M kernel built, and AVX512_VNNI)")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    G, NB = _check_tiles(tiles)
    if x.dtype not in cpu_matmul.DTYPES or out_dtype not in cpu_matmul.DTYPES:
        raise ValueError(f"kernel_int4 takes fp32/bf16 x and out, got x {x.dtype}, out {out_dtype}")
    if x.shape[-1] != G * GROUP:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, int4 w {[G * GROUP, NB * BLOCK]}")
    out = jax.ShapeDtypeStruct((*x.shape[:-1], NB * BLOCK), out_dtype)
    return jax.ffi.ffi_call(cpu_matmul.TARGET_INT4, out)(x, tiles)


def matmul_int4(x: jax.Array, tiles: jax.Array, *, enabled: bool = True,
                preferred_element_type=None) -> jax.Array:
    """x [..., K] @ the int4 w of `tiles` -> [..., N]: `kernel_int4` where the CPU kernel serves
    (any number of rows), else `reference_int4` (XLA dequantizes every call: correct, slow)."""
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    if not (enabled and x.dtype in cpu_matmul.DTYPES and out_dtype in cpu_matmul.DTYPES
            and math.prod(x.shape[:-1]) > 0 and kernel_available()):
        return reference_int4(x, tiles, preferred_element_type)
    return jax.lax.platform_dependent(
        x, tiles, cpu=functools.partial(kernel_int4, out_dtype=out_dtype),
        default=functools.partial(reference_int4, preferred_element_type=preferred_element_type))


__all__ = ["GROUP", "Int4Weight", "kernel_available", "kernel_int4", "matmul_int4", "pack_int4",
           "quantizable", "quantize_groups_int8", "quantize_int4", "reference_int4", "unpack_int4"]
