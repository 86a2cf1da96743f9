"""Greedy equality up to floating point (ALGORITHM.md §3): identical, or a near-tie at the first divergence.

A K+1-token verify and a 1-token decode differ in the last bits, so greedy SD/SSD may legitimately
pick the other of two (almost) tied tokens. The check passes when the outputs are identical, or
when, at the first divergence, plain decoding's top-2 logit gap is below `rel_tol` of the largest
|logit| — and reports it. Nothing looser.
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
    identical: bool
    divergence: int | None = None  # index into the generated tokens
    gap: float | None = None  # top-2 logit gap of plain decoding there
    scale: float | None = None  # max |logit| there


def greedy_agreement(params, cfg, prompt, got, want, rel_tol: float = 1e-5) -> GreedyAgreement:
    """got / want: generated ids (want = plain greedy decoding). Raises AssertionError on a real
    divergence; returns the verdict (identical, or a reported near-tie)."""
    got, want = list(map(int, got)), list(map(int, want))
    i = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        if len(got) != len(want):
            raise AssertionError(f"same tokens but different lengths: {len(got)} vs {len(want)}")
        return GreedyAgreement(identical=True)
    ids = list(map(int, prompt)) + want[:i]
    logits, _ = forward(params, cfg, jnp.asarray([ids], jnp.int32), init_cache(cfg, 1, len(ids)),
                        last_only=True)
    row = np.sort(np.asarray(logits[0], np.float64))
    gap, scale = float(row[-1] - row[-2]), float(np.max(np.abs(row)))
    if gap > rel_tol * scale:
        raise AssertionError(
            f"greedy outputs diverge at generated token {i}: got {got[i]}, plain decoding {want[i]}; "
            f"top-2 logit gap {gap:.3g} > {rel_tol:g} x max|logit| {scale:.3g} (not a near-tie)")
    warnings.warn(f"near-tie at generated token {i}: gap {gap:.3g} <= {rel_tol:g} x {scale:.3g}")
    return GreedyAgreement(identical=False, divergence=i, gap=gap, scale=scale)


def assert_greedy_agreement(params, cfg, prompt, got, want, rel_tol: float = 1e-5) -> GreedyAgreement:
    return greedy_agreement(params, cfg, prompt, got, want, rel_tol)
