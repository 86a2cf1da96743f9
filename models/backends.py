"""Choosing a backend table (`ssd_jax.models.ops.Ops`) for a mesh: the one place that looks at the
platform and the machine.

Backends:

- `xla`: the reference ops of models/ops.py, on every platform, differentiable.
- `pallas`: the Pallas kernels (`ssd_jax.pallas_kernels`) over the XLA ops: `attend` (a few new
  tokens' cache write and attention in one launch; a prefill block takes the XLA op), `add_norm`
  for a single row (XLA already fuses several into one kernel), the tree's branch write and
  attention and the outcome-conditioned gather; the default on a GPU. On the CPU they run in the
  Pallas interpreter (for tests). A kernel that fails to compile is replaced by its XLA
  reference, with one warning (`without_kernels`).
- plug-ins, found through the `ssd_jax.backends` entry-point group (a name and a zero-argument
  factory returning an `Ops`, which may raise to say it cannot serve this machine) or registered
  at run time with `register_backend`. The package's own CPU kernels (`ssd_jax.models.cpu`) are
  one: the default on a single-device CPU mesh where they build.

`select("auto", mesh)` picks: pallas on GPUs, the cpu plug-in on a one-device CPU mesh where it
loads, xla otherwise (TPUs; meshes of several CPU devices, which XLA must partition: a custom call
has no partitioning rule).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax.models.ops import (XLA, Ops, xla_add_norm, xla_attend, xla_cache_gather,
                                xla_tree_attention)

ENTRY_POINT_GROUP = "ssd_jax.backends"
_RUNTIME: dict[str, Callable[[], Ops]] = {}
_WARNED: set[str] = set()


def register_backend(name: str, factory: Callable[[], Ops]) -> None:
    """Make `factory` (no arguments, returns an `Ops`) selectable as `name`."""
    if name in ("auto", "xla", "pallas"):
        raise ValueError(f"{name!r} is a built-in backend name")
    _RUNTIME[name] = factory


@functools.cache
def _entry_points() -> dict[str, object]:
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> tuple[str, ...]:
    """Every name `select` takes: "auto", the built-ins and the plug-ins found on this install."""
    return ("auto", "xla", "pallas", *sorted(set(_entry_points()) | set(_RUNTIME)))


def _plugin(name: str) -> Ops:
    if name in _RUNTIME:
        return _RUNTIME[name]()
    ep = _entry_points().get(name)
    if ep is None:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(backend_names())}")
    return ep.load()()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


# ------------------------------------------------------------------ the pallas table
def _tree_attention_gpu(*args, window=None):
    from ssd_jax.pallas_kernels.tree_attention import tree_attention
    return tree_attention(*args, window=window)


def _tree_attention_interpret(*args, window=None):
    from ssd_jax.pallas_kernels.tree_attention import tree_attention
    return tree_attention(*args, window=window, interpret=True)


def _cache_gather_gpu(*args):
    from ssd_jax.pallas_kernels.cache_gather import cache_gather
    return cache_gather(*args)


def _cache_gather_interpret(*args):
    from ssd_jax.pallas_kernels.cache_gather import cache_gather
    return cache_gather(*args, interpret=True)


def _attend(q, k_new, v_new, positions, k_cache, v_cache, *, window=None, interpret=False):
    """The cache write and attention in one kernel where it serves (a few new tokens a row),
    else the XLA reference (a prefill block)."""
    from ssd_jax.pallas_kernels.cache_attention import cache_attention, serves
    if not serves(q, k_cache):
        return xla_attend(q, k_new, v_new, positions, k_cache, v_cache, window=window)
    return cache_attention(q, k_new, v_new, positions, k_cache, v_cache, window=window,
                           interpret=interpret)


def _add_norm(x, delta, w, *, eps, interpret=False):
    """The add and the norm in one kernel for a single row (XLA fuses several rows into one
    kernel already), else the XLA reference."""
    from ssd_jax.pallas_kernels.add_norm import add_norm, serves
    if not serves(x) or x.dtype != delta.dtype:
        return xla_add_norm(x, delta, w, eps=eps)
    return add_norm(x, delta, w, eps=eps, interpret=interpret)


def _add_norm_gpu(x, delta, w, *, eps):
    return _add_norm(x, delta, w, eps=eps)


def _add_norm_interpret(x, delta, w, *, eps):
    return _add_norm(x, delta, w, eps=eps, interpret=True)


def _attend_gpu(*args, window=None):
    return _attend(*args, window=window)


def _attend_interpret(*args, window=None):
    return _attend(*args, window=window, interpret=True)


def pallas_ops(platform: str) -> Ops:
    """The pallas table for `platform` ("cpu": the Pallas interpreter; else compiled kernels)."""
    interpret = platform == "cpu"
    return Ops(name="pallas",
               attend=_attend_interpret if interpret else _attend_gpu,
               add_norm=_add_norm_interpret if interpret else _add_norm_gpu,
               tree_attention=_tree_attention_interpret if interpret else _tree_attention_gpu,
               cache_gather=_cache_gather_interpret if interpret else _cache_gather_gpu,
               fast_dtypes=("bfloat16", "float32"),
               # Pallas's Triton calls: JAX's export keeps them only when told (a stored step
               # is keyed by JAX's version, so Triton IR's lack of stability across versions
               # does not reach it)
               custom_calls=() if interpret else ("__gpu$xla.gpu.triton",))


_KERNEL_OPS = {"attend": xla_attend, "add_norm": xla_add_norm,
               "tree_attention": xla_tree_attention, "cache_gather": xla_cache_gather}


def without_kernels(ops: Ops, names=tuple(_KERNEL_OPS), reason: str = "") -> Ops:
    """`ops` with the named kernel ops replaced by their XLA references, warning once; its name
    records which (e.g. "pallas[xla tree_attention]")."""
    names = tuple(n for n in names if getattr(ops, n) is not _KERNEL_OPS[n])
    if not names:
        return ops
    _warn_once(f"ssd_jax: the {ops.name} kernel(s) {', '.join(names)} failed to compile here "
               f"({reason.strip()[:300]}); using the XLA reference op(s) instead")
    name = f"{ops.name}[xla {' '.join(names)}]"
    return dataclasses.replace(ops, name=name, **{n: _KERNEL_OPS[n] for n in names})


def _probe_args():
    """Tiny arguments for each kernel op: a compile of these shows whether it lowers here."""
    B, MQ, H, KVH, D, S, K, V = 1, 2, 4, 2, 64, 32, 3, 256
    f = jnp.float32
    tree = (jax.ShapeDtypeStruct((B, MQ, H, D), f), jax.ShapeDtypeStruct((B, MQ, KVH, D), f),
            jax.ShapeDtypeStruct((B, MQ, KVH, D), f), jax.ShapeDtypeStruct((B, S, KVH, D), f),
            jax.ShapeDtypeStruct((B, S, KVH, D), f), jax.ShapeDtypeStruct((B, MQ), jnp.int32),
            jax.ShapeDtypeStruct((B, MQ, K, KVH, D), f), jax.ShapeDtypeStruct((B, MQ, K, KVH, D), f),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B, MQ), jnp.bool_))
    gather = (jax.ShapeDtypeStruct((B, MQ, 2), jnp.int32), jax.ShapeDtypeStruct((B, MQ), jnp.bool_),
              jax.ShapeDtypeStruct((B, MQ, K), jnp.int32), jax.ShapeDtypeStruct((B, MQ, K, V), f),
              jax.ShapeDtypeStruct((B, 2), jnp.int32))
    T = 2
    attend = (jax.ShapeDtypeStruct((B, T, H, D), f), jax.ShapeDtypeStruct((B, T, KVH, D), f),
              jax.ShapeDtypeStruct((B, T, KVH, D), f), jax.ShapeDtypeStruct((B, T), jnp.int32),
              jax.ShapeDtypeStruct((B, S, KVH, D), f), jax.ShapeDtypeStruct((B, S, KVH, D), f))
    E = 96
    norm = (jax.ShapeDtypeStruct((B, 1, E), f), jax.ShapeDtypeStruct((B, 1, E), f),
            jax.ShapeDtypeStruct((E,), f))
    return {"attend": attend, "add_norm": norm, "tree_attention": tree, "cache_gather": gather}


def probe(ops: Ops, device=None) -> Ops:
    """Compile each kernel op of `ops` at tiny shapes on `device`; the ones that fail are replaced
    by their XLA references (`without_kernels`). Kernels that compile here can still fail at
    other shapes: the draft worker falls back the same way at its first call."""
    failed, why = [], []
    where = None if device is None else jax.sharding.SingleDeviceSharding(device)
    for name, args in _probe_args().items():
        fn = getattr(ops, name)
        if fn is _KERNEL_OPS[name]:
            continue
        if where is not None:
            args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where) for a in args)
        try:
            kw = {"eps": 1e-6} if name == "add_norm" else {}
            jax.jit(functools.partial(fn, **kw)).trace(*args).lower().compile()
        except Exception as e:  # noqa: BLE001 - any lowering or compile failure means: fall back
            failed.append(name)
            why.append(f"{type(e).__name__}: {e}")
    return without_kernels(ops, failed, "; ".join(why)) if failed else ops


def _mesh_devices(mesh):
    if mesh is None:
        return [jax.devices()[0]]
    devs = getattr(mesh, "devices", None)
    return list(devs.flat) if devs is not None else list(mesh)


def select(backend: str | Ops = "auto", mesh=None) -> Ops:
    """The backend table for `mesh` (a `jax.sharding.Mesh`, a list of devices, or None for the
    default device): "auto" | "xla" | "pallas" | a plug-in name (`backend_names()`), or an `Ops`
    (returned as is). See the module docstring for what "auto" picks."""
    if isinstance(backend, Ops):
        return backend
    devices = _mesh_devices(mesh)
    platform = devices[0].platform
    one_device = len(devices) == 1
    if backend == "xla":
        return XLA
    if backend == "pallas":
        return probe(pallas_ops(platform), devices[0] if one_device else None)
    if backend == "auto":
        if platform in ("gpu", "cuda", "rocm"):
            return probe(pallas_ops(platform), devices[0] if one_device else None)
        if platform == "cpu" and one_device and "cpu" in backend_names():
            try:
                return _plugin("cpu")
            except Exception as e:  # noqa: BLE001 - the plug-in says it cannot serve this machine
                _warn_once(f"ssd_jax: the cpu backend is not available ({e}); using xla")
        return XLA
    if backend not in backend_names():
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(backend_names())}")
    if not one_device:
        raise ValueError(f"backend {backend!r} runs on one device; a mesh of {len(devices)} "
                         f"devices needs backend 'xla' (or 'auto')")
    if backend == "cpu" and platform != "cpu":  # its kernels are CPU custom calls, nothing else
        raise ValueError(f"backend 'cpu' runs on CPU devices; this mesh is on {platform!r}: use "
                         f"'auto', 'xla' or 'pallas'")
    return _plugin(backend)


def defaults(ops: Ops) -> dict:
    """What runs fastest with `ops`: {"dtype": the first of `ops.fast_dtypes`, "quant": the draft
    formats with a fast path}."""
    return {"dtype": ops.fast_dtypes[0], "quant": tuple(ops.fast_quant)}


__all__ = ["ENTRY_POINT_GROUP", "backend_names", "defaults", "pallas_ops", "probe",
           "register_backend", "select", "without_kernels"]
