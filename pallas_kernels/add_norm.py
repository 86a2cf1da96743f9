"""The residual add and the RMSNorm after it, for one row, in one launch: the GPU's `add_norm` at
batch 1 (decode, the draft's chain).

The reference is `ssd_jax.models.ops.xla_add_norm`: y = x + delta, then y normalised by its root
mean square in fp32, cast back to y's dtype and scaled by w. Compiled for an H100, XLA gives a
norm over several rows one Triton normalization kernel (with the add fused in), but over a single
row a reduction kernel and a separate multiply (`ssd-jax inspect`), twice a layer: this kernel
makes it one. The row of E values is one program's block (E padded to a power of 2, masked).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ssd_jax.pallas_kernels._compat import (masked_load, masked_store, next_pow2, require_triton,
                                            triton_params)

MAX_WIDTH = 16384  # E one program holds (registers)


def serves(x) -> bool:
    """Whether the kernel takes x [..., E]: one row, E <= MAX_WIDTH, fp32 or bf16."""
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return rows == 1 and x.shape[-1] <= MAX_WIDTH and x.dtype in (jnp.float32, jnp.bfloat16)


def _kernel(x_ref, d_ref, w_ref, y_ref, h_ref, *, eps, width, padded):
    cols = lax.broadcasted_iota(jnp.int32, (padded,), 0) < width
    row = pl.ds(pl.program_id(0) * 0, padded)  # a traced start: the window runs past E, masked
    x = masked_load(x_ref.at[row], mask=cols, other=0)
    y = x + masked_load(d_ref.at[row], mask=cols, other=0)
    yf = y.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(yf * yf) / width + eps)
    w = masked_load(w_ref.at[row], mask=cols, other=0)
    masked_store(y_ref.at[row], y, mask=cols)
    masked_store(h_ref.at[row], w * (yf * r).astype(y.dtype), mask=cols)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_norm(x, delta, w, *, eps: float, interpret: bool = False):
    """(y, rms_norm(y, w, eps)) with y = x + delta, for x, delta [..., E] holding one row and
    w [E]; the results in x's (y) and w's x x's (the norm) dtypes, as the reference."""
    require_triton()
    if not serves(x) or delta.shape != x.shape or w.shape != x.shape[-1:]:
        raise ValueError(f"add_norm takes one row x [..., E <= {MAX_WIDTH}] of fp32 / bf16, delta "
                         f"of its shape and w [E]; got x {x.shape} {x.dtype}, delta {delta.shape}, "
                         f"w {w.shape}")
    E = x.shape[-1]
    Ep = next_pow2(E)
    h_dtype = jnp.result_type(w.dtype, x.dtype)
    spec = pl.BlockSpec((E,), lambda i: (0,))
    y, h = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), width=E, padded=Ep),
        grid=(1,),
        in_specs=[spec, spec, spec],
        out_specs=[spec, spec],
        out_shape=[jax.ShapeDtypeStruct((E,), x.dtype), jax.ShapeDtypeStruct((E,), h_dtype)],
        compiler_params=triton_params(4 if Ep <= 4096 else 8, 1),
        interpret=interpret,
        name="ssd_add_norm",
    )(x.reshape(E), delta.astype(x.dtype).reshape(E), w)
    return y.reshape(x.shape), h.reshape(x.shape)


__all__ = ["MAX_WIDTH", "add_norm", "serves"]
