"""The cpu backend: ssd_jax's C++ CPU kernels (kernels/*.cc, *.h, built on first use) as a plug-in
backend table, found by `ssd_jax.models.backends` through the `ssd_jax.backends` entry point
(`cpu = "ssd_jax.models.cpu:backend"`). No core module imports this package.

`backend()` is an `ssd_jax.models.ops.Ops` whose `dense`, `attend` and `swiglu` run the kernels
where they serve and the XLA reference ops elsewhere, whose `prepare` lays weights out for them
once (`layouts.prepare`), and whose tree attention and cache gather are XLA's. Every op is
differentiable: its grad is its XLA reference's (`build.differentiable`).

Modules: `build` (compile, load, `available`, `features`, `isa`; `SSD_JAX_CPU_ISA=avx2` builds
for a CPU without AVX-512), `matmul` (fp32 / bf16 / int8 matmuls), `int4`, `attention`,
`swiglu`, `layouts` (packed bf16 strips, tiled int8, int4 tiles, the untied head, `prepare`).
"""
from __future__ import annotations

import functools

from ssd_jax.models.cpu import attention, build, int4, layouts, matmul, swiglu
from ssd_jax.models.cpu.build import available, features, has_feature, isa, use_helper_thread
from ssd_jax.models.ops import Ops, xla_dense
from ssd_jax.models.weights import Int4Weight, Int8Weight


def dense(x, w, *, transpose_w: bool = False, preferred_element_type=None):
    """The cpu backend's `dense` (models/ops.py's signature): arrays and `layouts.PackedWeight`
    through `matmul.matmul`; `Int8Weight` and `layouts.TiledInt8Weight` through
    `matmul.matmul_int8`; `Int4Weight` and `layouts.Int4Tiles` through `int4.matmul_int4`; each
    the kernel where it serves and `xla_dense` (on the logical value) where it does not."""
    kw = dict(preferred_element_type=preferred_element_type)
    if isinstance(w, (Int8Weight, layouts.TiledInt8Weight, Int4Weight, layouts.Int4Tiles)):
        if transpose_w:
            raise ValueError("a quantized weight is always [K, N]: transpose_w does not apply")
        if isinstance(w, (Int8Weight, layouts.TiledInt8Weight)):
            return matmul.matmul_int8(x, w, **kw)
        return int4.matmul_int4(x, w, **kw)
    if isinstance(w, layouts.PackedWeight) and transpose_w:
        return xla_dense(x, w.unpack(), transpose_w=True, **kw)
    if not isinstance(w, layouts.PackedWeight) and not hasattr(w, "dtype"):
        return xla_dense(x, w, transpose_w=transpose_w, **kw)  # its error names the layout
    return matmul.matmul(x, w, transpose_w=transpose_w, **kw)


def _fast_dtypes() -> tuple[str, ...]:
    return ("bfloat16", "float32") if has_feature("bf16_strips") else ("float32",)


def _fast_quant() -> tuple[str, ...]:
    return ("none", *(["int8"] if has_feature("int8_tiles") else []),
            *(["int4"] if has_feature("int4") else []))


@functools.cache
def _backend() -> Ops:
    return Ops(name="cpu", dense=dense, attend=attention.attend, swiglu=swiglu.swiglu,
               prepare=layouts.prepare, fast_dtypes=_fast_dtypes(), fast_quant=_fast_quant(),
               custom_calls=tuple(target for target, _ in build._ENTRIES))


def backend() -> Ops:
    """The cpu backend table; `RuntimeError` saying why where the kernel library is not
    available (no compiler, a failed build, `SSD_JAX_CPU_KERNELS=0`)."""
    if not available():
        raise RuntimeError(f"the cpu backend is not available: {build.reason()}")
    return _backend()


__all__ = ["attention", "available", "backend", "build", "dense", "features", "has_feature",
           "int4", "isa", "layouts", "matmul", "swiglu", "use_helper_thread"]
