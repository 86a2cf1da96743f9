"""The one place that looks at which JAX / jaxlib is installed.

The package is tested on the oldest JAX its pyproject admits and on the newest the registry serves
(README "Install"); where the two need different code, the switch lives here, named after what
changed and the version that changed it, so a later floor lift deletes one line.
"""
from __future__ import annotations

import jaxlib


def _release(version: str) -> tuple[int, ...]:
    """'0.12.0.1' -> (0, 12, 0, 1); a local or pre-release tail ('0.13.0.dev2026') stops the parse."""
    parts = []
    for piece in version.split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


JAXLIB_VERSION = _release(jaxlib.__version__)

# XLA:CPU's classic elemental emitters: jaxlib 0.11 dropped them with their switch
# (`--xla_cpu_use_fusion_emitters`, only a reserved name in 0.11.2's and 0.12's XLA), and an
# unknown XLA flag aborts the process when the CPU client starts, so the flag may be set only where
# the emitters still exist.
XLA_CPU_HAS_CLASSIC_EMITTERS = JAXLIB_VERSION < (0, 11)

# XLA:CPU's fp32 logistic: in jaxlib 0.10 it is Cephes' expf, which the cpu backend's SiLU
# (models/cpu/kernels/exp16.h) reproduces bit for bit; jaxlib 0.11.2 and 0.12 compute it differently
# for gates in about [-86, -7.6] (up to 2 ulp apart there; bf16 rounds the difference away).
XLA_CPU_FP32_LOGISTIC_IS_CEPHES = JAXLIB_VERSION < (0, 11)
