"""The exact window distribution of a target, and the empirical one of a decoder's samples.

`enumerate_window_distribution` gives the exact `[V ** window]` distribution of the next `window`
tokens under plain sampling from the target, its rows computed by the independent float64
reference (ssd_jax.testing.reference), not by the `probs_from_logits` the verifier uses; `window_counts` histograms `[N, window]` generated
windows over the same cells (base-V index, first token most significant). `distribution_test`
(ssd_jax.testing.stats) compares the two.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.testing.reference import reference_probs

__all__ = ["enumerate_window_distribution", "window_counts"]


# ----------------------------------------------------------------------------------------------
# Exact distribution and empirical counts
# ----------------------------------------------------------------------------------------------
def enumerate_window_distribution(
    logits_fn: Callable,
    prompt: list[int],
    window: int,
    params: SamplingParams,
    vocab_size: int,
    batch_size: int = 4096,
) -> np.ndarray:
    """Exact probabilities of every continuation of `prompt` by `window` tokens.

    Args:
      logits_fn: `tokens [N, T] int32 -> logits [N, T, V_model]`, a full cache-free forward
        (V_model >= vocab_size; extra rows are padding and get probability 0).
      prompt: the context, a list of token ids.
      window: number of generated tokens to enumerate.
      params: the user's sampling parameters (numbers, one setting for every prefix), applied per
        step by `reference_probs` (float64, sharing no code with the decoder's `probs_from_logits`).
      vocab_size: the real vocabulary size V.
      batch_size: prefixes per `logits_fn` call.
    Returns:
      `[V ** window]` float64, index = base-V number of the window (first token most significant).

    Breadth-first: level t holds all V**t prefixes with their probabilities; one batched forward per
    chunk of prefixes extends them by one token.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    V = int(vocab_size)
    if any(np.ndim(getattr(params, f)) for f in ("temperature", "top_k", "top_p")):
        raise ValueError("enumerate_window_distribution takes one setting (numbers), not per-request arrays")
    prompt_arr = np.asarray(prompt, np.int32)[None, :]
    if prompt_arr.shape[1] < 1:
        raise ValueError("prompt must hold at least one token")
    prefixes = np.zeros((1, 0), np.int32)  # generated part only, [N_t, t]
    mass = np.ones((1,), np.float64)
    for _ in range(window):
        N = prefixes.shape[0]
        next_rows = np.empty((N, V), np.float64)
        for start in range(0, N, batch_size):
            chunk = prefixes[start:start + batch_size]
            toks = np.concatenate([np.repeat(prompt_arr, chunk.shape[0], axis=0), chunk], axis=1)
            logits = logits_fn(jnp.asarray(toks, jnp.int32))
            last = jnp.asarray(logits)[:, -1, :]
            if last.shape[-1] < V:
                raise ValueError(f"logits_fn gave {last.shape[-1]} rows, fewer than vocab_size={V}")
            rows = reference_probs(np.asarray(last, np.float64), params, vocab_size=V)
            next_rows[start:start + chunk.shape[0]] = rows[:, :V]
        mass = (mass[:, None] * next_rows).reshape(-1)
        prefixes = np.concatenate(
            [np.repeat(prefixes, V, axis=0), np.tile(np.arange(V, dtype=np.int32), N)[:, None]], axis=1)
    return mass


def window_counts(tokens, vocab_size: int) -> np.ndarray:
    """Histogram of windows: tokens `[N, window]` -> counts `[V ** window]` int64 (base-V index,
    first token most significant; V = vocab_size). A token outside [0, V) raises ValueError."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [N, window], got shape {tokens.shape}")
    V, w = int(vocab_size), tokens.shape[1]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= V):
        raise ValueError(f"tokens outside [0, {V}): min {tokens.min()}, max {tokens.max()} "
                         "(a padded-vocabulary row or a -1 placeholder leaked into the output)")
    idx = np.zeros(tokens.shape[0], np.int64)
    for j in range(w):
        idx = idx * V + tokens[:, j].astype(np.int64)
    return np.bincount(idx, minlength=V ** w).astype(np.int64)

