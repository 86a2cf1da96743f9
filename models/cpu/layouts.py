"""The cpu backend's own weight layouts: the same values as the logical formats of models/weights.py,
in the order its kernels stream them, and `prepare`, which applies them once to logical params.

- `PackedWeight`: a bf16 w [K, N] in 32-column strips (`pack_bf16`, kernels/bf16_strips.h). Why:
  row-major, the kernel walks 8 rows of w side by side over a run of columns; on the 1.5B target's
  narrow matrices (rows of 3-4 KiB) that is 8 short streams the prefetchers never ramp up on, and
  with 5 rows of x (a verify) the loads and stores of out crowd the loads of w. In strips each one
  is a sequential stream, its pairs of rows interleaved for vdpbf16ps, and out's tile stays in
  registers: ~27 GB/s of weights at 1 and at 5 rows on a Zen 4 core, against 18-23 and 14-18. The
  sums are the row-major kernel's, so a packed model gives the same logits.
- `TiledInt8Weight`: an `Int8Weight` whose narrow q (rows under 4 KiB: a small draft's wqkv, wo,
  w_down) is in tiles of 16 rows by 32 columns, 512 contiguous bytes each (`tile_int8`): one
  sequential stream per pass of the kernel instead of 16 short ones, with the same integer sums.
- `Int4Tiles`: an `Int4Weight` as tiles [K/32, N/32, 640] uint8 (`pack_int4`), one per (group,
  32-column block), each a contiguous run the kernel streams: 8 lines of 64 bytes, line i holding
  rows 32g + 4i .. 32g + 4i + 3 with the four rows of a column adjacent (byte 4c + j: low nibble
  q[32g + 4i + j, 32b + c], high nibble q[32g + 4i + j, 32b + 16 + c]), then the block's 32 scales
  and 32 offsets as bf16.
- an untied head (`untie_lm_head`): the kernel streams a [hidden, V] head at full bandwidth for
  every row count, where the tied [V, hidden] layout makes each row a separate dot product.

Each layout has `logical()` (the models/weights.py value back) and `dequantize` / `unpack`;
`to_logical(params)` undoes `prepare` (but for the untied head, which is a logical head too).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models.cpu.build import has_feature
from ssd_jax.models.params import DENSE_WEIGHTS, Params
from ssd_jax.models.weights import GROUP, Int4Weight, Int8Weight, int4_quantizable

STRIP_COLS = 32
TILE_ROWS, TILE_COLS = 16, 32
TILE_MAX_COLS = 4096  # wider int8 rows are long enough runs already: tiling them gained nothing
BLOCK = 32  # int4: columns per tile
_NIBBLE_BYTES = GROUP * BLOCK // 2
TILE_BYTES = _NIBBLE_BYTES + 2 * BLOCK * 2  # int4 nibbles, then bf16 scales and offsets


# ------------------------------------------------------------------ bf16 strips
def packable(K: int, N: int) -> bool:
    """Whether a w [K, N] is one `pack_bf16` lays out: K even, N whole strips of 32 columns."""
    return K > 0 and K % 2 == 0 and N > 0 and N % STRIP_COLS == 0


def check_packable(w) -> tuple[int, int]:
    """(K, N) of w, or a ValueError unless `packable`."""
    if w.ndim != 2 or not packable(*w.shape):
        raise ValueError(f"a packed w is [K, N] with K even and N a multiple of {STRIP_COLS}, "
                         f"got {list(w.shape)}")
    return w.shape


def pack_bf16(w: jax.Array) -> jax.Array:
    """w [K, N] -> the same values packed in strips, still [K, N]: 32-column strips one after
    another, each K / 2 blocks of 64 values, the pair of rows (2p, 2p + 1) of columns 0-15 then
    16-31, the two rows of a column adjacent: packed[s, p, h, c, j] = w[2p + j, 32s + 16h + c].
    `unpack_bf16` inverts it."""
    K, N = check_packable(w)
    t = w.reshape(K // 2, 2, N // STRIP_COLS, 2, STRIP_COLS // 2)
    return t.transpose(2, 0, 3, 4, 1).reshape(K, N)


def unpack_bf16(w: jax.Array) -> jax.Array:
    """The inverse of `pack_bf16`: packed [K, N] -> w [K, N] row-major."""
    K, N = check_packable(w)
    t = w.reshape(N // STRIP_COLS, K // 2, 2, STRIP_COLS // 2, 2)
    return t.transpose(1, 4, 0, 2, 3).reshape(K, N)


# Why each layout class has a static `layout` field: JAX 0.10.2 compares two dataclass pytree nodes
# with as many children as equal whatever their classes (their hashes differ), and jit's dispatch
# cache trusts that equality. So a program traced for an Int8Weight (q, scale) could run on a
# TiledInt8Weight of the same shapes, or the reverse, whenever the two signatures' hashes met in its
# table: a CI run got the tiled kernel on row-major bytes. A static field is part of the node's
# equality, so each layout differs from the logical weight it stands in for.


@struct.dataclass
class PackedWeight:
    """A bf16 dense weight w [K, N] laid out by `pack_bf16` (still shaped [K, N])."""
    w: jax.Array
    # static, so the node never equals the logical weight (see above PackedWeight)
    layout: str = struct.field(pytree_node=False, default="bf16_strips")

    @property
    def shape(self) -> tuple[int, ...]:
        """(K, N) of the weight it lays out."""
        return self.w.shape

    @property
    def dtype(self):
        """The weight's dtype (bfloat16)."""
        return self.w.dtype

    def unpack(self) -> jax.Array:
        """w [K, N] row-major."""
        return unpack_bf16(self.w)

    logical = unpack


def pack_weight(w):
    """A bf16 array w [K, N] as a PackedWeight if `packable(K, N)`; anything else unchanged."""
    if (isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.bfloat16
            and packable(*w.shape)):
        return PackedWeight(w=_pack(w))
    return w


# ------------------------------------------------------------------ int8 tiles
def tileable(K: int, N: int) -> bool:
    """Whether an int8 q [K, N] is one `tile_int8` lays out: whole tiles, and a narrow row."""
    return K % TILE_ROWS == 0 and N % TILE_COLS == 0 and 0 < N <= TILE_MAX_COLS and K > 0


def check_tileable(q) -> tuple[int, int]:
    """(K, N) of q, or a ValueError unless `tileable`."""
    if q.ndim != 2 or not tileable(*q.shape):
        raise ValueError(f"a tiled int8 q is [K, N] with K a multiple of {TILE_ROWS} and N a "
                         f"multiple of {TILE_COLS} up to {TILE_MAX_COLS}, got {list(q.shape)}")
    return q.shape


def tile_int8(q: jax.Array) -> jax.Array:
    """q [K, N] -> the same values tiled, still [K, N]: for rows [16t, 16t + 16) and columns
    [32b, 32b + 32), 512 contiguous bytes, 8 lines of (column, row pair) with the two rows of a pair
    adjacent: tiled[t, b, p, c, j] = q[16t + 2p + j, 32b + c]. `untile_int8` inverts it."""
    K, N = check_tileable(q)
    t = q.reshape(K // TILE_ROWS, TILE_ROWS // 2, 2, N // TILE_COLS, TILE_COLS)
    return t.transpose(0, 3, 1, 4, 2).reshape(K, N)


def untile_int8(q: jax.Array) -> jax.Array:
    """The inverse of `tile_int8`: tiled [K, N] -> q [K, N] row-major."""
    K, N = check_tileable(q)
    t = q.reshape(K // TILE_ROWS, N // TILE_COLS, TILE_ROWS // 2, TILE_COLS, 2)
    return t.transpose(0, 2, 4, 1, 3).reshape(K, N)


@struct.dataclass
class TiledInt8Weight:
    """An Int8Weight with q [K, N] laid out by `tile_int8`, scale [N] fp32."""
    q: jax.Array
    scale: jax.Array
    # static, so the node never equals the logical weight (see above PackedWeight)
    layout: str = struct.field(pytree_node=False, default="int8_tiles")
    is_int8 = True  # a quantized head for models/quant.py's is_quantized

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the weight it lays out."""
        return tuple(self.q.shape)

    def logical(self) -> Int8Weight:
        """The models/weights.py value it lays out."""
        return Int8Weight(q=untile_int8(self.q), scale=self.scale)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """w [K, N] in `dtype` (the logical value dequantized)."""
        return self.logical().dequantize(dtype)


def tile_weight(w):
    """An Int8Weight as a TiledInt8Weight if `tileable`; anything else unchanged."""
    if isinstance(w, Int8Weight) and tileable(*w.q.shape):
        return TiledInt8Weight(q=_tile(w.q), scale=w.scale)
    return w


# ------------------------------------------------------------------ int4 tiles
def _check_tiles(tiles) -> tuple[int, int]:
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
    if not int4_quantizable(K, N) or scale.shape != (K // GROUP, N) or offset.shape != scale.shape:
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


@struct.dataclass
class Int4Tiles:
    """An Int4Weight w [K, N] as tiles [K/32, N/32, 640] uint8 (`pack_int4`)."""
    tiles: jax.Array
    # static, so the node never equals the logical weight (see above PackedWeight)
    layout: str = struct.field(pytree_node=False, default="int4_tiles")

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the weight it lays out."""
        G, NB = _check_tiles(self.tiles)
        return G * GROUP, NB * BLOCK

    def logical(self) -> Int4Weight:
        """The models/weights.py value it lays out."""
        return Int4Weight(*unpack_int4(self.tiles))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """w [K, N] in `dtype` (the logical value dequantized)."""
        return self.logical().dequantize(dtype)


def tile_int4(w):
    """An Int4Weight as Int4Tiles; anything else unchanged."""
    if isinstance(w, Int4Weight):
        return Int4Tiles(tiles=_pack4(w.q, w.scale, w.offset))
    return w


_pack, _tile, _pack4 = jax.jit(pack_bf16), jax.jit(tile_int8), jax.jit(pack_int4)


# ------------------------------------------------------------------ params
def untie_lm_head(params: Params) -> Params:
    """A tied model's head as its own array, lm_head = embed.T [hidden, V] (same values; one more
    copy of the embedding in memory, read in place of it by a decode step)."""
    if params.lm_head is not None:
        return params
    return params.replace(lm_head=jnp.asarray(params.embed).T)  # a new array: no second copy


def _each_dense(params: Params, fn) -> Params:
    layers = tuple(lp.replace(**{n: fn(getattr(lp, n)) for n in DENSE_WEIGHTS})
                   for lp in params.layers)
    return params.replace(layers=layers, lm_head=fn(params.lm_head))


def _layout(w):
    if has_feature("bf16_strips"):
        w = pack_weight(w)
    if has_feature("int8_tiles"):
        w = tile_weight(w)
    if has_feature("int4"):
        w = tile_int4(w)
    return w


def prepare(params: Params) -> Params:
    """The cpu backend's layout pass over logical params, applied once: a tied head untied; bf16
    dense weights and the head packed where `has_feature("bf16_strips")`; narrow int8 ones tiled
    where "int8_tiles"; int4 ones as tiles where "int4" (elsewhere they stay logical, served by
    XLA). fp32 and odd-shaped weights, the embedding, norms and biases stay as they are; params
    already prepared come back the same."""
    if not isinstance(params, Params):
        raise TypeError(f"prepare takes ssd_jax.models.params.Params, got {type(params).__name__}")
    return _each_dense(untie_lm_head(params), _layout)


def _logical(w):
    return w.logical() if isinstance(w, (PackedWeight, TiledInt8Weight, Int4Tiles)) else w


def to_logical(params: Params) -> Params:
    """Every layout of `prepare` back to its models/weights.py value (the untied head stays)."""
    return _each_dense(params, _logical)


def is_prepared(params: Params) -> bool:
    """Whether any dense weight is in one of this backend's layouts."""
    ws = [getattr(lp, n) for lp in params.layers for n in DENSE_WEIGHTS] + [params.lm_head]
    return any(isinstance(w, (PackedWeight, TiledInt8Weight, Int4Tiles)) for w in ws)


__all__ = ["Int4Tiles", "PackedWeight", "TiledInt8Weight", "check_packable", "check_tileable",
           "is_prepared", "pack_bf16", "pack_int4", "pack_weight", "packable", "prepare",
           "tile_int4", "tile_int8", "tile_weight", "tileable", "to_logical", "unpack_bf16",
           "unpack_int4", "untie_lm_head", "untile_int8"]
