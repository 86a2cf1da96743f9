"""Static-shape, lossless verification of one K-token speculation (docs/ALGORITHM.md §3).

For each sequence: accept draft token s_i with probability min(1, p_i(s_i) / q'_i(s_i)) while every
earlier one was accepted; at the first rejection i emit a bonus drawn from normalize(max(0, p_i - q'_i));
after K acceptances emit a bonus drawn from p_{K+1} (q' := 0 there). Whatever q' is — a sampled draft
row, a Saguaro-scaled row, a uniform or a one-hot guess — the emitted tokens are distributed exactly
as sampling from p token by token, provided each s_i really was sampled from the q'_i passed here.

Everything is dense over `[B, K(+1), V]` with per-row accept counts; no data-dependent shapes.
The small helpers are separate functions so the exactness harness (ssd_jax.testing) can build its
planted-bug verifiers from the same pieces, changing exactly one rule each.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ssd_jax.models import arguments as args
from ssd_jax.algorithm.sampling import _as_keys, sample_from_probs

__all__ = ["VerifyResult", "rejection_sample"]


@flax.struct.dataclass
class VerifyResult:
    """Outcome of one verification round (a pytree).

    num_accepted: `[B]` int32 in 0..K, accepted draft tokens.
    bonus: `[B]` int32, the target's token after them (the outcome's t*).
    tokens: `[B, K+1]` int32: the accepted run, then the bonus, then -1 padding
      (`tokens[b, :num_accepted[b] + 1]` are the tokens to commit).
    """

    num_accepted: jax.Array
    bonus: jax.Array
    tokens: jax.Array


def _check_shapes(target_probs, proposal_probs, draft_tokens):
    fn = "rejection_sample"
    B, K1, V = args.shape(fn, "target_probs", target_probs, 3, "[B, K+1, V]")
    args.shape(fn, "proposal_probs", proposal_probs, 3, "[B, K, V]")
    args.shape(fn, "draft_tokens", draft_tokens, 2, "[B, K]")
    if K1 < 1 or V < 1:
        raise ValueError(f"{fn}: target_probs [B, K+1, V] needs K+1 >= 1 rows of V >= 1 entries, "
                         f"got {list(jnp.shape(target_probs))}")
    args.same(fn, "proposal_probs", jnp.shape(proposal_probs), (B, K1 - 1, V),
              "[B, K, V] (target_probs' B and V, one row fewer)")
    args.same(fn, "draft_tokens", jnp.shape(draft_tokens), (B, K1 - 1), "[B, K]")
    return B, K1 - 1, V


def _gather_token_probs(probs, tokens):
    """probs `[B, K, V]`, tokens `[B, K]` -> `[B, K]` = probs[b, i, tokens[b, i]]."""
    return jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def _accept_coins(accept_keys, shape):
    """`[B, K]` uniforms in [0, 1), one per (request, position) accept key."""
    keys = _as_keys(accept_keys, shape).reshape(-1)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys).reshape(shape)


def _ratio_accept(p_s, q_s, u):
    """Accept iff u < p/q', written as u * q' < p so that nothing is divided.

    P(u < r) = min(1, r) for u ~ U[0, 1). Written as a product it needs no division: if q'(s) == 0
    although s was drafted (an upstream bug, or a probability that underflowed) it accepts exactly
    when p(s) > 0 — the limit of min(1, p/q') as q' -> 0 — and never produces NaN. A token the target
    gives probability 0 is never accepted (u * q' < 0 is false), which is what makes temperature 0,
    top-k and top-p exact.
    """
    return u * q_s < p_s


def _count_accepted(accepted):
    """`[B, K]` bool -> `[B]` int32 length of the leading run of acceptances."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _rows_at(x, idx):
    """x `[B, T, ...]`, idx `[B]` -> `[B, ...]` = x[b, idx[b]]."""
    return x[jnp.arange(x.shape[0]), idx]


def _residual(p_row, q_row):
    """normalize(max(0, p - q')) up to scale; an all-zero residual falls back to p.

    The residual is all zero only when q' >= p everywhere, i.e. q' == p up to rounding; then a
    rejection had probability ~0 and p is the right distribution. Without the fallback the race
    over an all-zero row would silently return token 0.
    """
    r = jnp.maximum(p_row - q_row, 0.0)
    empty = jnp.sum(r, axis=-1, keepdims=True) <= 0
    return jnp.where(empty, p_row, r)


def _assemble(draft_tokens, num_accepted, bonus):
    """`[B, K+1]` tokens: accepted run, bonus, then -1."""
    B, K = draft_tokens.shape
    j = jnp.arange(K + 1)[None, :]
    padded = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((B, 1), -1, jnp.int32)], axis=1)
    n = num_accepted[:, None]
    return jnp.where(j < n, padded, jnp.where(j == n, bonus[:, None], -1)).astype(jnp.int32)


def _proposal_with_zero_row(proposal_probs):
    """`[B, K, V]` -> `[B, K+1, V]` with q' := 0 at K+1, so the all-accepted bonus row is p_{K+1}
    (K = 0 included: the bonus is then a plain draw from p_1)."""
    B, _, V = proposal_probs.shape
    return jnp.concatenate([proposal_probs, jnp.zeros((B, 1, V), proposal_probs.dtype)], axis=1)


def rejection_sample(target_probs, proposal_probs, draft_tokens, accept_keys, residual_keys) -> VerifyResult:
    """Lossless speculative-decoding verification, static shapes, per-row accept counts.

    Args:
      target_probs: `[B, K+1, V]` p_1..p_{K+1}, the target distribution after the user's
        temperature / top-k / top-p (`ssd_jax.algorithm.sampling.probs_from_logits`).
      proposal_probs: `[B, K, V]` q'_1..q'_K, the rows the draft tokens were actually sampled from.
      draft_tokens: `[B, K]` int32 s_1..s_K.
      accept_keys: `[B, K]` keys; the coin for s_i is uniform(accept_keys[:, i]).
      residual_keys: `[B, K+1]` keys; the bonus after k acceptances is drawn with residual_keys[:, k].
    Returns:
      VerifyResult(num_accepted [B], bonus [B], tokens [B, K+1]).

    Edge cases (see the helpers): q'(s) == 0 accepts iff p(s) > 0; an all-zero residual falls back to
    p; one-hot proposals accept with probability p(s) and their residual is p without s; with a one-hot
    p (temperature 0) this is exactly argmax matching plus the argmax as bonus. K = 0 is plain
    sampling: num_accepted 0 and the bonus drawn from p_1 with residual_keys[:, 0]. B = 0 gives
    empty results.

    A `ValueError` naming the argument, before anything is traced: shapes that do not agree,
    probability rows or tokens of the wrong dtype, keys not [B, K] / [B, K+1] (typed, or raw
    uint32 with a last axis of 2), and, where the values are known (an eager
    call), rows that are not probabilities summing to 1 or draft tokens outside [0, V).
    """
    fn = "rejection_sample"
    args.floating(fn, "target_probs", target_probs)
    args.floating(fn, "proposal_probs", proposal_probs)
    args.integer(fn, "draft_tokens", draft_tokens)
    _check_shapes(target_probs, proposal_probs, draft_tokens)
    args.probability_rows(fn, "target_probs", target_probs)
    args.probability_rows(fn, "proposal_probs", proposal_probs)
    args.in_range(fn, "draft_tokens", draft_tokens, 0, jnp.shape(target_probs)[-1])
    B, K = jnp.shape(draft_tokens)
    _as_keys(accept_keys, (B, K), f"{fn}: accept_keys")
    _as_keys(residual_keys, (B, K + 1), f"{fn}: residual_keys")
    target_probs = jnp.asarray(target_probs, jnp.float32)
    proposal_probs = jnp.asarray(proposal_probs, jnp.float32)
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    B, K, V = _check_shapes(target_probs, proposal_probs, draft_tokens)

    p_s = _gather_token_probs(target_probs[:, :K], draft_tokens)
    q_s = _gather_token_probs(proposal_probs, draft_tokens)
    u = _accept_coins(accept_keys, (B, K))
    num_accepted = _count_accepted(_ratio_accept(p_s, q_s, u))

    # Only row num_accepted of the residual is ever needed: gather it (and its key) instead of
    # drawing K+1 bonus candidates.
    p_row = _rows_at(target_probs, num_accepted)
    q_row = _rows_at(_proposal_with_zero_row(proposal_probs), num_accepted)
    key_row = _rows_at(_as_keys(residual_keys, (B, K + 1)), num_accepted)
    bonus = sample_from_probs(_residual(p_row, q_row), key_row)

    return VerifyResult(num_accepted=num_accepted, bonus=bonus,
                        tokens=_assemble(draft_tokens, num_accepted, bonus))
