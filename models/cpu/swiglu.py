"""The MLP's SwiGLU, silu(gate) * up: the CPU kernel's call (kernels/swiglu.h) and the cpu backend's
`swiglu`, whose reference is `ssd_jax.models.ops.xla_swiglu`.

Why: between w_gate_up and w_down XLA:CPU runs it as one fusion split into two tasks for its
intra-op pool. Waking a pool thread cost 40-90 us a call for ~5 us of work, 28 calls a decode step
of the 1.5B target. The kernel does a decode's values on the calling thread in ~14 us (with the
FFI call); with XLA's fusion instead the step took 1.0-1.9% longer on two cores
(benchmarks/ab_decode_step.py, `xla-swiglu`).

Both compute, for gate_up [..., 2I] with the gate's columns first, the reference's ops each
rounded to its dtype: e = exp(-gate), a = e + 1, d = 1 / a, s = gate * d, out = s * up. The
kernel's exp is the Cephes polynomial (kernels/exp16.h) that XLA:CPU's own exp matches: the
two agree bit for bit on every bf16 gate value and on 2M random fp32 ones, NaN and inf included
(tests/cpu/test_cpu_swiglu.py; should an XLA release change its exp, that test says so).
Elementwise: a token's value does not depend on the other rows, so a verify's rows equal the
decodes'.
"""
from __future__ import annotations

import jax

from ssd_jax.models.cpu.build import DTYPES, TARGET_SWIGLU, available, dispatch, require
from ssd_jax.models.ops import xla_swiglu


def _check(gate_up) -> None:
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] (gate columns, then up), got shape "
                         f"{list(gate_up.shape)}")


def kernel(gate_up: jax.Array) -> jax.Array:
    """The FFI call itself (CPU only); argument and result as `xla_swiglu`, fp32 or bf16."""
    require()
    _check(gate_up)
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"kernel takes float32 or bfloat16 gate_up, got {gate_up.dtype}")
    out = jax.ShapeDtypeStruct((*gate_up.shape[:-1], gate_up.shape[-1] // 2), gate_up.dtype)
    return jax.ffi.ffi_call(TARGET_SWIGLU, out)(gate_up)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """The cpu backend's `swiglu`: `kernel` where it serves (the CPU backend, the kernel built,
    fp32 or bf16), else `xla_swiglu`. Differentiable: the grad is xla_swiglu's."""
    _check(gate_up)
    if not (gate_up.dtype in DTYPES and gate_up.size and jax.default_backend() == "cpu"
            and available()):
        return xla_swiglu(gate_up)
    return dispatch(kernel, xla_swiglu, gate_up)


__all__ = ["kernel", "swiglu"]
