"""Fan-out: how many candidate bonus tokens the fork caches at each accept position (ALGORITHM.md §6).

The outcome "reject at position j" has probability P_j ≈ a^j (1-a) for j < K and P_K ≈ a^K. With
the per-position miss model 1 - p_hit(F) = c_j F^(-r), maximising the hit probability under a
budget MQ = sum F_j gives F_j ∝ (c_j P_j)^(1/(1+r)); with equal c_j this is the paper's capped
geometric series. Lists are static tuples (they set the tree's static shape).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def uniform(k: int, f: int) -> tuple[int, ...]:
    """F_j = f for j = 0..K (MQ = (K+1) f)."""
    if k < 1 or f < 1:
        raise ValueError(f"need K >= 1 and fan-out >= 1, got K={k}, f={f}")
    return (int(f),) * (k + 1)


def outcome_probs(k: int, a: float) -> np.ndarray:
    """P(k accepted = j), j = 0..K, with per-token acceptance a."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    p = np.array([a ** j * (1 - a) for j in range(k)] + [a ** k])
    return p / p.sum()


def allocate(k: int, budget: int, acceptance: float, r: float = 1.0,
             c: Sequence[float] | None = None, vocab: int | None = None) -> tuple[int, ...]:
    """Integer F_0..F_K summing to `budget`, ∝ (c_j P_j)^(1/(1+r)), each >= 0 and <= vocab.

    Rounds by largest remainder so the sum is exact (MQ static). Positions with tiny probability
    may get 0 branches: a fan-out of 0 there is correct, the fork simply caches nothing for them.
    """
    if budget < 1:
        raise ValueError(f"fan-out budget must be >= 1, got {budget}")
    if r <= 0:
        raise ValueError(f"power-law exponent r must be > 0, got {r}")
    c = np.ones(k + 1) if c is None else np.asarray(c, float)
    if c.shape != (k + 1,):
        raise ValueError(f"c needs K+1 = {k + 1} entries, got {len(c)}")
    w = (c * outcome_probs(k, acceptance)) ** (1.0 / (1.0 + r))
    ideal = budget * w / w.sum()
    f = np.floor(ideal).astype(int)
    cap = vocab if vocab is not None else budget
    f = np.minimum(f, cap)
    for i in np.argsort(-(ideal - f)):
        if f.sum() >= budget:
            break
        if f[i] < cap:
            f[i] += 1
    while f.sum() < budget:  # every position at its cap already: spread what is left
        i = int(np.argmin(f))
        f[i] += 1
    return tuple(int(x) for x in f)


def fit_power_law(fanouts: Sequence[int], miss_rates: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of miss(F) = c F^(-r) in log space -> (c, r). Miss rates of 0 are clipped."""
    f = np.asarray(fanouts, float)
    m = np.clip(np.asarray(miss_rates, float), 1e-4, 1.0)
    if len(f) < 2 or np.any(f <= 0):
        raise ValueError("need at least two positive fan-outs to fit the miss model")
    slope, intercept = np.polyfit(np.log(f), np.log(m), 1)
    return float(math.exp(intercept)), float(max(-slope, 1e-3))


def hit_probability(fanout: Sequence[int], acceptance: float, c: float, r: float) -> float:
    """Predicted p_hit = sum_j P_j (1 - c F_j^(-r)) (F_j = 0 never hits)."""
    k = len(fanout) - 1
    p = outcome_probs(k, acceptance)
    hits = [0.0 if f == 0 else max(0.0, 1.0 - c * f ** (-r)) for f in fanout]
    return float(np.dot(p, hits))
