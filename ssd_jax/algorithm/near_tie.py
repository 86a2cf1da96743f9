"""Greedy equality up to floating point (ALGORITHM.md §3): identical, or a near-tie at the first divergence.

A K+1-token verify and a 1-token decode differ in the last bits, so greedy SD/SSD may legitimately
pick the other of two (almost) tied tokens. The check passes when the outputs are identical, or
when, at the first divergence, both the emitted token and plain decoding's token are among the
tied tokens there: on plain decoding's logits (recomputed), the finite tokens at most
`rel_tol * max(|top logit|, 1)` below the top logit. Nothing looser: a near-tie between two other
tokens does not excuse a third.

The tolerance depends on the top logit alone: floating-point noise in it scales with its size
(the floor of 1 keeps a tolerance when the top logit is near 0). It is never widened by the rest
of the row: not by a very negative logit, nor by the -inf a cut draft head or a padded row writes
(the row's largest |logit| would make the tolerance infinite there, and any token would pass).
A NaN or +inf in the row fails the check.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np

from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.transformer import forward


@dataclasses.dataclass(frozen=True)
class GreedyAgreement:
    """The verdict of `greedy_agreement`: identical outputs, or a near-tie at `divergence`."""
    identical: bool
    divergence: int | None = None  # index into the generated tokens
    gap: float | None = None  # top-2 logit gap of plain decoding there
    scale: float | None = None  # the tolerance's scale there: max(|top finite logit|, 1)
    tied: tuple[int, ...] | None = None  # the tied tokens there (within rel_tol * scale of the top)


def tolerance(logits, rel_tol: float = 1e-5) -> float:
    """How far below the top logit a token may lie and still be tied: `rel_tol * max(|top|, 1)`,
    top the largest finite logit of the row (logits [V]); 0 when no logit is finite. Raises
    AssertionError on a NaN or +inf logit (no near-tie can be judged on such a row)."""
    row = np.asarray(logits, np.float64).reshape(-1)
    if np.any(np.isnan(row)) or np.any(row == np.inf):
        raise AssertionError(f"plain decoding's logits hold NaN or +inf: {row[~np.isfinite(row)][:4]}")
    finite = row[np.isfinite(row)]
    return float(rel_tol * max(abs(float(finite.max())), 1.0)) if finite.size else 0.0


def tied_tokens(logits, rel_tol: float = 1e-5) -> tuple[int, ...]:
    """The tokens tied for the top at one position: logits [V] (one row), the finite ids t with
    top - logits[t] <= `tolerance(logits, rel_tol)`, top the largest finite logit, highest logit
    first (ties by id). Holds the argmax whenever a logit is finite; more than one token only where
    the top-2 gap is within the tolerance; no token where no logit is finite."""
    row = np.asarray(logits, np.float64).reshape(-1)
    tol = tolerance(row, rel_tol)
    finite = np.isfinite(row)
    if not finite.any():
        return ()
    top = row[finite].max()
    ids = np.flatnonzero(finite & (top - np.where(finite, row, -np.inf) <= tol))
    return tuple(int(t) for t in sorted(ids, key=lambda t: (-row[t], t)))


def near_tie_verdict(logits, got_token: int, want_token: int, rel_tol: float = 1e-5,
                     where: str = "") -> tuple[float, float, tuple[int, ...]]:
    """The near-tie rule at one divergent position, on plain decoding's logits there ([V]): passes
    when both the emitted token `got_token` and plain decoding's `want_token` are among
    `tied_tokens(logits, rel_tol)`; else AssertionError. Returns (top-2 gap, the tolerance's scale
    max(|top logit|, 1), tied)."""
    row = np.asarray(logits, np.float64).reshape(-1)
    tol = tolerance(row, rel_tol)
    scale = tol / rel_tol if rel_tol > 0 else float("nan")
    top2 = np.sort(row)[-2:] if row.size > 1 else np.array([row[0], -np.inf])
    with np.errstate(invalid="ignore"):  # -inf - -inf in a row with no finite logit: NaN
        gap = float(top2[-1] - top2[0])
    tied = tied_tokens(row, rel_tol)
    for name, tok in (("got", got_token), ("plain decoding", want_token)):
        if int(tok) not in tied:
            with np.errstate(invalid="ignore"):
                lag = float(row.max() - row[int(tok)]) if 0 <= int(tok) < row.size else float("inf")
            raise AssertionError(
                f"greedy outputs diverge{where}: got {got_token}, plain decoding {want_token}; "
                f"{name} token {tok} is {lag:.3g} below the top logit, > {rel_tol:g} x "
                f"max(|top logit|, 1) = {tol:.3g} (not a near-tie: tied tokens there "
                f"{list(tied)[:8]}, top-2 gap {gap:.3g})")
    return gap, scale, tied


def greedy_agreement(params, cfg, prompt, got, want, rel_tol: float = 1e-5,
                     vocab_size: int | None = None) -> GreedyAgreement:
    """Greedy equality up to floating point. prompt: the prompt's ids; got / want: generated ids
    (want = plain greedy decoding; 1-D sequences of ints); params / cfg: the target model, whose
    logits after prompt + want[:i] decide the near-tie at the first divergence i; vocab_size: its
    tokenizer's ids when the model has more embedding rows (the rows past it are padding: -inf
    here, as the engine masks them; default every row). Raises AssertionError on a real
    divergence (a different length, or at i a token outside the tied tokens); returns the
    verdict (identical, or a near-tie, reported with a warning)."""
    got, want = list(map(int, got)), list(map(int, want))
    i = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        if len(got) != len(want):
            raise AssertionError(f"same tokens but different lengths: {len(got)} vs {len(want)}")
        return GreedyAgreement(identical=True)
    ids = list(map(int, prompt)) + want[:i]
    logits, _ = forward(params, cfg, jnp.asarray([ids], jnp.int32), init_cache(cfg, 1, len(ids)),
                        last_only=True)
    row = np.asarray(logits[0], np.float64)
    if vocab_size is not None:
        if not 1 <= int(vocab_size) <= row.size:
            raise ValueError(f"vocab_size must be in [1, {row.size}] (the model's rows), got "
                             f"{vocab_size}")
        row[int(vocab_size):] = -np.inf
    gap, scale, tied = near_tie_verdict(row, got[i], want[i], rel_tol,
                                        where=f" at generated token {i}")
    warnings.warn(f"near-tie at generated token {i}: got {got[i]}, plain decoding {want[i]}, both "
                  f"within {rel_tol:g} x max(|top logit|, 1) = {rel_tol * scale:.3g} of the top "
                  f"logit (top-2 gap {gap:.3g})")
    return GreedyAgreement(identical=False, divergence=i, gap=gap, scale=scale, tied=tied)


def assert_greedy_agreement(params, cfg, prompt, got, want, rel_tol: float = 1e-5,
                            vocab_size: int | None = None) -> GreedyAgreement:
    """`greedy_agreement` (the same arguments and verdict), the name tests and the pytest fixture use."""
    return greedy_agreement(params, cfg, prompt, got, want, rel_tol, vocab_size)
