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
    """The uniform fan-out: a tuple of K+1 ints, F_j = f for j = 0..K (MQ = (K+1) f)."""
    if k < 1 or f < 1:
        raise ValueError(f"need K >= 1 and fan-out >= 1, got K={k}, f={f}")
    return (int(f),) * (k + 1)


def outcome_probs(k: int, a: float) -> np.ndarray:
    """P(k accepted = j), j = 0..K, with per-token acceptance a: a^j (1-a) for j < K, a^K for j = K
    (normalised). Returns a float array of shape [K+1]."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    p = np.array([a ** j * (1 - a) for j in range(k)] + [a ** k])
    return p / p.sum()


def caps(k: int, vocab: int | None, budget: int | None = None) -> tuple[int, ...]:
    """The most candidates the fork can cache at each accept position j = 0..K, for a vocabulary
    of `vocab` tokens: V - 1 for j < K (the drafted token s_{j+1} is masked out of row j: a
    rejected token can never be the bonus) and V at j = K. Without a vocabulary, `budget` at every
    position (no cap beyond the budget itself). A budget MQ is feasible iff MQ <= sum(caps)."""
    if vocab is None:
        if budget is None:
            raise ValueError("caps needs a vocabulary size or a budget")
        return (int(budget),) * (k + 1)
    if vocab < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab}")
    return (int(vocab) - 1,) * k + (int(vocab),)


def allocate(k: int, budget: int, acceptance: float, r: float = 1.0,
             c: Sequence[float] | None = None, vocab: int | None = None) -> tuple[int, ...]:
    """Integer F_0..F_K summing exactly to `budget` (MQ), ∝ (c_j P_j)^(1/(1+r)), 0 <= F_j <= cap_j.

    k: lookahead K; acceptance: per-token acceptance a (P_j from `outcome_probs`); r, c: the miss
    model 1 - p_hit(F) = c_j F^(-r) (c: K+1 entries, default equal); vocab: V, which caps F_j at
    V - 1 for j < K and F_K at V (`caps`). Returns a tuple of K+1 ints (a static tree shape).

    The proportional shares are water-filled under the caps (a capped position's excess goes to
    the others in proportion to their weights, or evenly over positions of weight 0), then rounded
    by largest remainder, so the sum is exact (MQ static) and no F_j exceeds its cap. Positions
    with tiny probability may get 0 branches: a fan-out of 0 there is correct, the fork simply
    caches nothing for them. Raises ValueError when the budget exceeds the sum of the caps
    (K (V-1) + V): no fan-out of that size exists.
    """
    if k < 1:
        raise ValueError(f"need K >= 1, got K={k}")
    if budget < 1:
        raise ValueError(f"fan-out budget must be >= 1, got {budget}")
    if r <= 0:
        raise ValueError(f"power-law exponent r must be > 0, got {r}")
    c = np.ones(k + 1) if c is None else np.asarray(c, float)
    if c.shape != (k + 1,):
        raise ValueError(f"c needs K+1 = {k + 1} entries, got {len(c)}")
    cap = np.asarray(caps(k, vocab, budget), float)
    if cap.sum() < budget:
        raise ValueError(
            f"fan-out budget MQ={budget} exceeds what a vocabulary of V={vocab} allows at K={k}: "
            f"at most V-1={vocab - 1} candidates at each of the K positions j < K and V={vocab} at "
            f"j = K, {int(cap.sum())} in all")
    w = (c * outcome_probs(k, acceptance)) ** (1.0 / (1.0 + r))
    # water-filling: proportional shares, positions whose share exceeds their cap held at the cap
    ideal = np.zeros(k + 1)
    free = np.ones(k + 1, bool)
    left = float(budget)
    while free.any() and left > 0:
        wf = np.where(free, w, 0.0)
        share = left * wf / wf.sum() if wf.sum() > 0 else left * free / free.sum()
        over = free & (share > cap)
        if not over.any():
            ideal[free] = share[free]
            break
        ideal[over] = cap[over]
        left -= cap[over].sum()
        free &= ~over
    f = np.minimum(np.floor(ideal + 1e-9), cap).astype(int)
    # largest remainder (then heavier weight) among positions below their cap; exact because the
    # shares sum to the budget and the budget is feasible
    order = sorted(range(k + 1), key=lambda i: (-(ideal[i] - f[i]), -w[i], i))
    while f.sum() < budget:
        for i in order:
            if f.sum() >= budget:
                break
            if f[i] < cap[i]:
                f[i] += 1
    while f.sum() > budget:  # floating point only: take back from the smallest remainders
        for i in reversed(order):
            if f.sum() <= budget:
                break
            if f[i] > 0:
                f[i] -= 1
    return tuple(int(x) for x in f)


def fit_power_law(fanouts: Sequence[int], miss_rates: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of miss(F) = c F^(-r) in log space -> (c, r). fanouts: uniform fan-outs F
    (>= 2 of them, positive); miss_rates: the measured 1 - p_hit at each (same length). Miss rates
    of 0 are clipped to 1e-4; r is kept >= 1e-3."""
    f = np.asarray(fanouts, float)
    m = np.clip(np.asarray(miss_rates, float), 1e-4, 1.0)
    if len(f) < 2 or np.any(f <= 0):
        raise ValueError("need at least two positive fan-outs to fit the miss model")
    slope, intercept = np.polyfit(np.log(f), np.log(m), 1)
    return float(math.exp(intercept)), float(max(-slope, 1e-3))


def hit_probability(fanout: Sequence[int], acceptance: float, c: float, r: float) -> float:
    """Predicted per-sequence hit rate p_hit = sum_j P_j (1 - c F_j^(-r)) of a fan-out F_0..F_K
    (K+1 ints; F_j = 0 never hits), with P_j = `outcome_probs(K, acceptance)` and the miss model
    1 - p_hit(F) = c F^(-r)."""
    k = len(fanout) - 1
    p = outcome_probs(k, acceptance)
    hits = [0.0 if f == 0 else max(0.0, 1.0 - c * f ** (-r)) for f in fanout]
    return float(np.dot(p, hits))
