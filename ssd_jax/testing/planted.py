"""Planted bugs: what a broken implementation looks like.

`PLANTED_BUG_VERIFIERS` are drop-in replacements for ssd_jax.algorithm.verify.rejection_sample, one
wrong rule each; `PLANTED_PROPOSER_BUGS` holds the proposer's bug (verifying against q instead of
the q' it sampled from). A harness that cannot tell them from `rejection_sample` is too weak to trust.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ssd_jax.algorithm.sampling import _as_keys, sample_from_probs
from ssd_jax.algorithm.verify import (
    VerifyResult,
    _accept_coins,
    _assemble,
    _check_shapes,
    _count_accepted,
    _gather_token_probs,
    _ratio_accept,
    _residual,
    _rows_at,
)

__all__ = [
    "PLANTED_BUG_VERIFIERS",
    "PLANTED_PROPOSER_BUGS",
    "ALL_PLANTED_BUGS",
    "correct_proposal_rows",
    "wrong_proposal_rows",
]


# ----------------------------------------------------------------------------------------------
# Planted bugs: drop-in replacements for ssd_jax.algorithm.verify.rejection_sample, one wrong rule each
# ----------------------------------------------------------------------------------------------
def _verify_parts(target_probs, proposal_probs, draft_tokens, accept_keys):
    target_probs = jnp.asarray(target_probs, jnp.float32)
    proposal_probs = jnp.asarray(proposal_probs, jnp.float32)
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    B, K, V = _check_shapes(target_probs, proposal_probs, draft_tokens)
    u = _accept_coins(accept_keys, (B, K))
    return target_probs, proposal_probs, draft_tokens, u, (B, K, V)


def _finish(draft_tokens, num_accepted, bonus_weights, residual_keys, B, K):
    key_row = _rows_at(_as_keys(residual_keys, (B, K + 1)), num_accepted)
    bonus = sample_from_probs(bonus_weights, key_row)
    return VerifyResult(num_accepted=num_accepted, bonus=bonus,
                        tokens=_assemble(draft_tokens, num_accepted, bonus))


def _bug_residual_from_p(target_probs, proposal_probs, draft_tokens, accept_keys, residual_keys):
    """Correct acceptance, but the bonus at a rejection is drawn from p_i instead of the residual."""
    p, q, s, u, (B, K, V) = _verify_parts(target_probs, proposal_probs, draft_tokens, accept_keys)
    n_acc = _count_accepted(_ratio_accept(_gather_token_probs(p[:, :K], s), _gather_token_probs(q, s), u))
    return _finish(s, n_acc, _rows_at(p, n_acc), residual_keys, B, K)


def _bug_argmax_match(target_probs, proposal_probs, draft_tokens, accept_keys, residual_keys):
    """Accept s_i iff s_i == argmax p_i (the authors' cache-miss rule), bonus drawn from p at the
    stop position. Exact only when p is one-hot (temperature 0)."""
    p, q, s, u, (B, K, V) = _verify_parts(target_probs, proposal_probs, draft_tokens, accept_keys)
    n_acc = _count_accepted(s == jnp.argmax(p[:, :K], axis=-1))
    return _finish(s, n_acc, _rows_at(p, n_acc), residual_keys, B, K)


def _bug_no_q_zero_after_all_accept(target_probs, proposal_probs, draft_tokens, accept_keys,
                                    residual_keys):
    """After K acceptances the bonus comes from max(0, p_{K+1} - q'_K) instead of p_{K+1}."""
    p, q, s, u, (B, K, V) = _verify_parts(target_probs, proposal_probs, draft_tokens, accept_keys)
    n_acc = _count_accepted(_ratio_accept(_gather_token_probs(p[:, :K], s), _gather_token_probs(q, s), u))
    q_ext = jnp.concatenate([q, q[:, -1:]], axis=1)  # the bug: reuse q'_K instead of a zero row
    return _finish(s, n_acc, _residual(_rows_at(p, n_acc), _rows_at(q_ext, n_acc)), residual_keys, B, K)


PLANTED_BUG_VERIFIERS: dict[str, Callable[..., VerifyResult]] = {
    "residual_from_p": _bug_residual_from_p,
    "argmax_match": _bug_argmax_match,
    "no_q_zero_after_all_accept": _bug_no_q_zero_after_all_accept,
}


# The fourth planted bug lives in the proposer, not the verifier: the draft samples from q' (after
# the draft's temperature / top-k / top-p / Saguaro scaling) but hands the verifier q (the rows
# before that processing). A proposer takes a `proposal_rows` function with this signature and
# passes its result to `rejection_sample`; the engine wires `wrong_proposal_rows` in to plant it.
def correct_proposal_rows(q, q_prime):
    """What a proposer must pass to the verifier: the rows `q' [..., V]` it sampled from."""
    return q_prime


def wrong_proposal_rows(q, q_prime):
    """Planted bug "verify_q_not_q_prime": pass `q [..., V]`, not the q' actually sampled from.
    Only detectable when q' != q (a draft temperature, top-k/top-p or Saguaro C < 1)."""
    return q


PLANTED_PROPOSER_BUGS: dict[str, Callable] = {"verify_q_not_q_prime": wrong_proposal_rows}
ALL_PLANTED_BUGS: tuple[str, ...] = tuple(PLANTED_BUG_VERIFIERS) + tuple(PLANTED_PROPOSER_BUGS)
