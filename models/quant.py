"""Int8 (and int4) weights for a draft model: int8 symmetric, one fp32 scale per output column.

Why: on a CPU a decode step reads every weight once, so its time is its bytes. A 0.5B draft in bf16
streams ~1 GB per step, about a third of the 1.5B target's; in int8 it streams half that, and SD's
round (K draft steps + one verify) gets that much shorter. The draft's proposal rows come from the
int8 model itself, so verification stays exact (ALGORITHM.md §3: any proposal, as long as the tokens were
drawn from the rows the verifier gets); only acceptance can change.

Quantizing a *target* also works, but it changes the distribution SD is exact to: the int8 model is
then the target. `Engine` quantizes nothing on its own; `ssd-jax generate --draft-quant int8` and
`quantize_model` are explicit choices.

Layout: each dense weight w [K, N] (`wqkv`, `wo`, `w_gate_up`, `w_down`, the head) becomes
`Int8Weight(q [K, N] int8, scale [N] fp32)` with w ~= q * scale, scale = max_k |w[k, n]| / 127.
Embedding rows, norms and biases stay in the model's dtype. A tied model gets its own int8 head
(the embedding stays for the token lookup). Narrow weights (rows under 4 KiB) are tiled for the
CPU kernel where it can read them (`cpu_matmul.tile_int8`): the same values in another order. The
matmul takes each row of activations as int16 with its own scale
(`ssd_jax.models.cpu_matmul.quantize_rows_int16`, 2^-16 of the row's largest value), so on a CPU with
AVX512_VNNI the products are exact integer dot products.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models import cpu_matmul, int4
from ssd_jax.models.int4 import Int4Weight
from ssd_jax.models.packed import unpack_params
from ssd_jax.models.params import DENSE_WEIGHTS, Params

QUANT_MODES = ("none", "int8", "int4")


@struct.dataclass
class Int8Weight:
    q: jax.Array  # [K, N] int8, row-major, or laid out by cpu_matmul.tile_int8 where `tiled`
    scale: jax.Array  # [N] float32
    tiled: bool = struct.field(pytree_node=False, default=False)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """w ~= q * scale [K, N] in `dtype` (row-major whatever the layout of q)."""
        q = cpu_matmul.untile_int8(self.q) if self.tiled else self.q
        return (q.astype(jnp.float32) * self.scale).astype(dtype)


@functools.partial(jax.jit, static_argnames="tiled")
def quantize_int8(w: jax.Array, tiled: bool = False) -> Int8Weight:
    """w [K, N] (any float dtype) -> Int8Weight: per-column symmetric, |w - q * scale| <= scale / 2;
    with `tiled`, q laid out by `cpu_matmul.tile_int8` (K, N must be `cpu_matmul.tileable`)."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero column stays exactly zero
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(q=cpu_matmul.tile_int8(q) if tiled else q, scale=scale, tiled=tiled)


def _check_weight(name: str, w) -> jax.Array:
    if isinstance(w, (Int8Weight, Int4Weight)):
        raise ValueError(f"{name} is already quantized: quantize the original params")
    w = jnp.asarray(w)
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name} must be a 2-D float weight, got {w.dtype}{list(w.shape)}")
    if not bool(jnp.all(jnp.isfinite(w))):
        raise ValueError(f"{name} contains NaN or Inf: it cannot be quantized")
    return w


def _quantize(name: str, w, tile: bool, bits: int = 8) -> Int8Weight | Int4Weight:
    w = _check_weight(name, w)
    if bits == 4 and int4.quantizable(*w.shape):
        return int4.quantize_int4(w)
    return quantize_int8(w, tiled=tile and cpu_matmul.tileable(*w.shape))


def quantize_params(params: Params, tile: bool | None = None, mode: str = "int8") -> Params:
    """Params with every dense weight as Int8Weight ("int8") or Int4Weight ("int4"), and the head
    as Int8Weight; see the module docstring. `tile`: lay out the narrow int8 ones with
    `cpu_matmul.tile_int8` (default: where `int8_tiles()`, i.e. this machine's CPU kernel reads
    them; the values, and every result, stay the same)."""
    if not isinstance(params, Params):
        raise TypeError(f"quantize_params takes ssd_jax.models.params.Params, got {type(params).__name__}")
    if mode not in QUANT_MODES[1:]:
        raise ValueError(f"unknown quantization {mode!r}: choose one of {QUANT_MODES[1:]}")
    bits = 4 if mode == "int4" else 8
    tile = cpu_matmul.int8_tiles() if tile is None else bool(tile)
    params = unpack_params(params)
    layers = []
    for i, lp in enumerate(params.layers):
        layers.append(lp.replace(**{n: _quantize(f"layers[{i}].{n}", getattr(lp, n), tile, bits)
                                    for n in DENSE_WEIGHTS}))
    head = params.lm_head if params.lm_head is not None else jnp.asarray(params.embed).T
    return params.replace(layers=tuple(layers), lm_head=_quantize("lm_head", head, tile))


def is_quantized(params: Params) -> bool:
    return isinstance(params.lm_head, Int8Weight)


def quantize_model(model, mode: str = "int8"):
    """A ssd_jax.models.model.Model with its params quantized (`mode` "int8" or "int4"), or the model
    itself for "none" or when it is quantized already; the tokenizer, config and name carry over
    (the name gains "+int8" / "+int4")."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r}: choose one of {QUANT_MODES}")
    if mode == "none" or is_quantized(model.params):
        return model
    return dataclasses.replace(model, params=quantize_params(model.params, mode=mode),
                               name=f"{model.name}+{mode}" if model.name else mode)


__all__ = ["Int4Weight", "Int8Weight", "QUANT_MODES", "is_quantized", "quantize_int8",
           "quantize_model", "quantize_params"]
