"""Planted bugs: what a broken implementation looks like.

`PLANTED_BUG_VERIFIERS` are drop-in replacements for ssd_jax.algorithm.verify.rejection_sample, one
wrong rule each; `PLANTED_PROPOSER_BUGS` holds the proposer's bug (verifying against q instead of
the q' it sampled from); `PLANTED_SSD_BUGS` names nine bugs of the speculation cache, the
backups and the draft's tree (three of them change only what a cache hit hands the verifier, two
only what a model with more embedding rows than ids shows), planted in the
running process by `plant_ssd_bug(name)`. A harness that cannot tell them from
the real thing is too weak to trust; which test catches which, and why some cannot be caught by a
distribution test at all: tests/statistical/test_planted_bugs.py.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax.algorithm import sampling as _sampling
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
    "PLANTED_SSD_BUGS",
    "plant_ssd_bug",
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


# ----------------------------------------------------------------------------------------------
# Planted SSD bugs: one wrong rule each in the speculation cache's lookup or the draft's tree,
# planted in the running process by `plant_ssd_bug` (the engine has no hook for these)
# ----------------------------------------------------------------------------------------------
@jax.jit
def _gather_next_branch(keys, valid, tokens, rows, outcome):
    """cache_gather_reference with an off-by-one: the hit is decided correctly, but the tokens and
    rows returned are those of the branch after the matching one (MQ wraps to branch 0)."""
    match = valid.astype(bool) & jnp.all(keys == outcome[:, None, :], axis=-1)
    hit = jnp.any(match, axis=-1)
    index = jnp.where(hit, (jnp.argmax(match, axis=-1) + 1) % keys.shape[1], -1).astype(jnp.int32)
    pick = jax.vmap(lambda x, i: x[i])
    safe = jnp.maximum(index, 0)
    return (hit, index, jnp.where(hit[:, None], pick(tokens, safe), 0).astype(tokens.dtype),
            jnp.where(hit[:, None, None], pick(rows, safe), 0).astype(rows.dtype))


def _gather_rows_one_depth_late(gather):
    """`gather` (cache_gather_reference, taken before the swap) with the rows' depth index off by
    one: the hit branch's tokens, but the row handed on for drafted token d is the branch's row of
    depth d - 1 (depth 0 keeps its own), as a refactor that shifts the rows to line up with the
    verify's positions would."""
    @jax.jit
    def late(keys, valid, tokens, rows, outcome):
        hit, index, next_tokens, next_rows = gather(keys, valid, tokens, rows, outcome)
        return hit, index, next_tokens, jnp.concatenate([next_rows[:, :1], next_rows[:, :-1]], 1)
    return late


def _propose_rows_before_saguaro(logits, sampling, keys, *, vocab_size=None, saguaro_top_n=0,
                                 saguaro_c=1.0, row_dtype=jnp.float32):
    """saguaro.propose that draws from the Saguaro-scaled q' but returns (and so stores in the
    speculation cache) the rows before the scaling: what the verifier is told about a token that
    came out of the cache is the draft's row, not the one it was drawn from. A no-op at C = 1."""
    from ssd_jax.algorithm import saguaro
    tok, _ = saguaro.propose(logits, sampling, keys, vocab_size=vocab_size,
                             saguaro_top_n=saguaro_top_n, saguaro_c=saguaro_c, row_dtype=row_dtype)
    return tok, _sampling.probs_from_logits(logits, sampling, vocab_size).astype(row_dtype)


def _keys_one_position_early(seed, request_ids, positions, stream):
    """position_keys at the position before: the tree keys a drafted token by the position of
    the token it follows (pos, not pos + 1), so its draw reuses the key of the draft draw one
    position earlier."""
    return _sampling.position_keys(seed, request_ids, jnp.asarray(positions) - 1, stream)


def _sampling_with(**overrides):
    """The sampling module's public names with some replaced: what the tree sees as `smp`."""
    ns = {name: getattr(_sampling, name) for name in dir(_sampling) if not name.startswith("__")}
    ns.update(overrides)
    return types.SimpleNamespace(**ns)


def _keys_by_row(seed, request_ids, positions, stream):
    """position_keys with the batch row in place of the request id."""
    rows = jnp.arange(jnp.shape(request_ids)[0], dtype=jnp.int32)
    return _sampling.position_keys(seed, rows, positions, stream)


def _propose_drawn_before_rounding(logits, sampling, keys, *, vocab_size=None, saguaro_top_n=0,
                                   saguaro_c=1.0, row_dtype=jnp.float32):
    """saguaro.propose with the rounding moved after the draw: the token comes from the float32
    q', the rows returned (and stored in the cache) are q' rounded to `row_dtype`."""
    from ssd_jax.algorithm import saguaro
    q = _sampling.probs_from_logits(logits, sampling, vocab_size)
    q = saguaro.saguaro_scale(q, logits, saguaro_top_n, saguaro_c)
    rows = q.astype(row_dtype)
    if sampling.greedy:
        return saguaro.argmax(q), rows
    return sample_from_probs(q, keys), rows


def _uniform_over_every_row(row_vocab: int, vocab_size: int):
    """The padded-row bug's uniform row: 1 / row_vocab on every row, the padded ones included
    (right: 1 / vocab_size on the ids, 0 past them). Equal to the right one on a model whose rows
    are its ids."""
    del vocab_size
    return jnp.full((row_vocab,), 1.0 / row_vocab)


def _random_rows_over_every_row():
    from ssd_jax.algorithm import backups
    right = backups.random_speculation

    @functools.partial(jax.jit, static_argnames=("k", "vocab_size", "row_vocab", "row_dtype"))
    def random_speculation(seed, request_ids, n, *, k, vocab_size, row_vocab, row_dtype="float32"):
        toks, _ = right(seed, request_ids, n, k=k, vocab_size=vocab_size, row_vocab=row_vocab,
                        row_dtype=row_dtype)
        rows = jnp.broadcast_to(_uniform_over_every_row(row_vocab, vocab_size),
                                (n.shape[0], k, row_vocab)).astype(row_dtype)
        return toks, rows
    return random_speculation


@functools.partial(jax.jit, static_argnames=("row_vocab", "vocab_size", "row_dtype"))
def _ngram_rows_over_every_row(guess, matched, *, row_vocab, vocab_size, row_dtype):
    onehot = jax.nn.one_hot(guess, row_vocab, dtype=jnp.float32)
    uniform = _uniform_over_every_row(row_vocab, vocab_size)
    return jnp.where(matched[:, None, None], onehot, uniform).astype(row_dtype)


# name -> (the rule it breaks, [(module, attribute, replacement factory)])
_SSD_BUGS: dict[str, tuple[str, list]] = {
    "lookup_next_branch": (
        "the lookup returns the hit branch's tokens and rows (ALGORITHM.md §2 step 4): here the "
        "next branch's (off by one; 'hit' itself is right)",
        [("ssd_jax.pallas_kernels.cache_gather", "cache_gather_reference",
          lambda: _gather_next_branch)]),
    "tree_keys_accept_stream": (
        "tree draws use STREAM_DRAFT (§3): here the accept stream, so a drafted token and its own "
        "accept coin come from one key",
        [("ssd_jax.algorithm.tree", "smp",
          lambda: _sampling_with(STREAM_DRAFT=_sampling.STREAM_ACCEPT))]),
    "tree_keys_by_row": (
        "draws are keyed by request id, not batch row (§3): here the tree keys its draws by row",
        [("ssd_jax.algorithm.tree", "smp", lambda: _sampling_with(position_keys=_keys_by_row))]),
    "tree_rows_rounded_after_draw": (
        "rows are rounded to the cache's row dtype before the draw (§3): here the tree draws from "
        "the float32 rows and stores the rounded ones (a no-op unless row_dtype is not float32)",
        [("ssd_jax.algorithm.tree", "propose", lambda: _propose_drawn_before_rounding)]),
    # Hit-path bugs: each changes only what comes out of the speculation cache
    "lookup_rows_one_depth_late": (
        "a hit hands the verifier, with each cached token, the row it was drawn from (§3): here "
        "the lookup returns the branch's rows one depth late (token d verified against row d - 1)",
        [("ssd_jax.pallas_kernels.cache_gather", "cache_gather_reference",
          lambda: _gather_rows_one_depth_late(importlib.import_module(
              "ssd_jax.pallas_kernels.cache_gather").cache_gather_reference))]),
    "tree_rows_before_saguaro": (
        "every proposal carries its true row, after Saguaro scaling (§3, §4): here the tree draws "
        "from the scaled row but stores the unscaled one, so a hit is verified against q, not q' "
        "(a no-op at C = 1)",
        [("ssd_jax.algorithm.tree", "propose", lambda: _propose_rows_before_saguaro)]),
    # Padded-row bugs: each is a no-op on a model whose rows are its ids
    "random_backup_rows_over_padded_rows": (
        "a backup's rows are the distribution its tokens were drawn from (§3): here the random "
        "backup draws uniform ids but reports rows uniform over every embedding row, padded ones "
        "included",
        [("ssd_jax.algorithm.backups", "random_speculation", _random_rows_over_every_row)]),
    "ngram_rows_over_padded_rows": (
        "the n-gram backup's unmatched rows are the uniform draw's own distribution (§3): here "
        "uniform over every embedding row, padded ones included",
        [("ssd_jax.algorithm.backups", "_ngram_rows", lambda: _ngram_rows_over_every_row)]),
    "tree_keys_one_position_early": (
        "a tree branch draws each token with the key of its own position, as a direct draft "
        "would (§3): here with the key of the position before",
        [("ssd_jax.algorithm.tree", "smp",
          lambda: _sampling_with(position_keys=_keys_one_position_early))]),
}
PLANTED_SSD_BUGS: dict[str, str] = {name: rule for name, (rule, _) in _SSD_BUGS.items()}


@contextlib.contextmanager
def plant_ssd_bug(name: str):
    """Plant SSD bug `name` (a key of `PLANTED_SSD_BUGS`, whose value says which rule it breaks)
    in this process for the duration of the `with` block: the module attributes it replaces are
    swapped and JAX's caches cleared on entry and on exit, so every jitted step is traced again
    with the bug and, afterwards, without it. Not thread-safe; an unknown name is a KeyError."""
    _, patches = _SSD_BUGS[name]
    targets = [(importlib.import_module(mod), attr, make()) for mod, attr, make in patches]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in targets]
    jax.clear_caches()
    try:
        for module, attr, new in targets:
            setattr(module, attr, new)
        yield
    finally:
        for module, attr, old in saved:
            setattr(module, attr, old)
        jax.clear_caches()


ALL_PLANTED_BUGS: tuple[str, ...] = (tuple(PLANTED_BUG_VERIFIERS) + tuple(PLANTED_PROPOSER_BUGS)
                                     + tuple(PLANTED_SSD_BUGS))
