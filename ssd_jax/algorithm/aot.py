"""The step store: jitted steps exported once, so a later process skips tracing and lowering.

JAX's persistent compilation cache keys an XLA compile by the lowered module, so every new process
traces and lowers every step again before it can find its executable (on the default pair, 40% of
what a second start pays). `stored_jit` is `jax.jit` plus a store of the *lowered* steps: the first
process exports each step (`jax.export`: StableHLO with its input and output pytrees) into
`<dir>/<step>-<sha256>.jaxexport`, and a later process deserialises that file and runs it under
`jax.jit`, whose XLA compile the persistent cache then serves. Same computation: the exported
module is what `jax.jit` would have lowered (tests/unit/test_step_store.py compares the tokens of AR
and of sampled SSD, whose steps include SD's, with and without the store, across two processes).

Off unless turned on (`set_store`; the Engine's `step_store`, on in the CLI): with it off a
`stored_jit` step is its `jax.jit` and nothing else. It is for fresh processes running the
library as installed. The key cannot see code patched in memory: in a process where you
monkeypatch a library function the steps call, leave the store off (the file would hold the
patched trace, and `jax.clear_caches` does not reach this module's table either).

What keeps a stored step from being stale: its file name is a SHA-256 of the library's source
(every .py, .cc and .h of the installed `ssd_jax` package), the step's name, a description of every
static argument, the input pytree's structure, each input leaf's shape, dtype, weak type and
sharding, and JAX's version, trace-time flags and `SSD_JAX_*` variables. A static argument the store
cannot describe for certain (a function that is not a module-level function of `ssd_jax`, a
closure, a partial, an object of a class from elsewhere: a model of one's own, a backend plug-in
from another package) makes the call a plain `jax.jit` call, as does a call inside someone else's
trace (tracer arguments: `checked`, `vmap`) and a step `jax.export` cannot serialise. A source
file changed on disk after this module was imported turns the store off for the process.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
from jax._src import core as jax_core
import numpy as np

_STORE: list[Path | None] = [None]
_LOCK = threading.Lock()
# JAX flags that change what a trace produces (the compile's own options are the persistent
# cache's business: it keys on them)
_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                "jax_numpy_rank_promotion", "jax_default_prng_impl", "jax_threefry_partitionable",
                "jax_enable_checks", "jax_debug_nans", "jax_debug_infs")
_PRIMITIVES = (bool, int, float, str, bytes, type(None))
_EXPORTING = [0]  # > 0 while a step of ours traces a stored step into itself (`inside_step`)


@contextlib.contextmanager
def inside_step():
    """While a step of the library traces a stored step into its own program (an export, or the
    device loop's `round_steps.resolve` drafting its backup), that call is part of the outer step,
    not a plain call the store let pass: `plain_calls` does not count it."""
    _EXPORTING[0] += 1
    try:
        yield
    finally:
        _EXPORTING[0] -= 1


def set_store(path: str | os.PathLike | None) -> None:
    """Point the step store at a directory (created on the first write), or turn it off (None)."""
    _STORE[0] = None if path is None else Path(path)


def store_dir() -> Path | None:
    """The store's directory; None while it is off."""
    return _STORE[0]


def _sources() -> list[tuple[str, Path]]:
    """The installed package's sources (`ssd_jax`, `ssd_jax.models`, `ssd_jax.pallas_kernels`:
    every .py, .cc and .h), as (name, path), sorted."""
    import importlib.util
    roots = {Path(p).resolve() for name in ("ssd_jax", "ssd_jax.models", "ssd_jax.pallas_kernels")
             for p in importlib.util.find_spec(name).submodule_search_locations}
    return [(f"{root.name}/{f.relative_to(root)}", f) for root in sorted(roots)
            for f in sorted(root.rglob("*")) if f.suffix in (".py", ".cc", ".h") and f.is_file()]


def _stats() -> tuple:
    return tuple((name, f.stat().st_size, f.stat().st_mtime_ns) for name, f in _sources())


# the sources as this process imported them (this module is imported with the steps): a file
# edited after that makes the code running here differ from the code on disk
_IMPORTED = _stats()


@functools.cache
def library_fingerprint() -> str | None:
    """SHA-256 of the installed package's sources (by relative path and content), or None when
    one of them changed on disk since this process imported the steps (so the code running
    here is not the code the hash would name: the store stays off in this process)."""
    h = hashlib.sha256()
    for name, f in _sources():
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    if _stats() != _IMPORTED:
        warnings.warn("ssd_jax step store: the library's source changed on disk since this "
                      "process imported it, so it stores nothing (restart to use the store)",
                      stacklevel=3)
        return None
    return h.hexdigest()


def describe(value: Any) -> str | None:
    """A text that is the same in every process exactly when the static argument `value` traces
    the same way (given the library's source), or None where no such text exists."""
    if isinstance(value, _PRIMITIVES):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        parts = [describe(v) for v in value]
        return None if None in parts else f"{type(value).__name__}({','.join(parts)})"
    if inspect.isfunction(value):
        mod = getattr(value, "__module__", None) or ""
        if not mod.startswith("ssd_jax.") or value.__closure__ or "<" in value.__qualname__:
            return None  # someone else's code, a closure, a lambda or a nested function
        return f"fn:{mod}.{value.__qualname__}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if not cls.__module__.startswith("ssd_jax."):
            return None
        parts = []
        for f in dataclasses.fields(value):
            d = describe(getattr(value, f.name))
            if d is None:
                return None
            parts.append(f"{f.name}={d}")
        return f"{cls.__module__}.{cls.__qualname__}({','.join(parts)})"
    if isinstance(value, np.dtype):
        return f"dtype:{value.name}"
    return None


def _leaf_key(x) -> tuple:
    """What a compiled step depends on of one input leaf: hashable (this process's table), and its
    `repr` the same in another process (the file's key)."""
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, np.ndarray):
        return (x.shape, x.dtype)
    return (type(x),)


def _environment() -> str:
    flags = ",".join(f"{f}={getattr(jax.config, f, None)!r}" for f in _TRACE_FLAGS)
    env = ",".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("SSD_JAX_") and not k.startswith(("SSD_JAX_COMPILE_CACHE",
                                                                     "SSD_JAX_STEP_STORE")))
    return f"jax={jax.__version__};jaxlib={jax.lib.__version__};{flags};{env}"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary in the same folder, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_REGISTERED: set[type] = set()


def _register_nodes(treedef) -> None:
    """Make the pytree node types in `treedef` serialisable by `jax.export`: each class of ours
    whose static part is primitives (written with `repr`, read with `ast.literal_eval`). Anything
    else stays unregistered, so `serialize` raises and the step runs as a plain jit."""
    data = treedef.node_data()
    if data is not None:
        cls, aux = data
        if (cls not in _REGISTERED and getattr(cls, "__module__", "").startswith("ssd_jax.")
                and describe(aux) is not None):
            jax.export.register_pytree_node_serialization(
                cls, serialized_name=f"{cls.__module__}.{cls.__qualname__}",
                serialize_auxdata=lambda a: repr(a).encode(),
                deserialize_auxdata=lambda b: ast.literal_eval(b.decode()))
            _REGISTERED.add(cls)
    for child in treedef.children():
        _register_nodes(child)


def _register_outputs() -> None:
    """Register the steps' output classes before reading a file: a process that only reads the
    store never exported, so never met them in `_register_nodes`."""
    from ssd_jax.algorithm.decode_state import DecodeState
    from ssd_jax.algorithm.lookup_counters import LookupCounters
    from ssd_jax.algorithm.speculation_cache import SpeculationCache
    from ssd_jax.algorithm.verify import VerifyResult
    from ssd_jax.models.kv_cache import KVCache
    for cls in (KVCache, VerifyResult, SpeculationCache, DecodeState, LookupCounters):
        if cls not in _REGISTERED:
            _register_nodes(jax.tree_util.tree_structure(
                cls(**{f.name: None for f in dataclasses.fields(cls)})))


# XLA:GPU turns a vector-matrix product whose weight is below a size threshold (a decode step's
# qkv and o projections) into an elementwise multiply that writes a weight-sized temporary, then a
# reduce: its `dot-strength-reduction` pass. Kept as GEMMs, a decode step reads each weight once
# (benchmarks/README.md, "The Pallas path for an H100": the default pair's b = 1 decode
# step moves 1.01x its weights and KV instead of 1.21x, 57 kernels fewer). The pass is XLA:GPU's:
# CPU and TPU programs compile as without the option. Every jitted step that runs a model takes it.
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "dot-strength-reduction"}

# On a GPU, XLA records a program's kernels into CUDA graphs (command buffers) and launches each
# graph at once; by default it records fusions, cuBLAS / cuBLASLt calls, custom calls (the Pallas
# kernels), cuDNN calls and dynamic-slice fusions, but runs a while loop from the host, reading its
# predicate back every iteration. The engine's chunks (`round_steps.AR_CHUNK` decode steps,
# `SD_CHUNK` rounds) are while loops, so the library adds the WHILE and CONDITIONAL commands
# (CUDA graph conditional nodes), which put a whole chunk in one graph. SSD_JAX_COMMAND_BUFFERS=0
# in the environment before ssd_jax is imported leaves XLA's defaults. CPU and TPU ignore the flag.
GPU_COMMAND_BUFFERS = ("FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,"
                       "CONDITIONAL")
if os.environ.get("SSD_JAX_COMMAND_BUFFERS", "1") != "0":
    COMPILER_OPTIONS["xla_gpu_enable_command_buffer"] = GPU_COMMAND_BUFFERS


class _Step:
    """`fun` jitted twice: with `COMPILER_OPTIONS` for a call from Python, without for a call
    inside another trace (an SD / SSD chunk calling `verify`, a user's own jit), which is part of
    the outer program and compiled with its options (JAX refuses options on a nested jit). Every
    other attribute (`lower`, `trace`, ...) is the top-level jit's."""

    def __init__(self, fun: Callable, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self.top = jax.jit(fun, compiler_options=COMPILER_OPTIONS, **jit_kwargs)
        self.nested = jax.jit(fun, **jit_kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["top"], name)

    def __call__(self, *args, **kwargs):
        # a private JAX function (pinned by tests/tools/test_inspect.py): True outside every trace
        if jax_core.trace_state_clean():
            return self.top(*args, **kwargs)
        return self.nested(*args, **kwargs)


def step_jit(fun: Callable | None = None, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` with the library's `COMPILER_OPTIONS` (`_Step`); a decorator
    too."""
    if fun is None:
        return functools.partial(step_jit, **jit_kwargs)
    return _Step(fun, **jit_kwargs)


class StoredJit:
    """`jax.jit(fun, static_argnames=..., donate_argnames=...)` with the step store (module
    docstring) and the library's `COMPILER_OPTIONS` (`step_jit`). Called like `fun`; every other
    attribute (`lower`, `trace`, `eval_shape`, ...) is the plain jitted function's. `exported` / `loaded` count the steps this process wrote to and
    read from the store, `plain_calls` the calls it ran as a plain jit while the store was on."""

    def __init__(self, fun: Callable, static_argnames: Sequence[str] = (),
                 donate_argnames: Sequence[str] = ()):
        functools.update_wrapper(self, fun)
        self.jit = step_jit(fun, static_argnames=tuple(static_argnames),
                            donate_argnames=tuple(donate_argnames))
        self._fun = fun
        self._sig = inspect.signature(fun)
        self.static_argnames, self.donate_argnames = tuple(static_argnames), tuple(donate_argnames)
        self._static = frozenset(static_argnames)
        self._donate = frozenset(donate_argnames)
        self._entries: dict[tuple, Callable | None] = {}
        self.exported = 0
        self.loaded = 0
        self.plain_calls = 0  # calls the store sent to the plain jit although it was on

    def __getattr__(self, name):
        return getattr(self.__dict__["jit"], name)

    def __call__(self, *args, **kwargs):
        store = _STORE[0]
        if store is None:
            return self.jit(*args, **kwargs)
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        static = tuple((n, v) for n, v in bound.arguments.items() if n in self._static)
        names = tuple(n for n in bound.arguments if n not in self._static)
        dyn = tuple(bound.arguments[n] for n in names)
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            if not _EXPORTING[0]:  # inside a stored step's export it is part of that step
                self.plain_calls += 1
            return self.jit(*args, **kwargs)  # inside someone's trace (checkify, vmap, jit)
        key = (store, static, tree, tuple(_leaf_key(x) for x in leaves))
        entry = self._entries.get(key, False)
        if entry is False:
            with _LOCK:
                entry = self._entries.get(key, False)
                if entry is False:
                    entry = self._entries[key] = self._make(store, static, names, dyn, leaves,
                                                            tree)
        if entry is None:
            self.plain_calls += 1
            return self.jit(*args, **kwargs)
        donated, call = entry
        if donated:
            given = [id(leaves[i]) for i in donated]
            others = {id(x) for i, x in enumerate(leaves) if i not in donated}
            if len(set(given)) < len(given) or others.intersection(given):
                self.plain_calls += 1
                return self.jit(*args, **kwargs)  # a donated buffer passed twice: jit's case
        return call(*leaves)

    def _make(self, store: Path, static, names, dyn, leaves, tree):
        """(donated leaf positions, jitted call of the exported step), or None for a plain jit."""
        descs = [describe(v) for _, v in static]
        if None in descs or library_fingerprint() is None:
            return None
        name = f"{self._fun.__module__}.{self._fun.__qualname__}"
        text = "\n".join([library_fingerprint(), name, _environment(), str(tree),
                          ";".join(f"{n}={d}" for (n, _), d in zip(static, descs)),
                          ";".join(repr(_leaf_key(x)) for x in leaves)])
        path = store / f"{self._fun.__name__}-{hashlib.sha256(text.encode()).hexdigest()}.jaxexport"
        _register_outputs()
        exp = None
        if path.exists():
            try:
                exp = jax.export.deserialize(bytearray(path.read_bytes()))
                self.loaded += 1
            except Exception:  # a torn or foreign file: export again over it
                exp = None
        if exp is None:
            try:
                exp = self._export(static, names, tree, leaves)
                _register_nodes(exp.out_tree)
                data = bytes(exp.serialize())
            except Exception as e:  # not exportable: say so once, run the plain jit
                warnings.warn(f"ssd_jax step store: {self._fun.__name__} runs without the store "
                              f"({type(e).__name__}: {str(e)[:200]})", stacklevel=3)
                return None
            try:
                _write_atomic(path, data)
                self.exported += 1
            except OSError as e:  # a full or read-only disk costs the next process a trace
                warnings.warn(f"ssd_jax step store: could not write {path} ({e})", stacklevel=3)
        donated, at = [], 0
        for n, v in zip(names, dyn):
            count = len(jax.tree_util.tree_leaves(v))
            if n in self._donate:
                donated.extend(range(at, at + count))
            at += count
        def run(*leaves):
            return exp.call(*leaves)

        # named as the step, so the compile a call waits for says which stored step it is
        run.__name__ = run.__qualname__ = f"stored_{self._fun.__name__}"
        STORE_PROGRAMS.add(f"jit({run.__name__})")
        return frozenset(donated), step_jit(run, donate_argnums=tuple(donated))

    def _export(self, static, names, tree, leaves):
        from ssd_jax.models.kv_cache import traced_checks_off
        kw = dict(static)

        def flat(*lv):
            return self._fun(**dict(zip(names, jax.tree_util.tree_unflatten(tree, lv))), **kw)

        # named as the step, so JAX's compile events and profiles say which step it is
        flat.__name__, flat.__qualname__ = self._fun.__name__, self._fun.__qualname__

        # the custom calls the static op tables declare are theirs to keep stable: the file's
        # key holds the library's source and the kernels' build is keyed by the persistent cache
        allowed = [jax.export.DisabledSafetyCheck.custom_call(t)
                   for v in kw.values() for t in (getattr(v, "custom_calls", ()) or ())]
        specs = []
        for x in leaves:  # the avals jit gives them (a Python scalar is weakly typed)
            aval = jax.typeof(x)
            specs.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                              sharding=getattr(x, "sharding", None)))
        with traced_checks_off():
            with inside_step():
                return jax.export.export(jax.jit(flat), disabled_checks=allowed)(*specs)


# the programs the stored steps run as, "jit(stored_<step>)": `runtime.metrics.CompileTimer`
# reports their compiles' source as the step store
STORE_PROGRAMS: set[str] = set()


def stored_jit(fun: Callable | None = None, *, static_argnames: Sequence[str] = (),
               donate_argnames: Sequence[str] = ()):
    """Decorator: `jax.jit` with the step store (module docstring)."""
    if fun is None:
        return functools.partial(stored_jit, static_argnames=static_argnames,
                                 donate_argnames=donate_argnames)
    return StoredJit(fun, static_argnames, donate_argnames)


__all__ = ["COMPILER_OPTIONS", "GPU_COMMAND_BUFFERS", "STORE_PROGRAMS", "StoredJit", "describe", "library_fingerprint", "set_store",
           "step_jit", "store_dir", "stored_jit"]
