"""Version guards shared by the Pallas kernels.

The kernels are written for the Pallas *Triton* backend: on JAX 0.10.2 a `pallas_call` without
compiler params lowers to Mosaic GPU, and only `jax.experimental.pallas.triton.CompilerParams`
selects Triton. From JAX 0.11 that backend is deprecated (importing it may warn) but still present;
JAX 0.12 also warns (DeprecationWarning) each time it lowers a Triton kernel.
If a later JAX drops it, this module must still import: the jnp references keep working and the
kernels raise a clear error when called.
"""
from __future__ import annotations

import warnings

try:  # pragma: no branch - which arm runs depends on the installed JAX
    with warnings.catch_warnings():
        # 0.11 marks the Triton backend deprecated; we select it on purpose.
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as plgpu  # noqa: F401

    TritonCompilerParams = plgpu.CompilerParams
    masked_load = plgpu.load
    masked_store = plgpu.store
    TRITON_IMPORT_ERROR: Exception | None = None
except (ImportError, AttributeError) as e:  # pragma: no cover - only on a JAX without Triton
    plgpu = None
    TritonCompilerParams = None
    masked_load = None
    masked_store = None
    TRITON_IMPORT_ERROR = e


def require_triton() -> None:
    """Raise a readable error when this JAX has no Pallas Triton backend."""
    if TRITON_IMPORT_ERROR is not None:  # pragma: no cover
        raise RuntimeError(
            "pallas_kernels needs jax.experimental.pallas.triton (Pallas Triton backend), which this "
            f"JAX does not provide ({TRITON_IMPORT_ERROR!r}); use the *_reference functions instead."
        )


def triton_params(num_warps: int, num_stages: int):
    """Explicit Triton compiler params (selects the Triton backend; see module docstring)."""
    require_triton()
    return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    """Smallest power of 2 >= n (n >= 1). Triton tensors must have power-of-2 sizes."""
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    """Whether n is a power of 2 (n >= 1)."""
    return n >= 1 and (n & (n - 1)) == 0
