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
      logits_fn: `tokens [N, T] int32 -> logits [N, T, V_model]`, a full cache-free forward of a
        causal model: row t depends on tokens 0..t only (V_model >= vocab_size; extra rows are
        padding and get probability 0). It is called on one shape only, `[min(batch_size,
        V ** (window - 1)), len(prompt) + window - 1]`, so a jitted function compiles once.
      prompt: the context, a list of token ids.
      window: number of generated tokens to enumerate.
      params: the user's sampling parameters (numbers, one setting for every prefix), applied per
        step by `reference_probs` (float64, sharing no code with the decoder's `probs_from_logits`).
      vocab_size: the real vocabulary size V.
      batch_size: sequences per `logits_fn` call.
    Returns:
      `[V ** window]` float64, index = base-V number of the window (first token most significant).

    Every continuation of window - 1 tokens is forwarded once at full length: its row at position
    len(prompt) - 1 + t is the next-token row after its first t generated tokens, so those
    sequences hold every prefix's row (prefix x_1..x_t is read from the sequence that continues it
    with zeros). The chain rule then extends the prefixes' probabilities one token at a time. A
    logits_fn whose rows see later tokens raises ValueError (checked on the first call's rows by
    forwarding it again with its last token changed).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    V = int(vocab_size)
    if any(np.ndim(getattr(params, f)) for f in ("temperature", "top_k", "top_p")):
        raise ValueError("enumerate_window_distribution takes one setting (numbers), not per-request arrays")
    prompt_arr = np.asarray(prompt, np.int32).reshape(1, -1)
    P = prompt_arr.shape[1]
    if P < 1:
        raise ValueError("prompt must hold at least one token")
    G = window - 1  # generated tokens in the forwarded sequences
    total = V ** G
    rows_per_call = min(int(batch_size), total)
    # levels[t]: the next-token rows of the V**t prefixes of t tokens, [V**t, V_model]
    levels: list[np.ndarray | None] = [None] * window
    for start in range(0, total, rows_per_call):
        idx = np.arange(start, start + rows_per_call) % total  # the last call wraps: one shape
        digits = (idx[:, None] // V ** np.arange(G - 1, -1, -1)) % V  # [n, G], base V
        toks = np.concatenate([np.repeat(prompt_arr, rows_per_call, 0), digits.astype(np.int32)], 1)
        logits = np.asarray(logits_fn(jnp.asarray(toks)), np.float64)[:, P - 1:]  # [n, window, V_model]
        if logits.shape[-1] < V:
            raise ValueError(f"logits_fn gave {logits.shape[-1]} rows, fewer than vocab_size={V}")
        if start == 0 and G:
            _check_causal(logits_fn, toks, logits, P, V)
        for t in range(window):
            step = V ** (G - t)  # sequence idx continues prefix idx // step with zeros iff idx % step == 0
            mine = (idx % step == 0) & (np.arange(rows_per_call) + start < total)
            if levels[t] is None:
                levels[t] = np.empty((V ** t, logits.shape[-1]), np.float64)
            levels[t][idx[mine] // step] = logits[mine, t]
    mass = np.ones((1,), np.float64)
    for t in range(window):
        rows = reference_probs(levels[t], params, vocab_size=V)[:, :V]
        mass = (mass[:, None] * rows).reshape(-1)
    return mass


def _check_causal(logits_fn: Callable, toks: np.ndarray, logits: np.ndarray, P: int, V: int) -> None:
    """ValueError unless changing each sequence's last token leaves its earlier rows as they were."""
    other = toks.copy()
    other[:, -1] = (other[:, -1] + 1) % V
    again = np.asarray(logits_fn(jnp.asarray(other)), np.float64)[:, P - 1:-1]
    if not np.allclose(again, logits[:, :-1], rtol=1e-5, atol=1e-6):
        raise ValueError("logits_fn is not causal: changing a sequence's last token moved the rows "
                         "of earlier positions (enumerate_window_distribution reads every prefix's "
                         "row from one full-length forward)")


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

