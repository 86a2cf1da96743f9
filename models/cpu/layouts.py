"""bf16 weights packed for the CPU kernel: the same values, in the order it streams them.

Why: a decode step and a K+1-token verify read every weight once, so their time is how fast the
kernel streams the weights. Row-major, the kernel walks 8 rows of w side by side over a run of
columns: on the 1.5B target's narrow matrices (wqkv, wo, w_down: rows of 3-4 KiB) that is 8 short
streams the prefetchers never ramp up on, and with 5 rows of x (a verify) the loads and stores of
out crowd the loads of w. Packed in 32-column strips (`ssd_jax.models.cpu_matmul.pack_bf16`) each strip is
one sequential stream, its pairs of rows already interleaved for vdpbf16ps, and out's tile stays
in registers: measured on one Zen 4 core, ~27 GB/s of weights at 1 and at 5 rows, against 18-23
and 14-18 row-major (models/cpu_kernels/bf16_strips.h).

The sums are those of the row-major kernel (fp32, k in order), so a packed model gives the same
logits, a verify's rows equal a decode's bit for bit, and the reference path (any other backend, or
`ModelConfig.cpu_kernels=False`) unpacks first. `ssd_jax.models.load.load_model` packs a bf16 model where
`cpu_matmul.bf16_strips()` (AVX512_BF16, kernel built); `unpack_params` undoes it, e.g. before a
tensor-parallel re-layout or quantization (both do it themselves).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models import cpu_matmul
from ssd_jax.models.params import DENSE_WEIGHTS, Params


@struct.dataclass
class PackedWeight:
    """A bf16 dense weight w [K, N] laid out by `cpu_matmul.pack_bf16` (still shaped [K, N])."""
    w: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def unpack(self) -> jax.Array:
        """w [K, N] row-major."""
        return _unpack(self.w)


_pack = jax.jit(cpu_matmul.pack_bf16)
_unpack = jax.jit(cpu_matmul.unpack_bf16)


def pack_weight(w) -> PackedWeight | jax.Array:
    """A bf16 w [K, N] packed, if `cpu_matmul.packable(K, N)`; anything else unchanged."""
    if isinstance(w, PackedWeight) or w is None:
        return w
    if w.ndim != 2 or w.dtype != jnp.bfloat16 or not cpu_matmul.packable(*w.shape):
        return w
    return PackedWeight(w=_pack(w))


def _unpack_weight(w):
    return w.unpack() if isinstance(w, PackedWeight) else w


def pack_params(params: Params) -> Params:
    """Params with every packable bf16 dense weight (and an untied head) as PackedWeight; fp32,
    int8 and odd-shaped weights, the embedding, norms and biases stay as they are."""
    if not isinstance(params, Params):
        raise TypeError(f"pack_params takes ssd_jax.models.params.Params, got {type(params).__name__}")
    layers = tuple(lp.replace(**{n: pack_weight(getattr(lp, n)) for n in DENSE_WEIGHTS})
                   for lp in params.layers)
    return params.replace(layers=layers, lm_head=pack_weight(params.lm_head))


def unpack_params(params: Params) -> Params:
    """The inverse of `pack_params`: every PackedWeight back to a row-major array."""
    if not is_packed(params):
        return params
    layers = tuple(lp.replace(**{n: _unpack_weight(getattr(lp, n)) for n in DENSE_WEIGHTS})
                   for lp in params.layers)
    return params.replace(layers=layers, lm_head=_unpack_weight(params.lm_head))


def is_packed(params: Params) -> bool:
    return (any(isinstance(getattr(lp, n), PackedWeight)
                for lp in params.layers for n in DENSE_WEIGHTS)
            or isinstance(params.lm_head, PackedWeight))


__all__ = ["PackedWeight", "is_packed", "pack_params", "pack_weight", "unpack_params"]
