"""Logical weight formats of the portable core: a dense weight is an array w [K, N], or one of the
quantized pytrees below. They say what a weight *is*; how a backend lays it out for its kernels
(strips, tiles, an untied head) is that backend's business, applied once by its `prepare`
(`ssd_jax.models.ops.Ops`) and never undone.

- `Int8Weight(q, scale)`: symmetric int8, one fp32 scale per output column, w ~= q * scale.
- `Int4Weight(q, scale, offset)`: asymmetric int4 in groups of 32 rows of a column (as GGUF's
  Q4_K sub-blocks), w[k, n] ~= scale[k // 32, n] * q[k, n] + offset[k // 32, n], q in 0..15 held one
  value per uint8, scale and offset rounded to bf16 and held as fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

GROUP = 32  # rows of a column per int4 scale and offset


@struct.dataclass
class Int8Weight:
    """w [K, N] as int8 q [K, N] and fp32 scale [N]."""
    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the weight it stands for."""
        return tuple(self.q.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """w ~= q * scale, [K, N] in `dtype` (computed in fp32)."""
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


@struct.dataclass
class Int4Weight:
    """w [K, N] as q [K, N] uint8 in 0..15, scale and offset [K/32, N] fp32."""
    q: jax.Array
    scale: jax.Array
    offset: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the weight it stands for."""
        return tuple(self.q.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """scale * q + offset, [K, N] in `dtype` (computed in fp32)."""
        K, N = self.q.shape
        w = (self.q.astype(jnp.float32).reshape(K // GROUP, GROUP, N) * self.scale[:, None]
             + self.offset[:, None])
        return w.reshape(K, N).astype(dtype)


def int4_quantizable(K: int, N: int) -> bool:
    """Whether w [K, N] takes `quantize_int4`: whole groups of 32 rows, and whole blocks of 32
    columns (what every backend's int4 layout assumes)."""
    return K > 0 and N > 0 and K % GROUP == 0 and N % 32 == 0


@jax.jit
def quantize_int8(w: jax.Array) -> Int8Weight:
    """w [K, N] (any float dtype) -> Int8Weight, per column symmetric: |w - q * scale| <= scale / 2."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero column stays exactly zero
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(q=q, scale=scale)


@jax.jit
def quantize_int4(w: jax.Array) -> Int4Weight:
    """w [K, N] (K, N multiples of 32) -> Int4Weight.

    Per group of 32 rows of a column: offset = the minimum, scale = (maximum - offset) / 15, both
    rounded to bf16, q = round((w - offset) / scale) clipped to 0..15, so |w - (scale q + offset)|
    <= scale / 2 up to the bf16 rounding of the two. A constant group gets scale 0 and q 0.
    """
    K, N = w.shape
    if not int4_quantizable(K, N):
        raise ValueError(f"int4 weights need K, N multiples of {GROUP}; got {[K, N]}")
    wg = jnp.asarray(w, jnp.float32).reshape(K // GROUP, GROUP, N)
    lo, hi = jnp.min(wg, axis=1), jnp.max(wg, axis=1)
    offset = lo.astype(jnp.bfloat16).astype(jnp.float32)
    scale = ((hi - offset) / 15.0).astype(jnp.bfloat16).astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round((wg - offset[:, None]) / safe[:, None]), 0, 15)
    q = jnp.where(scale[:, None] > 0, q, 0).reshape(K, N).astype(jnp.uint8)
    return Int4Weight(q=q, scale=scale, offset=offset)


def out_columns(w) -> int:
    """N of a dense weight w [K, N] in any logical format."""
    return int(w.shape[-1])


__all__ = ["GROUP", "Int4Weight", "Int8Weight", "int4_quantizable", "out_columns", "quantize_int4",
           "quantize_int8"]
