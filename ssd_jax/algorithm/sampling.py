"""Sampling for ssd_jax: the user's distribution, position-indexed keys, and the exponential race.

Everything here is a pure function of arrays and is jit-friendly. `SamplingParams` is a pytree:
passed to a jitted function as an ordinary argument, its temperature, top-k and top-p are traced
values (scalars, or `[B]` arrays: one value per request, `SamplingParams.per_request`), so a new
value compiles nothing; the one static part of it is `greedy` (every row at temperature 0), which
drops every sampling op from the compiled step. Top-k, top-p and Saguaro's scaling, whose work
does not vanish at their "off" values, run under a `lax.cond` that skips them when no row uses
them. (A `SamplingParams` of Python values can still be a static argument: it is hashable, and then
its values are constants of the compiled function.)

Exactness depends on two things defined here (see docs/ALGORITHM.md §3):
- `probs_from_logits` is THE distribution the user asked for. The target's `p` and every proposal's
  `q'` must come from it (or from a rule whose rows are exactly what was sampled from), so that the
  verifier compares the same numbers that decoding would have sampled from.
- `position_keys` indexes randomness by (request id, position, stream), never by batch row, so draws
  are independent of batch layout, cache hits/misses and how far the draft ran ahead.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.algorithm.small_topk import argmax, kth_largest, kth_largest_per_row

# Streams separate the independent random draws made at one (request, position): drafting a token,
# the accept coin for it, the residual/bonus draw, plain sampling, and a backup speculator's draws.
# Reusing one key for two of these would correlate, e.g., a draft token with its own accept coin.
STREAM_SAMPLE = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3
STREAM_BACKUP = 4

__all__ = [
    "STREAM_SAMPLE",
    "STREAM_DRAFT",
    "STREAM_ACCEPT",
    "STREAM_RESIDUAL",
    "STREAM_BACKUP",
    "SamplingParams",
    "position_keys",
    "probs_from_logits",
    "sample_from_probs",
    "sample",
]


# ----------------------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------------------
def _is_typed_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _base_key(seed):
    """A typed scalar key from an int seed (Python or traced), a typed key, or a raw uint32[2] key."""
    if isinstance(seed, (int, np.integer)):
        return jax.random.key(int(seed))
    if _is_typed_key(seed):
        if seed.shape != ():
            raise ValueError(f"seed key must be a scalar key, got shape {seed.shape}")
        return seed
    seed = jnp.asarray(seed)
    if seed.dtype == jnp.uint32 and seed.shape == (2,):
        return jax.random.wrap_key_data(seed)
    if jnp.issubdtype(seed.dtype, jnp.integer) and seed.shape == ():
        return jax.random.key(seed)
    raise ValueError(f"seed must be an int, a scalar typed key or a raw uint32[2] key; got "
                     f"dtype {seed.dtype} shape {seed.shape}")


def _as_keys(keys, batch_shape: tuple[int, ...], name: str = "keys"):
    """Typed keys of shape `batch_shape`, from typed keys or raw uint32 keys `[*batch_shape, 2]`;
    anything else a ValueError naming the argument (`name`)."""
    typed = _is_typed_key(keys)
    if not typed:
        keys = jnp.asarray(keys)
    want = tuple(batch_shape) if typed else (*batch_shape, 2)
    if tuple(keys.shape) != want or not (typed or keys.dtype == jnp.uint32):
        raise ValueError(f"{name} must be typed PRNG keys {list(batch_shape)} or raw uint32 "
                         f"{list(batch_shape) + [2]}, got {keys.dtype} {list(keys.shape)}")
    return keys if typed else jax.random.wrap_key_data(keys)


def position_keys(seed, request_ids, positions, stream: int):
    """Keys indexed by (request id, position, stream), independent of batch rows.

    key[b, t] = fold_in(fold_in(fold_in(base, request_ids[b]), positions[b, t]), stream)

    Args:
      seed: a Python/traced int (-> `jax.random.key(seed)`), a scalar typed key, or a raw uint32
        key `[2]`.
      request_ids: `[B]` int32, a per-request id (not the batch row: the same request must get the
        same draws whichever row it sits in).
      positions: `[B, T]` int32 token positions (also accepted: `[B]`, giving `[B]` keys).
      stream: one of the STREAM_* constants (int, may be traced), so that the draws made at one
        (request, position) for different purposes are independent.
    Returns:
      typed keys `[B, T]` (or `[B]`).
    """
    base = _base_key(seed)
    request_ids = jnp.asarray(request_ids, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    if request_ids.ndim != 1 or positions.ndim not in (1, 2) or positions.shape[0] != request_ids.shape[0]:
        raise ValueError(f"expected request_ids [B] and positions [B, T]; got {request_ids.shape} "
                         f"and {positions.shape}")
    stream = jnp.asarray(stream, jnp.int32)

    def one(rid, pos):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, rid), pos), stream)

    if positions.ndim == 1:
        return jax.vmap(one)(request_ids, positions)
    return jax.vmap(lambda rid, row: jax.vmap(lambda pos: one(rid, pos))(row))(request_ids, positions)


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What the user asked for.

    temperature: 0 means greedy (one-hot at the argmax); > 0 divides the logits.
    top_k: keep the k largest logits (ties with the k-th are kept too); 0 = off.
    top_p: nucleus; keep the smallest set of most likely tokens whose mass reaches top_p
      (at least one token; ties with the last kept probability are kept too); 1.0 = off.

    Each field is a number, or a `[B]` array with one value per request (`per_request`); the
    values are checked on construction.

    A pytree: a jitted step takes it as an ordinary argument, its three values traced (float32,
    int32, float32), so changing them recompiles nothing. Its static structure is `greedy` alone:
    a call at temperature 0 compiles a step without any sampling op, so going from greedy to
    sampled (or back) compiles once each way. Everything else is chosen at run time
    (`probs_from_logits`). With Python values it is also hashable, so it still works as a static
    argument (its values then compile in as constants).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless temperature is finite and >= 0, top_k an int >= 0 and top_p in
        (0, 1] (each entry of an array field; array fields are 1-D, of one length, and are
        stored as numpy float32 / int32 / float32). Called on construction."""
        n = set()
        for name, dtype in _FIELDS:
            v = getattr(self, name)
            if isinstance(v, (np.ndarray, list, tuple)):
                a = np.asarray(v)
                if a.ndim != 1:
                    raise ValueError(f"{name} must be a number or a 1-D array (one per request), "
                                     f"got shape {a.shape}")
                if name == "top_k" and a.size and not np.issubdtype(a.dtype, np.integer):
                    raise ValueError(f"top_k must be ints, got {v!r}")
                _check_array(name, a)
                n.add(len(a))
                object.__setattr__(self, name, a.astype(dtype))
            else:
                _check_value(name, v)
        if len(n) > 1:
            raise ValueError(f"per-request sampling fields differ in length: {sorted(n)}")

    @property
    def greedy(self) -> bool:
        """Whether every temperature is 0: the distribution is one-hot at the argmax. Static: a
        jitted step compiles one version for greedy and one for sampled parameters."""
        g = self.__dict__.get("_greedy")
        return bool(np.all(np.asarray(self.temperature) == 0)) if g is None else g

    @classmethod
    def per_request(cls, params: "SamplingParams | Sequence[SamplingParams]",
                    batch: int) -> "SamplingParams":
        """`batch` requests' parameters as one SamplingParams of `[batch]` numpy arrays (float32,
        int32, float32): `params` is one SamplingParams (for every request; its fields numbers or
        `[batch]` arrays) or a sequence of `batch` SamplingParams of numbers."""
        if isinstance(params, SamplingParams):
            cols = [np.asarray(getattr(params, f), d) for f, d in _FIELDS]
            if any(c.ndim and c.shape != (batch,) for c in cols):
                raise ValueError(f"per-request sampling needs {batch} values per field, got "
                                 f"shapes {[c.shape for c in cols]}")
            return cls(*(np.broadcast_to(c, (batch,)).copy() for c in cols))
        rows = list(params)
        if not all(isinstance(p, SamplingParams) and np.ndim(p.temperature) == 0 for p in rows):
            raise ValueError("per-request sampling must be one SamplingParams of numbers per request")
        if len(rows) != batch:
            raise ValueError(f"per-request sampling needs one SamplingParams per request ({batch}), "
                             f"got {len(rows)}")
        return cls(*(np.asarray([getattr(p, f) for p in rows], d) for f, d in _FIELDS))


_FIELDS = (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32))


def _check_value(name: str, v) -> None:
    if name == "top_k":
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"top_k must be an int, got {v!r}")
        if v < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {v!r}")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number, got {v!r}")
    if name == "temperature" and (math.isnan(v) or v < 0 or math.isinf(v)):
        raise ValueError(f"temperature must be finite and >= 0, got {v!r}")
    if name == "top_p" and not (0.0 < v <= 1.0):  # also rejects NaN
        raise ValueError(f"top_p must be in (0, 1], got {v!r}")


def _check_array(name: str, a: np.ndarray) -> None:
    """`_check_value` on every entry of 1-D `a`, vectorised for numeric arrays (a [B] field of a
    large batch is checked on every call): the first bad entry raises `_check_value`'s error."""
    if a.dtype == bool or not np.issubdtype(a.dtype, np.number):
        for x in a.tolist():  # bools, strings, objects: the entry-wise check names the first
            _check_value(name, x)
        return
    if name == "top_k":
        bad = a < 0
    elif name == "temperature":
        bad = ~np.isfinite(a) | (a < 0)
    else:
        bad = ~((a > 0) & (a <= 1))
    if bad.any():
        _check_value(name, a.tolist()[int(np.argmax(bad))])


def _host_leaf(v, dtype):
    """A host value as a numpy array of the field's dtype (one jit signature whatever Python or numpy
    type it came as); anything else (a jax array, a tracer, a placeholder of a tree operation)
    unchanged."""
    return np.asarray(v, dtype) if isinstance(v, (numbers.Number, np.ndarray, np.generic)) else v


def _flatten(sp: SamplingParams):
    leaves = tuple(_host_leaf(getattr(sp, f), d) for f, d in _FIELDS)
    return leaves, sp.greedy


def _unflatten(greedy: bool, leaves) -> SamplingParams:
    # no __init__: the leaves may be tracers or jax arrays, which are not validated again
    sp = object.__new__(SamplingParams)
    for (f, _), v in zip(_FIELDS, leaves):
        object.__setattr__(sp, f, v)
    object.__setattr__(sp, "_greedy", greedy)
    return sp


jax.tree_util.register_pytree_node(SamplingParams, _flatten, _unflatten)


# ----------------------------------------------------------------------------------------------
# The distribution
# ----------------------------------------------------------------------------------------------
def _valid_rows(V: int, vocab_size: int | None):
    """`[V]` bool mask of real vocabulary rows, or None when every row is real."""
    if vocab_size is None or vocab_size == V:
        return None
    if not (1 <= vocab_size <= V):
        raise ValueError(f"vocab_size must be in [1, {V}] for logits with {V} rows, got {vocab_size}")
    return jnp.arange(V) < vocab_size


def _row_values(v, dtype, logits):
    """A sampling field as an array that broadcasts against logits `[N, ..., V]`: a scalar, or an
    `[N]` array (one value per leading row) shaped `[N, 1, ..., 1]`. numpy when the value is known
    on the host (then the choices below are made in Python), else a jax array."""
    xp = np if isinstance(v, (numbers.Number, np.ndarray, np.generic)) else jnp
    v = xp.asarray(v, dtype)
    if v.ndim == 0:
        return v
    if v.ndim != 1 or logits.ndim < 2 or v.shape[0] != logits.shape[0]:
        raise ValueError(f"per-request sampling values of shape {v.shape} do not match logits of "
                         f"shape {logits.shape}: give one value per leading row")
    return v.reshape(v.shape + (1,) * (logits.ndim - 1))


def run_if(pred, fn, x):
    """fn(x) where `pred` holds, else x unchanged: decided in Python when pred is a host bool,
    else by `lax.cond`, so a processor no row uses costs nothing at run time and changing
    whether it is used compiles nothing."""
    if isinstance(pred, (bool, np.bool_)):
        return fn(x) if pred else x
    return jax.lax.cond(pred, fn, lambda v: v, x)


def _masked(logits, vocab_size: int | None):
    """logits `[..., V]` in float32 with the padded rows (`>= vocab_size`) at -inf."""
    logits = jnp.asarray(logits, jnp.float32)
    valid = _valid_rows(logits.shape[-1], vocab_size)
    return logits if valid is None else jnp.where(valid, logits, -jnp.inf)


def greedy_token(logits, vocab_size: int | None = None):
    """logits `[..., V]` -> int32 `[...]`: the first maximum of the masked logits, like jnp.argmax
    in plain decoding: the token of temperature 0 (`probs_from_logits`' one-hot)."""
    return argmax(_masked(logits, vocab_size))


def probs_from_logits(logits, params: SamplingParams, vocab_size: int | None = None):
    """The distribution the user asked for.

    Args:
      logits: `[..., V]` (any float dtype; computed in float32). -inf entries are fine; +inf/NaN
        logits are not supported.
      params: temperature / top-k / top-p: numbers, or `[N]` arrays with one value per leading
        row of `logits`; host values or traced. Only `params.greedy` is static.
      vocab_size: static; entries `>= vocab_size` of the last axis are padded embedding rows and
        always get probability 0. None: every entry is a real token.
    Returns:
      `[..., V]` float32 rows summing to 1 (never NaN).

    Order: mask padded rows, temperature, top-k, top-p (on the top-k-renormalised distribution, as
    HF applies its warpers in sequence), renormalise. Temperature 0 -> one-hot at the `argmax` of the
    masked logits (first maximum, as plain greedy decoding breaks ties), also for one row of a
    sampled batch. A row with no finite logit also falls back to that one-hot (instead of 0/0 =
    NaN). Per row, top_k 0 or >= V and top_p 1 leave the row exactly as without them.

    What compiles: one function for greedy params (nothing but the argmax) and one for sampled
    params, whatever their values. Top-k and top-p run under `run_if` (a `lax.cond` on traced
    values) only when some row uses them; top-k up to `small_topk.SMALL_K` by max passes, above
    by counting passes (`small_topk.kth_largest_per_row`), top-p by a sort (the one path that is
    slow on XLA:CPU, as before).
    """
    logits = _masked(logits, vocab_size)
    V = logits.shape[-1]
    valid = _valid_rows(V, vocab_size)
    argmax_onehot = jax.nn.one_hot(argmax(logits), V, dtype=jnp.float32)
    if params.greedy:
        return argmax_onehot
    temperature = _row_values(params.temperature, np.float32, logits)
    top_k = _row_values(params.top_k, np.int32, logits)
    top_p = _row_values(params.top_p, np.float32, logits)
    xp_k = np if isinstance(top_k, np.ndarray) else jnp

    # Subtract the row max before dividing by a small temperature so nothing overflows to +inf.
    # A row at temperature 0 is divided by 1 and replaced by its one-hot below.
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    x = (logits - m) / jnp.where(temperature > 0, temperature, jnp.float32(1))

    # Threshold semantics (keep everything >= the k-th largest): ties at the boundary are all
    # kept, which makes the result independent of sort stability. If fewer than k logits are
    # finite, the threshold is -inf and -inf entries still get probability exp(-inf) = 0.
    k = xp_k.where((top_k > 0) & (top_k < V), top_k, 0)  # 0: this row keeps everything
    if isinstance(k, np.ndarray) and k.size and np.all(k == k.flat[0]):
        kk = int(k.flat[0])  # one host value for every row: the static path
        x = run_if(kk > 0, lambda x: jnp.where(x >= kth_largest(x, kk), x, -jnp.inf), x)
    else:
        x = run_if(xp_k.any(k > 0), lambda x: jnp.where(x >= kth_largest_per_row(x, k), x, -jnp.inf), x)

    e = jnp.exp(x)  # max entry is exp(0) = 1 whenever the row has a finite logit
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total > 0, total, 1.0)

    def nucleus(probs):
        # Sort descending, keep a token if the mass strictly before it is < top_p: the smallest
        # prefix whose cumulative mass reaches top_p (the first token is always kept). The kept
        # set is then expressed as a probability threshold so tied probabilities are kept
        # together. Rows with top_p = 1 are left as they were.
        sorted_p = -jnp.sort(-probs, axis=-1)
        cum = jnp.cumsum(sorted_p, axis=-1)
        before = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
        n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)
        n_keep = jnp.maximum(n_keep, 1)
        cutoff = jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
        kept = jnp.where(probs >= cutoff, probs, 0.0)
        total = jnp.sum(kept, axis=-1, keepdims=True)
        return jnp.where(top_p < 1, kept / jnp.where(total > 0, total, 1.0), probs)

    probs = run_if((np if isinstance(top_p, np.ndarray) else jnp).any(top_p < 1), nucleus, probs)

    ok = (jnp.sum(probs, axis=-1, keepdims=True) > 0) & (temperature > 0)
    probs = jnp.where(ok, probs, argmax_onehot)
    if valid is not None:  # belt and braces: padded rows are already exactly 0 (exp(-inf))
        probs = jnp.where(valid, probs, 0.0)
    return probs


# ----------------------------------------------------------------------------------------------
# Drawing
# ----------------------------------------------------------------------------------------------
def sample_from_probs(probs, keys):
    """One token per row by the exponential race `argmax(probs / Exponential(1))`.

    The race needs no normalisation and no sort: with E_i iid Exp(1), `E_i / p_i` is Exp(rate p_i)
    and the smallest wins with probability p_i / sum(p). Computed as `log p - log E` for range.
    Zero-probability entries score -inf, so they can never win (unless the whole row is zero, which
    callers must not pass: it returns index 0).

    Args:
      probs: `[..., V]` non-negative weights (need not sum to 1).
      keys: `[...]` typed keys (or raw uint32 `[..., 2]`), one per row.
    Returns:
      `[...]` int32 tokens.
    """
    probs = jnp.asarray(probs, jnp.float32)
    batch_shape, V = probs.shape[:-1], probs.shape[-1]
    keys = _as_keys(keys, batch_shape)
    flat_keys = keys.reshape(-1)
    flat_p = probs.reshape(-1, V)
    e = jax.vmap(lambda k: jax.random.exponential(k, (V,), jnp.float32))(flat_keys)
    score = jnp.where(flat_p > 0, jnp.log(flat_p) - jnp.log(e), -jnp.inf)
    return argmax(score).reshape(batch_shape)


def sample(logits, params: SamplingParams, keys, vocab_size: int | None = None):
    """Sample one token per row from the user's distribution (`probs_from_logits`, then the race).

    Args:
      logits: `[..., V]` raw logits.
      params: sampling parameters (values traced or not; `params.greedy` static): when greedy no
        random draw is made (the keys' shape is still checked).
      keys: `[...]` typed keys (or raw uint32 `[..., 2]`), one per row.
      vocab_size: static, see `probs_from_logits`.
    Returns:
      (tokens `[...]` int32, probs `[..., V]` float32 — the rows the tokens were drawn from, which a
      proposer must carry to the verifier as q').
    """
    if params.greedy:
        # One-hot rows: the race would pick the same token; skip the random draws, and the argmax
        # of the one-hot row (its own argmax is the token: one pass over V fewer)
        tok = greedy_token(logits, vocab_size)
        _as_keys(keys, tok.shape)
        return tok, jax.nn.one_hot(tok, jnp.shape(logits)[-1], dtype=jnp.float32)
    probs = probs_from_logits(logits, params, vocab_size)
    return sample_from_probs(probs, keys), probs
