"""Building, loading and registering the CPU kernel library (kernels/*.cc, *.h), and what it serves.

The kernels are C++ compiled on first use with the machine's C++ compiler into
`<cache_dir>/kernels/` (see ssd_jax.models.registry.cache_dir), keyed by the sources, compiler,
flags, jaxlib and CPU, and registered as XLA FFI targets for the CPU platform. Where they cannot
be built (no compiler, a failed build) or are turned off (`SSD_JAX_CPU_KERNELS=0`) `available()`
is False and `reason()` says why; `ssd_jax.models.cpu.backend()` then raises, and the backend
selection uses XLA.

`SSD_JAX_CPU_ISA` chooses what the library is built for: "native" (the default, `-march=native`:
every instruction this CPU has) or "avx2" (`-march=x86-64-v3`: AVX2 and FMA, no AVX-512), which
stands in for a CPU without AVX-512 on one that has it (CI, benchmarks): the AVX-512 paths compile
out, so `features()` reports bf16_strips, int8_tiles and int4 False and `prepare` lays out nothing
for them; the kernels' results stay those of the reference ops. Each ISA has its own cache key.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

TARGET_MATMUL = "ssd_jax_small_m_matmul"
TARGET_INT8 = "ssd_jax_small_m_matmul_int8"
TARGET_INT4 = "ssd_jax_small_m_matmul_int4"
TARGET_ATTENTION = "ssd_jax_cache_attention"
TARGET_SWIGLU = "ssd_jax_swiglu"
SOURCE = Path(__file__).with_name("kernels") / "small_m_matmul.cc"  # includes the .h beside it
ISAS = {"native": "-march=native", "avx2": "-march=x86-64-v3"}
_BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-w")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # what every kernel takes

# what the built library serves, set by _load: bf16_strips (AVX512_BF16), int8_tiles and int4
# (AVX512_VNNI)
_FEATURES = {"bf16_strips": False, "int8_tiles": False, "int4": False}
_LIB = [None]  # the loaded library (ctypes), set by _load
_REASON = [""]  # why it is not available, set by _load


def isa() -> str:
    """What the library is (to be) built for: `SSD_JAX_CPU_ISA`, "native" by default."""
    return os.environ.get("SSD_JAX_CPU_ISA", "native").strip().lower() or "native"


def flags() -> tuple[str, ...]:
    """The compiler flags for `isa()`."""
    if isa() not in ISAS:
        raise ValueError(f"unknown SSD_JAX_CPU_ISA={isa()!r}: choose one of {sorted(ISAS)}")
    return (_BASE_FLAGS[0], ISAS[isa()], *_BASE_FLAGS[1:])


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else c++, g++ or clang++ on the PATH (None: none)."""
    return (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            or shutil.which("clang++"))


def build(cxx: str, out_dir: Path) -> Path:
    """The library for `isa()`, compiled into out_dir unless there already."""
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = [f.read_text() for f in sorted(SOURCE.parent.glob("*.[ch]*"))]
    key = hashlib.sha256("\n".join([
        *sources, version, " ".join(flags()), jax.__version__, include, _cpu_fingerprint(),
    ]).encode()).hexdigest()[:16]
    lib = out_dir / f"small_m_matmul-{isa()}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags(), f"-I{include}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


_ENTRIES = ((TARGET_MATMUL, "SsdJaxSmallMMatmul"), (TARGET_INT8, "SsdJaxSmallMMatmulInt8"),
            (TARGET_INT4, "SsdJaxSmallMMatmulInt4"), (TARGET_ATTENTION, "SsdJaxCacheAttention"),
            (TARGET_SWIGLU, "SsdJaxSwiglu"))


@functools.cache
def _load() -> bool:
    """Build (once per machine and ISA), load and register the kernels; False, one warning and
    `reason()` if they cannot be."""
    if os.environ.get("SSD_JAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        _REASON[0] = "turned off by SSD_JAX_CPU_KERNELS=0"
        return False
    cxx = compiler()
    if cxx is None:
        _REASON[0] = "no C++ compiler (set CXX or install g++)"
        warnings.warn(f"ssd_jax: {_REASON[0]}, so the CPU kernels are not available: the CPU "
                      f"runs XLA's ops (a verify costs up to 2x a decode)", stacklevel=3)
        return False
    from ssd_jax.models.registry import cache_dir
    import ctypes
    try:
        lib = ctypes.CDLL(str(build(cxx, cache_dir() / "kernels")))
        for target, symbol in _ENTRIES:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        _FEATURES["int8_tiles"] = bool(lib.SsdJaxInt8Tiles())
        _FEATURES["int4"] = bool(lib.SsdJaxInt4())
        _FEATURES["bf16_strips"] = bool(lib.SsdJaxBf16Strips())
        _LIB[0] = lib
    except (OSError, RuntimeError, AttributeError, ValueError) as e:
        _REASON[0] = f"the CPU kernel library did not build or load ({e})"
        warnings.warn(f"ssd_jax: {_REASON[0]}; using XLA", stacklevel=3)
        return False
    return True


def available() -> bool:
    """Whether the kernels are built and registered on this machine (builds them on first call)."""
    return _load()


def reason() -> str:
    """Why `available()` is False ("" where it is True)."""
    return "" if _load() else _REASON[0]


def require() -> None:
    """A RuntimeError saying why, unless the kernel library is available."""
    if not _load():
        raise RuntimeError(f"the CPU kernels are not available on this machine: {_REASON[0]}")


def has_feature(name: str) -> bool:
    """Whether the built library serves `name`: "bf16_strips" (AVX512_BF16: bf16 weights packed
    in strips), "int8_tiles" (AVX512_VNNI: tiled int8 weights) or "int4" (AVX512_VNNI: int4
    tiles); False where it did not build."""
    if name not in _FEATURES:
        raise ValueError(f"unknown kernel feature {name!r}; known: {sorted(_FEATURES)}")
    return _load() and _FEATURES[name]


def features() -> dict:
    """{"isa": what the library was built for, "available": whether it built, and each feature:
    whether the built library serves it}."""
    ok = _load()
    return {"isa": isa(), "available": ok, **{k: ok and v for k, v in _FEATURES.items()}}


def use_helper_thread(on: bool) -> None:
    """Whether the kernels split their work with their own helper thread (the default) or with
    XLA's intra-op pool alone (kernels/parallel.h says why the helper): a switch for A/B runs such
    as benchmarks/ab_decode_step.py. Takes effect from the next kernel call."""
    require()
    _LIB[0].SsdJaxUseHelper(int(bool(on)))


def differentiable(kernel, reference):
    """`kernel` (a function of arrays) made differentiable: f(*args) = kernel(*args), and the vjp
    of f is the vjp of `reference(*args)` on the same operands (integer operands get float0
    cotangents), so `jax.grad` through a backend op is the grad of its XLA reference."""
    f = jax.custom_vjp(lambda *args: kernel(*args))
    f.defvjp(lambda *args: (kernel(*args), args),
             lambda args, ct: jax.vjp(reference, *args)[1](ct))
    return f


def dispatch(kernel, reference, *args):
    """`differentiable(kernel, reference)(*args)`: the kernel, differentiable through its XLA
    reference. No `lax.platform_dependent` around it: the cpu table is only selected for a CPU
    device (`backends.select` refuses it elsewhere), and the switch traced the reference beside
    every kernel call, most of a step's trace time, for a branch no CPU lowering keeps
    (benchmarks/README.md, "Compile time")."""
    return differentiable(kernel, reference)(*args)


__all__ = ["DTYPES", "ISAS", "available", "build", "compiler", "differentiable", "dispatch", "features", "flags",
           "has_feature", "isa", "reason", "require", "use_helper_thread"]
