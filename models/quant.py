"""Int8 (and int4) weights for a draft model: int8 symmetric, one fp32 scale per output column.

Why: on a CPU a decode step reads every weight once, so its time is its bytes. A 0.5B draft in bf16
streams ~1 GB per step, about a third of the 1.5B target's; in int8 it streams half that, and SD's
round (K draft steps + one verify) gets that much shorter. The draft's proposal rows come from the
int8 model itself, so verification stays exact (ALGORITHM.md §3: any proposal, as long as the tokens were
drawn from the rows the verifier gets); only acceptance can change.

Quantizing a *target* also works, but it changes the distribution SD is exact to: the int8 model is
then the target. `Engine` quantizes nothing on its own; `ssd-jax generate --draft-quant int8` and
`quantize_model` are explicit choices.

Layout: each dense weight w [K, N] (`wqkv`, `wo`, `w_gate_up`, `w_down`, the head) becomes the
logical `Int8Weight(q [K, N] int8, scale [N] fp32)` of models/weights.py, w ~= q * scale, scale =
max_k |w[k, n]| / 127, or with "int4" the layers' weights `Int4Weight` (groups of 32 rows with a
bf16 scale and offset; int8 where the shape takes no int4 groups) and the head int8. Embedding
rows, norms and biases stay in the model's dtype. A tied model gets its own int8 head (the
embedding stays for the token lookup). How a backend lays these out for its kernels (the CPU's
int8 tiles and int4 tiles) is its `prepare`'s business (`ssd_jax.models.ops.Ops`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ssd_jax.models.params import DENSE_WEIGHTS, Params
from ssd_jax.models.weights import (Int4Weight, Int8Weight, int4_quantizable, quantize_int4,
                                    quantize_int8)

QUANT_MODES = ("none", "int8", "int4")


def _check_weight(name: str, w) -> jax.Array:
    if isinstance(w, (Int8Weight, Int4Weight)) or getattr(w, "is_int8", False):
        raise ValueError(f"{name} is already quantized: quantize the original params")
    if not isinstance(w, jax.Array) and not hasattr(w, "__array__"):
        raise ValueError(f"{name} is a backend's layout ({type(w).__name__}), not a logical "
                         f"weight: quantize the params before the backend's `prepare`")
    w = jnp.asarray(w)
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name} must be a 2-D float weight, got {w.dtype}{list(w.shape)}")
    if not bool(jnp.all(jnp.isfinite(w))):
        raise ValueError(f"{name} contains NaN or Inf: it cannot be quantized")
    return w


def _quantize(name: str, w, bits: int = 8) -> Int8Weight | Int4Weight:
    w = _check_weight(name, w)
    if bits == 4 and int4_quantizable(*w.shape):
        return quantize_int4(w)
    return quantize_int8(w)


def quantize_params(params: Params, mode: str = "int8") -> Params:
    """Params with every dense weight as Int8Weight ("int8") or Int4Weight ("int4"; Int8Weight
    where its shape takes no int4 groups), and the head as Int8Weight; see the module docstring.
    Takes logical params (before any backend's `prepare`)."""
    if not isinstance(params, Params):
        raise TypeError(f"quantize_params takes ssd_jax.models.params.Params, got {type(params).__name__}")
    if mode not in QUANT_MODES[1:]:
        raise ValueError(f"unknown quantization {mode!r}: choose one of {QUANT_MODES[1:]}")
    bits = 4 if mode == "int4" else 8
    layers = []
    for i, lp in enumerate(params.layers):
        layers.append(lp.replace(**{n: _quantize(f"layers[{i}].{n}", getattr(lp, n), bits)
                                    for n in DENSE_WEIGHTS}))
    head = params.lm_head if params.lm_head is not None else jnp.asarray(params.embed).T
    return params.replace(layers=tuple(layers), lm_head=_quantize("lm_head", head))


def is_quantized(params: Params) -> bool:
    """Whether the head is int8 (logical, or a backend's layout of it that says `is_int8`)."""
    head = params.lm_head
    return isinstance(head, Int8Weight) or bool(getattr(head, "is_int8", False))


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
