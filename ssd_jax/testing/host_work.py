"""The host's own work in a call, counted: Python calls and device->host syncs (deterministic,
unlike time), for tests that bound them and for benchmarks/host_overhead.py.

- `count_calls(fn)`: `sys.setprofile` counts 'call' events (Python functions, generators resumed)
  and 'c_call' events (builtins / C functions called from Python) while fn runs in this thread.
- `SyncCounter`: while active, every jax.Array turned into numpy or a Python value or waited on
  counts one sync: the concrete array class's `__array__ __int__ __float__ __complex__ __bool__
  __index__ item tolist tobytes block_until_ready` and `jax.block_until_ready`,
  `jax.device_get` are wrapped, each outermost call counting 1 (one inside another, e.g.
  device_get -> __array__, is not counted again). On CPU a jax.Array also exports the C buffer
  protocol, which numpy uses before `__array__`, silently (no Python runs); it is switched off
  while counting (its type slot nulled, restored after) so that every numpy conversion reaches
  the wrapped `__array__`. `arrays` counts the jax.Array leaves each outermost call fetched,
  `wait_s` the seconds spent inside outermost syncs. A conversion of an array whose value the
  host already holds counts too. `self_test()` checks it on hand-made cases. CPython only.
- `call_work(generate, mode)`: one warm-up call (its compiles excluded), then one call counted
  for Python calls and one for syncs, per round of the call.
"""
from __future__ import annotations

import contextlib
import ctypes
import platform
import sys
import time


def count_calls(fn):
    """(fn's result, Python 'call' events, 'c_call' events) while fn runs in this thread."""
    counts = {"call": 0, "c_call": 0}

    def prof(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    # the setprofile(None) call itself is seen as one c_call
    return out, counts["call"], counts["c_call"] - 1


# Where a type object keeps its buffer-protocol table (PyTypeObject.tp_as_buffer): after
# ob_refcnt, ob_type, ob_size and 17 pointer-sized slots, in every CPython 3.x on 64 bits.
_TP_AS_BUFFER = 20 * ctypes.sizeof(ctypes.c_void_p)


@contextlib.contextmanager
def buffer_protocol_off(cls):
    """Switch off `cls`'s C buffer protocol (numpy then falls back to `__array__`)."""
    if platform.python_implementation() != "CPython":
        raise RuntimeError("the sync counter needs CPython (it switches a type slot off)")
    slot = ctypes.c_void_p.from_address(id(cls) + _TP_AS_BUFFER)
    before = slot.value
    slot.value = None
    try:
        yield
    finally:
        slot.value = before


class SyncCounter:
    """`with SyncCounter() as s:` counts device->host syncs (module docstring) in s.syncs, the
    jax.Array leaves they fetched in s.arrays and the syncs by entry point in s.by_kind."""

    METHODS = ("__array__", "__int__", "__float__", "__complex__", "__bool__", "__index__",
               "item", "tolist", "tobytes", "block_until_ready")

    def __init__(self):
        import jax
        import jax.numpy as jnp
        self.jax, self.cls = jax, type(jnp.zeros(1))
        self.syncs = self.arrays = 0
        self.wait_s = 0.0  # seconds inside outermost syncs
        self.by_kind: dict[str, int] = {}
        self._depth = 0

    def _wrap(self, name, fn, leaves):
        def counted(*a, **k):
            outer = self._depth == 0
            if outer:
                self.syncs += 1
                self.by_kind[name] = self.by_kind.get(name, 0) + 1
                self.arrays += leaves(a)
                t0 = time.perf_counter()
            self._depth += 1
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if outer:
                    self.wait_s += time.perf_counter() - t0
        counted.__name__ = getattr(fn, "__name__", name)
        return counted

    def __enter__(self):
        jax, cls = self.jax, self.cls
        self._saved = [(cls, m, cls.__dict__[m]) for m in self.METHODS if m in cls.__dict__]
        self._saved += [(jax, f, getattr(jax, f)) for f in ("block_until_ready", "device_get")]
        tree_count = lambda a: sum(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(a[0]))
        for owner, name, fn in self._saved:
            if owner is cls:
                # a nanobind method (block_until_ready) is a descriptor: call it through its
                # __get__ so the wrapper, a plain function, binds like it
                call = fn if not hasattr(fn, "__get__") or isinstance(fn, type(lambda: 0)) \
                    else (lambda fn: lambda self, *a, **k: fn.__get__(self, cls)(*a, **k))(fn)
                setattr(cls, name, self._wrap(f"Array.{name}", call, lambda a: 1))
            else:
                setattr(owner, name, self._wrap(f"jax.{name}", fn, tree_count))
        self._buffer = buffer_protocol_off(cls)
        self._buffer.__enter__()
        return self

    def __exit__(self, *exc):
        self._buffer.__exit__(*exc)
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        return False


def self_test() -> dict:
    """Checks the sync counter on hand-made cases; returns what each counted. Raises if one
    np.asarray of a fresh jax.Array does not count exactly 1, or a method is left patched."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    cls = type(jnp.zeros(1))
    before = {m: cls.__dict__.get(m) for m in SyncCounter.METHODS}
    got = {}
    cases = {
        "np.asarray": lambda x, y: np.asarray(x),
        "np.array": lambda x, y: np.array(x),
        "np.where": lambda x, y: np.where(x > 1, 1, 0),  # x > 1 is a new jax.Array: one fetch
        "int(x[0])": lambda x, y: int(x[0]),
        "y.item()": lambda x, y: y.item(),
        "x.tolist()": lambda x, y: x.tolist(),
        "jax.device_get((x, y))": lambda x, y: jax.device_get((x, y)),
        "jax.block_until_ready(x)": lambda x, y: jax.block_until_ready(x),
        "x.block_until_ready()": lambda x, y: x.block_until_ready(),
        "none (x + 1, x.shape)": lambda x, y: (x + 1, x.shape),
    }
    want = {"np.asarray": 1, "np.array": 1, "np.where": 1, "int(x[0])": 1, "y.item()": 1,
            "x.tolist()": 1, "jax.device_get((x, y))": 1, "jax.block_until_ready(x)": 1,
            "x.block_until_ready()": 1, "none (x + 1, x.shape)": 0}
    for name, case in cases.items():
        x, y = jnp.arange(4) + 1, jnp.float32(2.5) * 2  # fresh arrays: no value on the host yet
        jax.block_until_ready((x, y))
        with SyncCounter() as s:
            case(x, y)
        got[name] = s.syncs
    if got != want:
        raise AssertionError(f"sync counter self-test: counted {got}, expected {want}")
    if {m: cls.__dict__.get(m) for m in SyncCounter.METHODS} != before:
        raise AssertionError("sync counter self-test: a method of the array class stayed patched")
    memoryview(jnp.arange(2) + 1)  # the buffer protocol is back
    return got


def rounds_of(out, mode: str) -> int:
    """Rounds of a call: metrics.rounds; for AR the tokens of the longest row where it is 0."""
    r = int(out.metrics.rounds)
    if mode == "ar" and r == 0:
        r = max(len(t) for t in out.token_ids)
    return r


def call_work(generate, mode: str) -> dict:
    """The host work of `generate()` (a generate call of mode `mode`, repeatable: the same
    tokens each time): one warm-up call, one counted for Python calls, one for syncs. Returns
    rounds, py_calls, c_calls, py_calls_per_round, c_calls_per_round, syncs, syncs_per_round
    (over the sync-counted call's own rounds), arrays_fetched, syncs_by_kind,
    same_tokens_every_call, and `out`, the counted call's result."""
    warm = generate()  # compiles
    out, py, c = count_calls(generate)
    rounds = rounds_of(out, mode)
    with SyncCounter() as s:
        out2 = generate()
    same = out2.token_ids == warm.token_ids == out.token_ids and rounds_of(out2, mode) == rounds
    return {"rounds": rounds, "py_calls": py, "c_calls": c,
            "py_calls_per_round": round(py / rounds, 1), "c_calls_per_round": round(c / rounds, 1),
            "syncs": s.syncs, "syncs_per_round": round(s.syncs / rounds_of(out2, mode), 2),
            "arrays_fetched": s.arrays, "syncs_by_kind": dict(sorted(s.by_kind.items())),
            "same_tokens_every_call": bool(same), "out": out}


__all__ = ["SyncCounter", "buffer_protocol_off", "call_work", "count_calls", "rounds_of",
           "self_test"]
