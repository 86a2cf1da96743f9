"""The proposal q' a draft samples its speculation from, with Saguaro scaling (ALGORITHM.md §4).

After a rejection the bonus comes from max(0, p - q'), which suppresses exactly the tokens the
draft likes most — the ones the next fork caches. Saguaro drafts from

    q'(t) ∝ C * q(t)  for t among the top `top_n` tokens of the raw draft row,  q(t) otherwise,

so residual mass moves onto the cached candidates (more hits, slightly lower acceptance). Every
proposal is rounded to the speculation cache's row dtype *before* the draw, and the token is drawn
from those rounded numbers, so the rows the verifier sees are exactly the rows sampled from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.algorithm import sampling as smp
from ssd_jax.models import arguments as args
from ssd_jax.algorithm.sampling import SamplingParams, probs_from_logits, sample_from_probs
from ssd_jax.algorithm.small_topk import kth_largest, kth_largest_per_row


def saguaro_scale(q: jax.Array, raw_logits: jax.Array, top_n: int, c) -> jax.Array:
    """Saguaro's proposal (docs/ALGORITHM.md §4): q `[..., V]` -> q' `[..., V]`.

    The probabilities in q of the top `top_n` tokens of `raw_logits` `[..., V]` (ties at the
    boundary included) are multiplied by `c`, and each row is renormalised to sum to 1 (an
    all-zero row stays zero). `top_n` (an int, static: it comes from the fan-out, a shape) <= 0
    returns q itself. `c` is a number or an array (a scalar, or `[N]`: one per leading row of q),
    host value or traced: rows with c == 1 get q itself, unchanged, and when no row has c < 1 the
    scaling does not run (`ssd_jax.algorithm.sampling.run_if`), so sweeping C compiles nothing.
    `top_n` may also be a traced int32 scalar (a tree step inside a loop over depths, where the
    top-n changes with the depth): the same numbers, its 0 leaving q as it is.
    """
    static_n = isinstance(top_n, (int, np.integer))
    if static_n and top_n <= 0:
        return q
    c = smp._row_values(c, np.float32, q)
    V = raw_logits.shape[-1]

    def scale(q):
        if static_n:
            kth, on = kth_largest(raw_logits, min(top_n, V)), c < 1
        else:
            kth = kth_largest_per_row(raw_logits, jnp.minimum(top_n, V))
            on = (c < 1) & (top_n > 0)
        scaled = jnp.where(raw_logits >= kth, q * c, q)
        total = jnp.sum(scaled, axis=-1, keepdims=True)
        return jnp.where(on, scaled / jnp.where(total > 0, total, 1.0), q)

    return smp.run_if((np if isinstance(c, np.ndarray) else jnp).any(c < 1), scale, q)


def propose(logits: jax.Array, sampling: SamplingParams, keys: jax.Array, *,
            vocab_size: int | None = None, saguaro_top_n: int = 0, saguaro_c=1.0,
            row_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Draft one token per row from its proposal q' (docs/ALGORITHM.md §4).

    logits `[..., V]` (raw draft logits), keys `[...]` (typed, or raw uint32 `[..., 2]`) ->
    (tokens `[...]` int32, rows `[..., V]` in `row_dtype`: the exact numbers the token was drawn
    from; normalise them (`normalise_rows`) before verifying).

    `sampling`: the draft's sampling parameters, values traced or not (`sampling.greedy`, static,
    draws the argmax and uses no key: its row is the one-hot row there, Saguaro's or not);
    `saguaro_c`: Saguaro's scale C, a number or a (traced) array, scalar or one per leading row
    (1.0 = off). Static: `vocab_size`, real rows of V (the rest get probability 0);
    `saguaro_top_n`, Saguaro's top-n (`saguaro_scale`; 0 = off);
    `row_dtype`, the speculation cache's row dtype, to which q' is rounded before the draw.

    A `ValueError` naming the argument, before anything is traced: logits that are not floating
    point or have no rows, a vocab_size outside [1, V] (the row mask's own check), a negative
    saguaro_top_n, a row_dtype that is not floating point, keys not one per row of logits
    (sampled draws), and, where its value is known, saguaro_c outside (0, 1]. Empty leading axes
    (no rows) give empty results.
    """
    _check_propose(logits, sampling, keys, vocab_size, saguaro_top_n, saguaro_c, row_dtype)
    if sampling.greedy:
        # q is the one-hot row at the greedy token, and so is q': Saguaro's scaling multiplies its
        # one nonzero entry by C and renormalises it to C / C = 1. No pass over V but the argmax
        # (the scaling's top-n passes and a second argmax of the rows drew the same token).
        tok = smp.greedy_token(logits, vocab_size)
        return tok, jax.nn.one_hot(tok, logits.shape[-1], dtype=row_dtype)
    q = probs_from_logits(logits, sampling, vocab_size)
    q = saguaro_scale(q, logits, saguaro_top_n, saguaro_c)
    rows = q.astype(row_dtype)
    return sample_from_probs(rows.astype(jnp.float32), keys), rows


def _check_propose(logits, sampling, keys, vocab_size, saguaro_top_n, saguaro_c, row_dtype):
    fn = "saguaro_propose"
    args.floating(fn, "logits", logits)
    if jnp.ndim(logits) < 1 or jnp.shape(logits)[-1] < 1:
        raise ValueError(f"{fn}: logits must be [..., V] with V >= 1, got shape {jnp.shape(logits)}")
    if isinstance(saguaro_top_n, (int, np.integer)) and saguaro_top_n < 0:
        raise ValueError(f"{fn}: saguaro_top_n must be >= 0 (0: off), got {saguaro_top_n}")
    if not jnp.issubdtype(jnp.dtype(row_dtype), jnp.floating):
        raise ValueError(f"{fn}: row_dtype must be floating point, got {jnp.dtype(row_dtype)}")
    c = args.host_value(saguaro_c)
    if c is not None and (not np.all(np.isfinite(c)) or np.any(c <= 0) or np.any(c > 1)):
        raise ValueError(f"{fn}: saguaro_c must be in (0, 1] (1: off), got {c}")
    if not sampling.greedy:  # a sampled draw takes one key a row of logits
        smp._as_keys(keys, tuple(jnp.shape(logits)[:-1]), f"{fn}: keys")


def normalise_rows(rows: jax.Array) -> jax.Array:
    """Stored (possibly rounded, unnormalised) proposal rows `[..., V]` -> the probabilities they
    sample from, `[..., V]` float32 rows summing to 1 (an all-zero row stays zero)."""
    r = rows.astype(jnp.float32)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return r / jnp.where(total > 0, total, 1.0)
