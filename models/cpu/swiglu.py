"""The MLP's SwiGLU, silu(gate) * up: the plain-`jnp` reference and the CPU kernel's call
(models/cpu_kernels/swiglu.h, built with the small-M matmul).

Why: between w_gate_up and w_down XLA:CPU runs it as one fusion split into two tasks for its
intra-op pool. Waking a pool thread cost 40-90 us a call for ~5 us of work, 28 calls a decode step
of the 1.5B target. The kernel does a decode's values on the calling thread in ~14 us (with the
FFI call); with XLA's fusion instead the step took 1.0-1.9% longer on two cores
(benchmarks/ab_decode_step.py, `xla-swiglu`).

Both compute, for gate_up [..., 2I] with the gate's columns first, the reference's ops each
rounded to its dtype: e = exp(-gate), a = e + 1, d = 1 / a, s = gate * d, out = s * up. The
kernel's exp is the Cephes polynomial (cpu_kernels/exp16.h) that XLA:CPU's own exp matches: the
two agree bit for bit on every bf16 gate value and on 2M random fp32 ones, NaN and inf included
(tests/test_cpu_swiglu.py; should an XLA release change its exp, that test says so). Elementwise:
a token's value does not depend on the other rows, so a verify's rows equal the decodes'.
"""
from __future__ import annotations

import jax

from ssd_jax.models import cpu_matmul


def reference(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2I] -> silu(gate_up[..., :I]) * gate_up[..., I:], [..., I]."""
    I = gate_up.shape[-1] // 2
    return jax.nn.silu(gate_up[..., :I]) * gate_up[..., I:]


def _check(gate_up) -> None:
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] (gate columns, then up), got shape "
                         f"{list(gate_up.shape)}")


def kernel(gate_up: jax.Array) -> jax.Array:
    """The FFI call itself (CPU only); argument and result as `reference`, fp32 or bf16."""
    if not cpu_matmul.available():
        raise RuntimeError("the CPU kernels are not available on this machine")
    _check(gate_up)
    if gate_up.dtype not in cpu_matmul.DTYPES:
        raise ValueError(f"kernel takes float32 or bfloat16 gate_up, got {gate_up.dtype}")
    out = jax.ShapeDtypeStruct((*gate_up.shape[:-1], gate_up.shape[-1] // 2), gate_up.dtype)
    return jax.ffi.ffi_call(cpu_matmul.TARGET_SWIGLU, out)(gate_up)


def swiglu(gate_up: jax.Array, *, enabled: bool = True) -> jax.Array:
    """`kernel` where it serves (the CPU backend, the kernel built, `enabled` - a static choice:
    `ModelConfig.cpu_kernels` - fp32 or bf16), else `reference`. `lax.platform_dependent` keeps the
    reference for any non-CPU lowering."""
    _check(gate_up)
    if not (enabled and gate_up.dtype in cpu_matmul.DTYPES and gate_up.size
            and jax.default_backend() == "cpu" and cpu_matmul.available()):
        return reference(gate_up)
    return jax.lax.platform_dependent(gate_up, cpu=kernel, default=reference)


__all__ = ["kernel", "reference", "swiglu"]
