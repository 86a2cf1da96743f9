"""KV cache: one static-shape buffer pair per layer plus per-sequence lengths.

Slot s of a sequence's cache holds the KV of the token at position s. A forward over T new tokens
writes them at slots `lengths .. lengths+T-1` and each query attends to slots <= its own position, so
stale KV past the length (a rejected speculation) is masked until it is overwritten. Rollback is
therefore just a new `lengths` — no copies.

Overflow (writing past slot S-1) is an error, never a silent drop, checked at three levels so the
jitted fast path pays nothing:
- static (trace time, always): all T tokens real (`num_new=None`) and T > S raises
  `CacheOverflowError` while tracing;
- concrete (eager calls, always): lengths and counts held on the host or as addressable arrays
  (a notebook calling `forward` un-jitted) are checked with numpy before any work;
- traced (under jit): a `jax.experimental.checkify.debug_check`, traced only inside
  `checked(fn)`, which enforces it. Outside it the steps are traced without the check: its
  effect would compile to nothing, yet it keeps every call of a jitted step off JAX's C++
  dispatch path (~600 Python calls a dispatch instead of a few). The debug mode flags every
  write past the end, including `steps.draft_chain`'s deliberate dropped writes for rows it does
  not draft.
"""
from __future__ import annotations

import contextlib
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import checkify

from ssd_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """Every layer's KV of a batch (a pytree): k and v, per layer `[B, S, KVH, D]` (S slots), and
    lengths `[B]` int32, the committed slots of each sequence."""

    k: tuple[jax.Array, ...]  # per layer [B, S, KVH, D]
    v: tuple[jax.Array, ...]  # per layer [B, S, KVH, D]
    lengths: jax.Array  # [B] int32: slots 0..lengths-1 hold committed KV

    @property
    def batch(self) -> int:
        """B, the sequences."""
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """S, the slots per sequence."""
        return self.k[0].shape[1]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """Rollback / commit: the same buffers with lengths `[B]` as the new length pointers (the
        KV past them becomes stale). A length outside [0, S] is a `CacheOverflowError` (module
        docstring: at once for host values, under `checked` for traced ones)."""
        lengths = jnp.asarray(lengths, jnp.int32)
        check_room(lengths, 0, self.max_len, "KVCache.with_lengths")
        return self.replace(lengths=lengths)


class CacheOverflowError(ValueError):
    """A write (or a length) past the end of a KV cache or a branch buffer: the message names
    the call, the rows, their lengths and the capacity."""


def host_value(x) -> np.ndarray | None:
    """x as a numpy array when its value is known without tracing, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def check_room(lengths, count, capacity: int, what: str = "forward") -> None:
    """Raise `CacheOverflowError` unless every row b has 0 <= lengths[b] and lengths[b] +
    count[b] <= capacity. lengths `[B]` (or a scalar) int: the slot each row writes from; count
    `[B]` or a scalar: how many slots it writes; capacity: S, static. Host values are checked
    now; traced ones by a `checkify.debug_check` (a no-op unless checkified, e.g. by
    `checked`)."""
    lh, ch = host_value(lengths), host_value(count)
    if lh is not None and ch is not None:
        lh, ch = np.broadcast_arrays(np.atleast_1d(lh).astype(np.int64),
                                     np.atleast_1d(ch).astype(np.int64))
        bad = np.flatnonzero((lh < 0) | (ch < 0) | (lh + ch > capacity))
        if bad.size:
            rows = "; ".join(f"row {b} at length {lh[b]} writing {ch[b]}" for b in bad[:4])
            raise CacheOverflowError(
                f"{what}: writing past the cache's end (S = {capacity} slots): {rows}; make the "
                f"cache longer (init_cache max_len) or roll it back (with_lengths) first")
        return
    if not _TRACED_CHECKS[0]:
        return
    lengths, count = jnp.asarray(lengths), jnp.asarray(count)
    ok = jnp.all((lengths >= 0) & (count >= 0) & (lengths + count <= capacity))
    checkify.debug_check(ok, f"{_MARK}{what}: writing past the cache's end: lengths {{}} + "
                             f"written {{}} exceed S = {capacity}", lengths, count)


_MARK = "KV cache overflow in "
# On only while `checked` traces: a debug check's effect costs every jitted call JAX's fast
# dispatch path, `jax.export` cannot serialise it, and outside `checked` it compiles to nothing.
_TRACED_CHECKS = [False]


@contextlib.contextmanager
def _traced_checks_on():
    """Trace with the overflow checks. JAX's trace caches do not key on this switch, so they are
    cleared on the way in (no check-free trace is reused inside) and out (no trace with the
    check's effect is reused outside, off the fast path): `checked` is a debug tool."""
    before = _TRACED_CHECKS[0]
    jax.clear_caches()
    _TRACED_CHECKS[0] = True
    try:
        yield
    finally:
        _TRACED_CHECKS[0] = before
        jax.clear_caches()


@contextlib.contextmanager
def traced_checks_off():
    """Trace without the traced overflow checks: what a step compiles to outside `checked`."""
    before = _TRACED_CHECKS[0]
    _TRACED_CHECKS[0] = False
    try:
        yield
    finally:
        _TRACED_CHECKS[0] = before


def checked(fn):
    """`fn` with its cache-overflow debug checks on: the same call, run under
    `jax.experimental.checkify` (user checks), raising `CacheOverflowError` when any write of
    `forward` / `tree_step` / `KVCache.with_lengths` inside it went past a buffer's end.

    fn may be jitted or not; its array arguments (jax / numpy arrays, pytrees of them) are traced,
    every other argument (ModelConfig, Ops, Python ints such as `window`) is passed through as
    is, so `checked(forward)(params, cfg, tokens, cache)` works as `forward` does. One compile per
    set of static arguments (kept by the returned function); call it eagerly, not inside
    `jax.jit`, and keep it off the fast path (the check costs a device-to-host read per call)."""
    compiled = {}  # (treedef, static leaves) -> jitted checkified fn of the array leaves

    @functools.wraps(fn)
    def run(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        is_array = tuple(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)
        static = tuple(x for x, a in zip(leaves, is_array) if not a)

        def inner(arrays):
            it = iter(arrays)
            full = [next(it) if a else x for x, a in zip(leaves, is_array)]
            a, k = jax.tree_util.tree_unflatten(tree, full)
            return fn(*a, **k)

        try:
            key = (tree, is_array, static)
            hash(key)
        except TypeError:  # an unhashable static argument: trace this call alone
            call = checkify.checkify(inner, errors=checkify.user_checks)
        else:
            if key not in compiled:
                compiled[key] = jax.jit(checkify.checkify(inner, errors=checkify.user_checks))
            call = compiled[key]
        with _traced_checks_on():
            err, out = call([x for x, a in zip(leaves, is_array) if a])
        try:
            err.throw()
        except checkify.JaxRuntimeError as e:
            msg = str(e)
            if _MARK in msg:
                raise CacheOverflowError(msg.split(_MARK, 1)[1].split(" (`check` failed)")[0]) from None
            raise
        return out

    return run


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, sharding=None) -> KVCache:
    """An empty cache: zeros `[B, S, KVH, D]` per layer (B = batch, S = max_len) in `dtype` (default
    cfg.dtype), lengths `[B]` = 0, every array placed with `sharding` when given. batch or
    max_len not an integer >= 1, or a dtype that is not floating point: a `ValueError` naming it."""
    for name, v in (("batch", batch), ("max_len", max_len)):
        try:
            ok = not isinstance(v, bool) and operator.index(v) >= 1
        except TypeError:  # a float, a traced value: never truncated into a size
            ok = False
        if not ok:
            raise ValueError(f"init_cache: {name} must be an integer >= 1, got {v!r}")
    batch, max_len = operator.index(batch), operator.index(max_len)
    dtype = jnp.dtype(dtype or cfg.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"init_cache: dtype must be floating point, got {dtype}")
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)

    def zeros():
        z = jnp.zeros(shape, dtype)
        return z if sharding is None else jax.device_put(z, sharding)

    lengths = jnp.zeros((batch,), jnp.int32)
    if sharding is not None:
        lengths = jax.device_put(lengths, sharding)
    return KVCache(k=tuple(zeros() for _ in range(cfg.num_layers)),
                   v=tuple(zeros() for _ in range(cfg.num_layers)), lengths=lengths)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> int:
    """Bytes of the k and v buffers of `init_cache(cfg, batch, max_len)` in cfg.dtype."""
    return 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
