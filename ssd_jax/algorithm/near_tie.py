"""Greedy equality up to floating point (ALGORITHM.md §3): identical, or a near-tie at the first divergence.

A K+1-token verify and a 1-token decode differ in the last bits, so greedy SD/SSD may legitimately
pick the other of two (almost) tied tokens. The check passes when the outputs are identical, or
when, at the first divergence, both the emitted token and plain decoding's token are among the
tied tokens there — those whose logit (plain decoding's, recomputed) is within `rel_tol` of the
largest |logit| of the top logit — and reports it. Nothing looser: a near-tie between two other
tokens does not excuse a third.
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
    scale: float | None = None  # max |logit| there
    tied: tuple[int, ...] | None = None  # the tied tokens there (within rel_tol * scale of the top)


def tied_tokens(logits, rel_tol: float = 1e-5) -> tuple[int, ...]:
    """The tokens tied for the top at one position: logits [V] (one row), the ids t with
    max(logits) - logits[t] <= rel_tol * max|logits|, highest logit first (ties by id). Always
    holds the argmax; more than one token only where the top-2 gap is within the tolerance."""
    row = np.asarray(logits, np.float64).reshape(-1)
    tol = rel_tol * float(np.max(np.abs(row)))
    ids = np.flatnonzero(row.max() - row <= tol)
    return tuple(int(t) for t in sorted(ids, key=lambda t: (-row[t], t)))


def near_tie_verdict(logits, got_token: int, want_token: int, rel_tol: float = 1e-5,
                     where: str = "") -> tuple[float, float, tuple[int, ...]]:
    """The near-tie rule at one divergent position, on plain decoding's logits there ([V]): passes
    when both the emitted token `got_token` and plain decoding's `want_token` are among
    `tied_tokens(logits, rel_tol)`; else AssertionError. Returns (top-2 gap, max|logit|, tied)."""
    row = np.asarray(logits, np.float64).reshape(-1)
    top2 = np.sort(row)[-2:] if row.size > 1 else np.array([row[0], -np.inf])
    gap, scale = float(top2[-1] - top2[0]), float(np.max(np.abs(row)))
    tied = tied_tokens(row, rel_tol)
    for name, tok in (("got", got_token), ("plain decoding", want_token)):
        if int(tok) not in tied:
            lag = float(row.max() - row[int(tok)]) if 0 <= int(tok) < row.size else float("inf")
            raise AssertionError(
                f"greedy outputs diverge{where}: got {got_token}, plain decoding {want_token}; "
                f"{name} token {tok} is {lag:.3g} below the top logit, > {rel_tol:g} x max|logit| "
                f"{scale:.3g} (not a near-tie: tied tokens there {list(tied)[:8]}, top-2 gap "
                f"{gap:.3g})")
    return gap, scale, tied


def greedy_agreement(params, cfg, prompt, got, want, rel_tol: float = 1e-5) -> GreedyAgreement:
    """Greedy equality up to floating point. prompt: the prompt's ids; got / want: generated ids
    (want = plain greedy decoding; 1-D sequences of ints); params / cfg: the target model, whose
    logits after prompt + want[:i] decide the near-tie at the first divergence i. Raises
    AssertionError on a real divergence (a different length, or at i a token outside the tied
    tokens); returns the verdict (identical, or a near-tie, reported with a warning)."""
    got, want = list(map(int, got)), list(map(int, want))
    i = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        if len(got) != len(want):
            raise AssertionError(f"same tokens but different lengths: {len(got)} vs {len(want)}")
        return GreedyAgreement(identical=True)
    ids = list(map(int, prompt)) + want[:i]
    logits, _ = forward(params, cfg, jnp.asarray([ids], jnp.int32), init_cache(cfg, 1, len(ids)),
                        last_only=True)
    gap, scale, tied = near_tie_verdict(np.asarray(logits[0]), got[i], want[i], rel_tol,
                                        where=f" at generated token {i}")
    warnings.warn(f"near-tie at generated token {i}: got {got[i]}, plain decoding {want[i]}, both "
                  f"within {rel_tol:g} x {scale:.3g} of the top logit (top-2 gap {gap:.3g})")
    return GreedyAgreement(identical=False, divergence=i, gap=gap, scale=scale, tied=tied)


def assert_greedy_agreement(params, cfg, prompt, got, want, rel_tol: float = 1e-5) -> GreedyAgreement:
    """`greedy_agreement` (the same arguments and verdict), the name tests and the pytest fixture use."""
    return greedy_agreement(params, cfg, prompt, got, want, rel_tol)
