"""Defaults that are fast on this machine: the backend, the weight dtype, the draft's format and
the SSD layout, chosen from what this machine's kernels serve.

- `cpu_features()`: the CPU's model name and the instruction-set flags the kernels care about
  (from /proc/cpuinfo; all False, `known` False, off Linux), plus `SSD_JAX_CPU_ISA` where set.
  Benchmarks record it beside every figure.
- `choose(backend, dtype, draft_quant)`: the backend table (`ssd_jax.models.backends.select`)
  and, for "auto", the dtype and draft format with a fast path in it (`backends.defaults`),
  checked against the CPU's own features on a CPU platform: bf16 counts as fast only where the
  AVX-512 BF16 kernels serve it, int8 / int4 drafts only where the VNNI kernels do, so the choice
  is never slower than plain XLA in fp32. An explicit draft format with no fast path here is
  converted to "none" with one warning; an explicit bf16 without a fast path warns once that
  fp32 is faster here (and stays bf16: the user asked for it).
- `ssd_layout()`: how the CLI runs SSD, decided without starting a JAX backend (the two-process
  transport must start before any other JAX use): "two-process" (the draft in its own process on
  its own core, the layout that really overlaps on a CPU) on a CPU platform with >= 2 usable
  cores, "split" otherwise, with a one-line reason.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform as _platform
import warnings
from pathlib import Path

# the /proc/cpuinfo flags the kernels (and a reader of a benchmark) care about
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
         "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# what SSD_JAX_CPU_ISA=avx2 builds the kernels without (models/cpu/build.py: -march=x86-64-v3)
AVX512 = tuple(f for f in FLAGS if f.startswith(("avx512", "amx")))
QUANT_PREFERENCE = ("int4", "int8", "none")  # fewest bytes per draft step first
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                       "jax_rocm7_plugin", "libtpu")
_WARNED: set[str] = set()


# ------------------------------------------------------------------------------------------ CPU
def cpu_features(cpuinfo: str | None = None) -> dict:
    """{"model": the CPU's model name (or None), "machine": platform.machine(), "known": whether
    the flags were read, each of `FLAGS`: bool, and "SSD_JAX_CPU_ISA" where that variable is set
    (then `masked` lists the flags the kernels are built without)}. `cpuinfo`: the text of
    /proc/cpuinfo (default: read it; off Linux the flags are all False and `known` False)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
    info = {"model": model or _platform.processor() or None, "machine": _platform.machine(),
            "known": flags is not None,
            **{f: f in (flags or ()) for f in FLAGS}}
    isa = os.environ.get("SSD_JAX_CPU_ISA", "").strip().lower()
    if isa:
        info["SSD_JAX_CPU_ISA"] = isa
        if isa == "avx2":
            info["masked"] = [f for f in AVX512 if info[f]]
    return info


def effective(features: dict, flag: str) -> bool:
    """Whether the kernels can use `flag`: the CPU has it and `SSD_JAX_CPU_ISA` does not mask it."""
    return bool(features.get(flag)) and flag not in features.get("masked", ())


def describe(features: dict | None = None) -> str:
    """One line for a report: "<model>: avx2 fma avx512f ... (SSD_JAX_CPU_ISA=avx2 masks ...)"."""
    f = cpu_features() if features is None else features
    have = [x for x in FLAGS if f.get(x)]
    line = f"{f.get('model') or f.get('machine') or 'unknown CPU'}: " + (
        " ".join(have) if f.get("known") else "flags unknown")
    if f.get("SSD_JAX_CPU_ISA"):
        masked = f.get("masked")
        line += f" (SSD_JAX_CPU_ISA={f['SSD_JAX_CPU_ISA']}" + (
            f" masks {' '.join(masked)})" if masked else ")")
    return line


# ------------------------------------------------------------------------------------------ choose
@dataclasses.dataclass(frozen=True)
class _StandIn:
    """A device as far as `backends.select` looks at one (its platform), so a backend can be
    chosen before JAX starts a backend (the two-process transport needs that)."""
    platform: str


def _warn_once(msg: str, notes: list[str]) -> None:
    notes.append(msg)
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def _platform_of(mesh, platform: str | None) -> str:
    if platform is not None:
        return platform
    if mesh is None:
        import jax
        return jax.devices()[0].platform
    devs = getattr(mesh, "devices", None)
    return (list(devs.flat) if devs is not None else list(mesh))[0].platform


def fast_paths(ops, platform: str, features: dict | None = None) -> tuple[tuple[str, ...],
                                                                           tuple[str, ...]]:
    """(dtypes, draft formats) with a fast path for `ops` on `platform`, best first: the table's
    own hints (`ops.fast_dtypes`, `ops.fast_quant`), on a CPU kept to what its features serve.
    On a CPU only the cpu kernels (a table whose name starts with "cpu") run bf16 fast, and only
    with AVX-512 BF16; int8 and int4 need AVX-512 VNNI; XLA's CPU ops are fastest in fp32 and
    dequantize a quantized weight on every call."""
    dtypes, quants = tuple(ops.fast_dtypes), tuple(ops.fast_quant)
    if platform != "cpu":
        return dtypes, quants or ("none",)
    f = cpu_features() if features is None else features
    kernels = ops.name.startswith("cpu")
    unknown = not f.get("known")  # off Linux: trust the table's hints

    def ok_dtype(d):
        if d == "float32":
            return True
        return kernels and d == "bfloat16" and (unknown or effective(f, "avx512_bf16"))

    def ok_quant(q):
        if q == "none":
            return True
        return kernels and (unknown or effective(f, "avx512_vnni"))

    dtypes = tuple(d for d in dtypes if ok_dtype(d)) or ("float32",)
    quants = tuple(q for q in quants if ok_quant(q))
    return dtypes, ("none", *[q for q in quants if q != "none"])


def _why(ops, plat: str, f: dict, flag: str, name: str) -> str:
    """Why a format has no fast path with `ops` on `plat`, in a few words."""
    if plat != "cpu" or not ops.name.startswith("cpu"):
        return (f"the {ops.name} backend on a {plat.upper()} has none; on a CPU only the cpu "
                f"backend's {name} kernels do" if plat == "cpu" else
                f"the {ops.name} backend on {plat} has none")
    if flag in f.get("masked", ()):
        return f"SSD_JAX_CPU_ISA={f.get('SSD_JAX_CPU_ISA')} builds the kernels without {name}"
    if not f.get(flag):
        return f"this CPU ({f.get('model') or 'unknown'}) has no {name}"
    return "the cpu backend's kernels do not serve it on this CPU"


def choose(backend="auto", dtype: str = "auto", draft_quant: str = "auto", mesh=None, *,
           platform: str | None = None, features: dict | None = None) -> dict:
    """{"backend": the `Ops`, "dtype": "float32" | "bfloat16", "draft_quant": "none" | "int8" |
    "int4", "notes": [the warnings given]}.

    backend: "auto" or a name of `backends.backend_names()` (ValueError otherwise) or an `Ops`;
    mesh: where it runs (`backends.select`; None: the default device). `platform` ("cpu", "gpu",
    ...) instead of a mesh chooses without starting a JAX backend (for the two-process
    transport). dtype "auto": the best fast dtype (`backends.defaults`, kept to the CPU's features
    by `fast_paths`). draft_quant "auto": the first of int4, int8, none with a fast path; an
    explicit int8 / int4 without one becomes "none" with one warning saying why."""
    from ssd_jax.models import backends
    from ssd_jax.models.config import canonical_dtype

    if not isinstance(backend, str) and not hasattr(backend, "fast_dtypes"):
        raise ValueError(f"backend must be a name or an Ops, got {type(backend).__name__}")
    if isinstance(backend, str) and backend not in backends.backend_names():
        raise ValueError(f"unknown backend {backend!r}: choose one of "
                         f"{', '.join(backends.backend_names())}")
    if dtype != "auto":
        dtype = canonical_dtype(dtype)
    if draft_quant not in ("auto", *QUANT_PREFERENCE):
        raise ValueError(f"unknown draft format {draft_quant!r}: use auto, none, int8 or int4")
    plat = _platform_of(mesh, platform)
    if backend == "pallas" and mesh is None and platform is not None:
        ops = backends.pallas_ops(plat)  # probed where it runs (the Engine selects it by name)
    else:
        ops = backends.select(backend, [_StandIn(plat)] if mesh is None and platform is not None
                              else mesh)
    f = cpu_features() if features is None else features
    fast_d, fast_q = fast_paths(ops, plat, f)
    notes: list[str] = []
    if dtype == "auto":
        dtype = backends.defaults(ops)["dtype"]
        if dtype not in fast_d:
            dtype = fast_d[0]
    elif dtype == "bfloat16" and "bfloat16" not in fast_d:
        _warn_once(f"ssd_jax: bfloat16 has no fast path here "
                   f"({_why(ops, plat, f, 'avx512_bf16', 'AVX-512 BF16')}): float32 is faster "
                   f"(--dtype auto picks it)", notes)
    if draft_quant == "auto":
        draft_quant = next(q for q in QUANT_PREFERENCE if q in fast_q)
    elif draft_quant not in fast_q:
        _warn_once(f"ssd_jax: an {draft_quant} draft has no fast path here "
                   f"({_why(ops, plat, f, 'avx512_vnni', 'AVX-512 VNNI')}; the XLA path would "
                   f"dequantize its weights on every step): the draft runs unquantized instead", notes)
        draft_quant = "none"
    return {"backend": ops, "dtype": dtype, "draft_quant": draft_quant, "notes": notes}


# ------------------------------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """How the CLI runs SSD: placement "two-process" (cores = (target core, draft core)) or
    "split" (cores None), and why, in one line."""
    placement: str
    cores: tuple[int, int] | None
    reason: str


def usable_cores() -> list[int]:
    """The CPUs this process may run on (`os.sched_getaffinity`; all of `os.cpu_count()` where
    that does not exist)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def accelerator_plugin() -> str | None:
    """The name of an importable JAX accelerator plug-in (CUDA, ROCm, TPU), or None; looked up
    without importing it."""
    for name in ACCELERATOR_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            pass
    try:  # plug-ins installed under the jax_plugins namespace (e.g. jax_plugins.xla_cuda12)
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        import pkgutil
        for mod in pkgutil.iter_modules(list(spec.submodule_search_locations)):
            if any(k in mod.name for k in ("cuda", "rocm", "tpu", "metal")):
                return f"jax_plugins.{mod.name}"
    return None


def _jax_started() -> str | None:
    """Why this process can no longer start the two-process transport, or None."""
    import sys
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import distributed, xla_bridge
        if distributed.global_state.client is not None:
            return "jax.distributed is already initialised in this process"
        if xla_bridge._backends:
            return "JAX already started a backend in this process"
    except (ImportError, AttributeError):
        return None
    return None


def ssd_layout(cores: list[int] | None = None, env: dict | None = None) -> Layout:
    """The SSD placement for the CLI, decided without starting a JAX backend: "two-process" with
    the target on the first usable core and the draft on the second, on a CPU platform with >= 2
    usable cores; else "split", saying why. `cores` (default `usable_cores()`) and `env` (default
    os.environ, for JAX_PLATFORMS) are for tests."""
    env = os.environ if env is None else env
    cores = usable_cores() if cores is None else sorted(cores)
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and platforms[0] != "cpu":
        return Layout("split", None, f"JAX_PLATFORMS={env['JAX_PLATFORMS']} puts the models on "
                                     f"{platforms[0]}, not the CPU; running split in one process")
    if not platforms:
        plugin = accelerator_plugin()
        if plugin is not None:
            return Layout("split", None, f"an accelerator plug-in ({plugin}) is installed; "
                                         f"running split in one process (JAX_PLATFORMS=cpu runs "
                                         f"the draft in its own process)")
    started = _jax_started()
    if started is not None:
        return Layout("split", None, f"{started}; running split in one process")
    if len(cores) < 2:
        return Layout("split", None, f"only {len(cores)} usable core; running split in one process")
    return Layout("two-process", (cores[0], cores[1]),
                  f"the draft in its own process on core {cores[1]}, the target on core {cores[0]}")


__all__ = ["FLAGS", "Layout", "accelerator_plugin", "choose", "cpu_features", "describe",
           "effective", "fast_paths", "ssd_layout", "usable_cores"]
