"""Small-M fp32 / bf16 / int8-weight matmul on the CPU: ssd_jax's XLA FFI kernel, and the plain-`jnp` reference beside it.

Why: XLA:CPU streams a one-row matmul (decode) at memory bandwidth but runs 2..16 rows (a K+1-token
verify, a few tree branches) as a GEMM that costs 1.5-2.8x as much, although the weights are read
once either way (benchmarks/decode_vs_hf.py). `cpu_kernels/small_m_matmul.cc` streams
each weight once for every row, so a verify costs little more than a decode; on two cores it also
reads the weights faster than XLA's GEMV.

The kernel is C++ compiled on first use with the machine's C++ compiler (`-march=native`) into
`<cache_dir>/kernels/` (see ssd_jax.models.registry.cache_dir), keyed by the source, compiler, flags, jaxlib
and CPU, and registered as an XLA FFI target for the CPU platform. Where it cannot be built (no
compiler) or is turned off (`SSD_JAX_CPU_KERNELS=0`), `matmul` is plain XLA and says why once.

Every output element is accumulated in the same order whatever the number of rows, so a token's
logits in a verify equal its logits in a one-token decode bit for bit (tests/test_cpu_matmul.py).

`matmul_int8` is the same kernel over int8 weights with one fp32 scale per column (a quantized
draft, models/quant.py): a quarter of fp32's bytes per decode step. Its activations are quantized
per row to int16 so that, with AVX512_VNNI, the products are integer dot products (vpdpwssd): that
streams int8 weights at memory bandwidth where widening them to fp32 did not.

bf16 weights can be *packed* (`pack_bf16`, models/packed.py): 32-column strips, each one
sequential stream with pairs of rows interleaved, summed with out's tile held in registers. A
one-row decode reads them ~1.5x as fast as row-major ones and a 5-row verify ~1.9x, with the same
sums bit for bit (cpu_kernels/bf16_strips.h). `ssd_jax.models.load.load_model` packs a bf16 model where
`bf16_strips()` says the kernel can read it.

Narrow int8 weights (rows under 4 KiB: a small draft's wqkv, wo and w_down) can be *tiled*
(`tile_int8`): 16 rows by 32 columns per 512 contiguous bytes, pairs of rows interleaved. A pass of
the kernel then reads one sequential stream instead of 16 short ones, about twice as fast on a Zen 4
core, with the same integer sums. `ssd_jax.models.quant` tiles where `int8_tiles()` says the kernel can.

The custom call has no partitioning rule: on a mesh of several devices XLA would gather its operands,
so tensor-parallel and data-parallel placements turn it off with `ModelConfig.cpu_kernels=False`.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

MAX_ROWS = 16  # fp32: past this XLA's GEMM is as fast (measured: equal at 32 rows on 1536 x 17920)
_TARGET = "ssd_jax_small_m_matmul"
_TARGET_INT8 = "ssd_jax_small_m_matmul_int8"
TARGET_INT4 = "ssd_jax_small_m_matmul_int4"  # called by models/int4.py
TARGET_ATTENTION = "ssd_jax_cache_attention"  # called by models/cpu_attention.py (built here too)
TARGET_SWIGLU = "ssd_jax_swiglu"  # called by models/cpu_swiglu.py (built here too)
_SOURCE = Path(__file__).with_name("cpu_kernels") / "small_m_matmul.cc"  # includes the .h beside it
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-w")


def reference(x: jax.Array, w: jax.Array, transpose_w: bool = False,
              preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] (or w [N, K] transposed) -> [..., N]: what the kernel computes."""
    return jnp.einsum("...k,nk->...n" if transpose_w else "...k,kn->...n", x, w,
                      preferred_element_type=preferred_element_type)


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build(cxx: str, out_dir: Path) -> Path:
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = [f.read_text() for f in sorted(_SOURCE.parent.glob("*.[ch]*"))]
    key = hashlib.sha256("\n".join([
        *sources, version, " ".join(_FLAGS), jax.__version__, include, _cpu_fingerprint(),
    ]).encode()).hexdigest()[:16]
    lib = out_dir / f"small_m_matmul-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


_FEATURES = {"int8_tiles": False, "bf16_strips": False, "int4": False}  # what the built kernel supports, set by _load
_LIB = [None]  # the loaded kernel library (ctypes), set by _load


@functools.cache
def _load() -> str | None:
    """Build (once per machine), load and register the kernel; None and one warning if it cannot."""
    if os.environ.get("SSD_JAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    cxx = _compiler()
    if cxx is None:
        warnings.warn("ssd_jax: no C++ compiler (set CXX or install g++), so small-M matmuls on the "
                      "CPU run as XLA GEMMs: a verify costs up to 2x a decode", stacklevel=3)
        return None
    from ssd_jax.models.registry import cache_dir
    import ctypes
    try:
        lib = ctypes.CDLL(str(_build(cxx, cache_dir() / "kernels")))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SsdJaxSmallMMatmul), platform="cpu")
        jax.ffi.register_ffi_target(_TARGET_INT8, jax.ffi.pycapsule(lib.SsdJaxSmallMMatmulInt8),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_INT4, jax.ffi.pycapsule(lib.SsdJaxSmallMMatmulInt4),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_ATTENTION, jax.ffi.pycapsule(lib.SsdJaxCacheAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_SWIGLU, jax.ffi.pycapsule(lib.SsdJaxSwiglu),
                                    platform="cpu")
        _FEATURES["int8_tiles"] = bool(lib.SsdJaxInt8Tiles())
        _FEATURES["int4"] = bool(lib.SsdJaxInt4())
        _FEATURES["bf16_strips"] = bool(lib.SsdJaxBf16Strips())
        _LIB[0] = lib
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(f"ssd_jax: the small-M CPU matmul kernel did not build ({e}); using XLA",
                      stacklevel=3)
        return None
    return _TARGET


def available() -> bool:
    """Whether the kernel is built and registered on this machine (builds it on the first call)."""
    return _load() is not None


def use_helper_thread(on: bool) -> None:
    """Whether the kernels split their work with their own helper thread (the default) or with
    XLA's intra-op pool alone (cpu_kernels/parallel.h says why the helper): a switch for A/B
    runs such as benchmarks/ab_decode_step.py. Takes effect from the next kernel call."""
    if _load() is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    _LIB[0].SsdJaxUseHelper(int(bool(on)))


def has_feature(name: str) -> bool:
    """Whether the built kernel serves `name`: "bf16_strips" (AVX512_BF16, `pack_bf16`),
    "int8_tiles" (AVX512_VNNI, `tile_int8`) or "int4" (AVX512_VNNI, models/int4.py); False where
    the kernel did not build."""
    if name not in _FEATURES:
        raise ValueError(f"unknown kernel feature {name!r}; known: {sorted(_FEATURES)}")
    return _load() is not None and _FEATURES[name]


def fastest_dtype() -> str:
    """What `ssd-jax generate --dtype auto` (its default) picks: "bfloat16" on an accelerator, or on
    a CPU where this kernel serves bf16 matmuls (1.7x fp32's decode speed here); "float32" on a CPU
    without it, where XLA's own bf16 dots are ~10x slower than fp32 ones."""
    if jax.default_backend() != "cpu":
        return "bfloat16"
    return "bfloat16" if available() else "float32"


DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def kernel(x: jax.Array, w: jax.Array, transpose_w: bool = False, out_dtype=None,
           packed: bool = False) -> jax.Array:
    """The FFI call itself (CPU only): x [..., K], w [K, N] (or [N, K]; or bf16 laid out by
    `pack_bf16` where `packed`) -> [..., N] in `out_dtype` (default x's). Each of them fp32 or bf16;
    the sums are fp32 (bf16 weights are widened in registers, so a bf16 model streams half the
    bytes), rounded to nearest even for a bf16 out."""
    if _load() is None:
        raise RuntimeError("the small-M CPU matmul kernel is not available on this machine")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if x.dtype not in DTYPES or w.dtype not in DTYPES or out_dtype not in DTYPES or w.ndim != 2:
        raise ValueError(f"kernel takes fp32/bf16 x [..., K], a 2-D fp32/bf16 w and an fp32/bf16 "
                         f"out, got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, "
                         f"out {out_dtype}")
    K = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[-1] != K:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, w {list(w.shape)}"
                         f"{' (transposed)' if transpose_w else ''}")
    if packed:
        _pack_shape(w)
        if transpose_w or x.dtype != jnp.bfloat16:
            raise ValueError(f"a packed w takes bf16 x and no transpose, got x {x.dtype}"
                             f"{', transpose_w' if transpose_w else ''}")
        if not _FEATURES["bf16_strips"]:
            raise RuntimeError("this CPU's kernel takes no packed w (it needs AVX512_BF16): "
                               "use the row-major weight (`unpack_bf16`)")
    N = w.shape[0] if transpose_w else w.shape[1]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], N), out_dtype)
    return jax.ffi.ffi_call(_TARGET, out)(x, w, transpose_w=bool(transpose_w), packed=bool(packed))


def _reference_packed(x, w, transpose_w=False, preferred_element_type=None):
    return reference(x, unpack_bf16(w), transpose_w, preferred_element_type)


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, enabled: bool = True,
           preferred_element_type=None, packed: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] (w [N, K] with `transpose_w`; w laid out by `pack_bf16` where
    `packed`) -> [..., N], in x's dtype (or `preferred_element_type`).

    The kernel serves fp32 operands with at most MAX_ROWS rows (the product of x's leading dims)
    and bf16 operands with any number (XLA:CPU's bf16 GEMM is ~10x slower than its fp32 one, so a
    bf16 prefill is faster in the kernel, compute-bound) when the default backend is the CPU and
    `enabled` (a static choice: `ModelConfig.cpu_kernels`); anything else is `reference` (on w
    unpacked). `lax.platform_dependent` keeps the reference for any non-CPU lowering.
    """
    rows = math.prod(x.shape[:-1])
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    ref = _reference_packed if packed else reference
    if not (enabled and x.dtype == w.dtype and x.dtype in DTYPES and out_dtype in DTYPES
            and 0 < rows and (rows <= MAX_ROWS or x.dtype == jnp.bfloat16)
            and jax.default_backend() == "cpu" and _load() is not None
            and (not packed or _FEATURES["bf16_strips"])):
        return ref(x, w, transpose_w, preferred_element_type)
    return jax.lax.platform_dependent(
        x, w, cpu=functools.partial(kernel, transpose_w=transpose_w, out_dtype=out_dtype,
                                    packed=packed),
        default=functools.partial(ref, transpose_w=transpose_w,
                                  preferred_element_type=preferred_element_type))


STRIP_COLS = 32


def bf16_strips() -> bool:
    """Whether `kernel` takes packed bf16 w on this machine (the kernel built, with AVX512_BF16)."""
    return jax.default_backend() == "cpu" and has_feature("bf16_strips")


def packable(K: int, N: int) -> bool:
    """Whether a w [K, N] is one `pack_bf16` lays out: K even, N whole strips of 32 columns."""
    return K > 0 and K % 2 == 0 and N > 0 and N % STRIP_COLS == 0


def _pack_shape(w: jax.Array) -> tuple[int, int]:
    if w.ndim != 2 or not packable(*w.shape):
        raise ValueError(f"a packed w is [K, N] with K even and N a multiple of {STRIP_COLS}, "
                         f"got {list(w.shape)}")
    return w.shape


def pack_bf16(w: jax.Array) -> jax.Array:
    """w [K, N] -> the same values packed in strips, still [K, N] (cpu_kernels/bf16_strips.h):
    32-column strips one after another, each K / 2 blocks of 64 values, the pair of rows (2p,
    2p + 1) of columns 0-15 then 16-31, the two rows of a column adjacent:
    packed[s, p, h, c, j] = w[2p + j, 32s + 16h + c]. `unpack_bf16` inverts it."""
    K, N = _pack_shape(w)
    t = w.reshape(K // 2, 2, N // STRIP_COLS, 2, STRIP_COLS // 2)
    return t.transpose(2, 0, 3, 4, 1).reshape(K, N)


def unpack_bf16(w: jax.Array) -> jax.Array:
    """The inverse of `pack_bf16`: packed [K, N] -> w [K, N] row-major."""
    K, N = _pack_shape(w)
    t = w.reshape(N // STRIP_COLS, K // 2, 2, STRIP_COLS // 2, 2)
    return t.transpose(1, 4, 0, 2, 3).reshape(K, N)


def quantize_rows_int16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] -> (xq [..., K] int16, sx [..., 1] fp32) with x ~= xq * sx, one scale per row:
    xq = round(x * 32767 / max|x|). A row holding NaN or Inf gets xq = 0 and sx = NaN (its products
    are NaN, as they would be unquantized). What the int8 kernel does to its activations: it then
    sums exact integer products (vpdpwssd), |x - xq * sx| <= sx / 2, 2^-16 of the row's largest."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    finite = jnp.isfinite(amax)
    safe = jnp.where(finite & (amax > 0), amax, 1.0)
    xq = jnp.where(finite, jnp.clip(jnp.round(x * (32767.0 / safe)), -32767, 32767), 0.0)
    return xq.astype(jnp.int16), jnp.where(finite, safe / 32767.0, jnp.nan)


TILE_ROWS, TILE_COLS = 16, 32
TILE_MAX_COLS = 4096  # wider int8 rows are long enough runs already: tiling them gained nothing


def int8_tiles() -> bool:
    """Whether `kernel_int8` takes tiled q on this machine (the kernel built, with AVX512_VNNI)."""
    return jax.default_backend() == "cpu" and has_feature("int8_tiles")


def tileable(K: int, N: int) -> bool:
    """Whether an int8 q [K, N] is one `tile_int8` lays out: whole tiles, and a narrow row."""
    return K % TILE_ROWS == 0 and N % TILE_COLS == 0 and 0 < N <= TILE_MAX_COLS and K > 0


def _tile_shape(q: jax.Array) -> tuple[int, int]:
    if q.ndim != 2 or not tileable(*q.shape):
        raise ValueError(f"a tiled int8 q is [K, N] with K a multiple of {TILE_ROWS} and N a "
                         f"multiple of {TILE_COLS} up to {TILE_MAX_COLS}, got {list(q.shape)}")
    return q.shape


def tile_int8(q: jax.Array) -> jax.Array:
    """q [K, N] -> the same values tiled, still [K, N]: for rows [16t, 16t + 16) and columns
    [32b, 32b + 32), 512 contiguous bytes, 8 lines of (column, row pair) with the two rows of a pair
    adjacent: tiled[t, b, p, c, j] = q[16t + 2p + j, 32b + c]. `untile_int8` inverts it."""
    K, N = _tile_shape(q)
    t = q.reshape(K // TILE_ROWS, TILE_ROWS // 2, 2, N // TILE_COLS, TILE_COLS)
    return t.transpose(0, 3, 1, 4, 2).reshape(K, N)


def untile_int8(q: jax.Array) -> jax.Array:
    """The inverse of `tile_int8`: tiled [K, N] -> q [K, N] row-major."""
    K, N = _tile_shape(q)
    t = q.reshape(K // TILE_ROWS, N // TILE_COLS, TILE_ROWS // 2, TILE_COLS, 2)
    return t.transpose(0, 2, 4, 1, 3).reshape(K, N)


def reference_int8(x: jax.Array, q: jax.Array, scale: jax.Array,
                   preferred_element_type=None) -> jax.Array:
    """((xq [..., K] @ q [K, N]) * scale [N]) * sx in fp32 -> [..., N] in x's dtype (or
    `preferred_element_type`), with x's rows as int16 (`quantize_rows_int16`): what `kernel_int8`
    computes, up to the order of its fp32 roundings."""
    xq, sx = quantize_rows_int16(x)
    out = jnp.einsum("...k,kn->...n", xq.astype(jnp.float32), q.astype(jnp.float32)) * scale * sx
    return out.astype(x.dtype if preferred_element_type is None else preferred_element_type)


def kernel_int8(x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype=None,
                tiled: bool = False) -> jax.Array:
    """The FFI call (CPU only): x [..., K] fp32/bf16, q [K, N] int8 (laid out by `tile_int8` if
    `tiled`), scale [N] fp32 -> (x @ q) * scale [..., N] in `out_dtype` (default x's), x's rows taken
    as int16 (`quantize_rows_int16`) and the products summed exactly in int32 (fp32 without
    AVX512_VNNI, which takes no tiled q)."""
    if _load() is None:
        raise RuntimeError("the small-M CPU matmul kernel is not available on this machine")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if (x.dtype not in DTYPES or out_dtype not in DTYPES or q.dtype != jnp.int8 or q.ndim != 2
            or scale.dtype != jnp.float32 or scale.shape != q.shape[1:]):
        raise ValueError(f"kernel_int8 takes fp32/bf16 x [..., K], int8 q [K, N], fp32 scale [N] "
                         f"and an fp32/bf16 out, got x {x.dtype}{list(x.shape)}, q {q.dtype}"
                         f"{list(q.shape)}, scale {scale.dtype}{list(scale.shape)}, out {out_dtype}")
    if x.shape[-1] != q.shape[0]:
        raise ValueError(f"contraction sizes differ: x {list(x.shape)}, q {list(q.shape)}")
    if tiled:
        _tile_shape(q)
        if not _FEATURES["int8_tiles"]:
            raise RuntimeError("this CPU's int8 kernel takes no tiled q (it needs AVX512_VNNI): "
                               "quantize with tiled=False")
    out = jax.ShapeDtypeStruct((*x.shape[:-1], q.shape[1]), out_dtype)
    return jax.ffi.ffi_call(_TARGET_INT8, out)(x, q, scale, tiled=bool(tiled))


def _reference_int8_tiled(x, q, scale, preferred_element_type=None):
    return reference_int8(x, untile_int8(q), scale, preferred_element_type)


def matmul_int8(x: jax.Array, q: jax.Array, scale: jax.Array, *, enabled: bool = True,
                preferred_element_type=None, tiled: bool = False) -> jax.Array:
    """(x [..., K] @ q [K, N]) * scale [N] (q laid out by `tile_int8` if `tiled`): `kernel_int8`
    for any number of rows where the CPU kernel serves (XLA would widen all of q first), else
    `reference_int8` (on q untiled)."""
    out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
    ref = _reference_int8_tiled if tiled else reference_int8
    if not (enabled and x.dtype in DTYPES and out_dtype in DTYPES and math.prod(x.shape[:-1]) > 0
            and jax.default_backend() == "cpu" and _load() is not None
            and (not tiled or _FEATURES["int8_tiles"])):
        return ref(x, q, scale, preferred_element_type)
    return jax.lax.platform_dependent(
        x, q, scale, cpu=functools.partial(kernel_int8, out_dtype=out_dtype, tiled=tiled),
        default=functools.partial(ref, preferred_element_type=preferred_element_type))
