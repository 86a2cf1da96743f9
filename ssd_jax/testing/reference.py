"""The target's sampling distribution computed independently: float64 numpy, one row at a time.

`reference_probs` is what the exact window distribution is built from, so it must not share code
with the function it checks (`ssd_jax.algorithm.sampling.probs_from_logits`, which computes the
verifier's `p`): a temperature / top-k / top-p bug there would otherwise move the exact
distribution and the engine's output together and pass every distribution test. It follows the
contract `SamplingParams` and `probs_from_logits` document, written again from that text:

- entries at or above `vocab_size` (padded embedding rows) get probability 0;
- temperature 0, or a row with no finite logit: one-hot at the first maximum of the (masked)
  logits;
- else, in this order: divide by the temperature; top-k keeps every logit >= the k-th largest
  (counting repeats, so ties with the k-th are kept; k = 0 or k >= the row's width: off);
  softmax; top-p keeps the smallest set of most likely tokens whose mass reaches top_p (a token is
  kept iff the mass of the tokens sorted strictly before it is < top_p, at least one), plus every
  token whose probability equals the last kept one's; renormalise.

Everything is a plain Python loop over rows with numpy float64 and `math`; slow, and meant for
rows of a tiny vocabulary.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["reference_probs", "reference_row"]


def reference_row(logits, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  vocab_size: int | None = None) -> np.ndarray:
    """One row: logits `[V]` (any real dtype; +inf / NaN not supported) -> probabilities `[V]`
    float64 summing to 1, for one request's temperature / top_k / top_p (module docstring)."""
    row = [float(v) for v in np.asarray(logits, np.float64).reshape(-1)]
    width = len(row)
    real = width if vocab_size is None else int(vocab_size)
    if not 1 <= real <= width:
        raise ValueError(f"vocab_size must be in [1, {width}], got {vocab_size}")
    if any(math.isnan(v) or v == math.inf for v in row):
        raise ValueError("+inf / NaN logits are outside the contract")
    masked = [v if i < real else -math.inf for i, v in enumerate(row)]
    best = max(masked)
    first_max = masked.index(best)
    out = np.zeros(width, np.float64)
    if temperature == 0 or best == -math.inf:
        out[first_max] = 1.0
        return out
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")

    # top-k on the logits (dividing by T > 0 keeps their order and their ties)
    keep = [v > -math.inf for v in masked]
    k = int(top_k)
    if 0 < k < width:
        kth = sorted(masked, reverse=True)[k - 1]  # counting repeats
        keep = [kp and v >= kth for kp, v in zip(keep, masked)]

    # softmax at temperature T, shifted by the largest kept logit (always the row's maximum)
    weights = [math.exp((v - best) / temperature) if kp else 0.0 for v, kp in zip(masked, keep)]
    total = math.fsum(weights)
    probs = [w / total for w in weights]

    if top_p < 1.0:
        order = sorted(range(width), key=lambda i: -probs[i])
        before, last_kept = 0.0, None
        for n, i in enumerate(order):
            if n > 0 and not before < top_p:
                break
            last_kept = probs[i]
            before += probs[i]
        probs = [p if p >= last_kept else 0.0 for p in probs]
        total = math.fsum(probs)
        probs = [p / total for p in probs]
    out[:] = probs
    return out


def reference_probs(logits, params, vocab_size: int | None = None) -> np.ndarray:
    """`[N, V]` (or `[V]`) logits -> float64 probabilities of the same shape, row i under
    `params` (a SamplingParams; its fields numbers, or `[N]` arrays with one value per row), by
    `reference_row`."""
    x = np.asarray(logits, np.float64)
    rows = x.reshape(-1, x.shape[-1])
    fields = [np.asarray(getattr(params, f)) for f in ("temperature", "top_k", "top_p")]
    if any(f.ndim and (x.ndim != 2 or f.shape != (rows.shape[0],)) for f in fields):
        raise ValueError(f"per-row sampling values must match logits [N, V]; got logits "
                         f"{x.shape}, fields {[f.shape for f in fields]}")
    cols = [np.broadcast_to(f, (rows.shape[0],)) for f in fields]
    out = np.stack([reference_row(r, float(t), int(k), float(p), vocab_size)
                    for r, t, k, p in zip(rows, *cols)])
    return out.reshape(x.shape)
