"""Exactness harness: is a decoding procedure's output distributed exactly as the target's?

Point it at any target / draft / proposal rule:
  1. `enumerate_window_distribution(logits_fn, prompt, window, params, vocab_size)` — the exact
     distribution of the next `window` tokens under plain sampling from the target (tiny vocab).
  2. Run your decoder on N independent requests (distinct request ids, position-indexed keys) and
     collect the first `window` generated tokens of each: `window_counts(tokens, vocab_size)`.
  3. `distribution_test(counts, exact)` — passes iff the counts are consistent with `exact` at the
     stated false-alarm rate; `detection_power(exact, n)` says how large a deviation it would catch.
The planted-bug verifiers below are what a broken implementation looks like; a harness that cannot
tell them from `rejection_sample` is too weak to trust.

Statistic: Pearson chi-square over cells pooled so that every pooled cell has expected count >= 5
(the smallest cells are merged together, in order of probability), plus a hard check that no sample
falls in a cell of exact probability 0 (top-k / top-p / temperature 0 make many such cells; one sample
there is a certain failure). The rejection threshold is the (1 - false_alarm) quantile of the same
statistic over Monte-Carlo multinomial draws from the exact distribution (fixed numpy seed), so the
false-alarm rate is the one asked for, not an asymptotic approximation. Chi-square is used rather than
total variation because with ~256 cells and n = 1e5 the null TV is itself ~0.02: a TV test cannot see
a 0.02 deviation, while chi-square (non-centrality ~ n * sum(delta^2 / p) >= ~160 for any TV-0.02
shift) does.

Chosen sizes (the suite's synthetic SD, tests/test_exactness_harness.py): vocabulary 4 (+1 padded
row), K = 2, window 4 (= K + 2, so every sample crosses at least one round boundary), 256 cells,
n = 100_000. That test requires power >= 0.95 against total-variation-0.02 alternatives
(`detection_power`) and checks the calibrated false-alarm rate; a longer window spreads the same n
over V times more cells, which dilutes the chi-square and lowers the power.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ssd_jax.algorithm.sampling import SamplingParams, _as_keys, probs_from_logits, sample_from_probs
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
    "enumerate_window_distribution",
    "window_counts",
    "DistributionTestResult",
    "distribution_test",
    "detection_power",
    "detection_power_by_alternative",
    "PLANTED_BUG_VERIFIERS",
    "PLANTED_PROPOSER_BUGS",
    "ALL_PLANTED_BUGS",
    "correct_proposal_rows",
    "wrong_proposal_rows",
]


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
      params: the user's sampling parameters, applied per step by `probs_from_logits` exactly as in
        decoding.
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
            rows = np.asarray(probs_from_logits(last, params, vocab_size=V), np.float64)
            if np.any(rows[:, V:] != 0):
                raise AssertionError("probs_from_logits gave padded rows non-zero probability")
            rows = rows[:, :V]
            # Renormalise in float64 so the exact distribution sums to 1 to ~1e-15.
            next_rows[start:start + chunk.shape[0]] = rows / rows.sum(axis=1, keepdims=True)
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


# ----------------------------------------------------------------------------------------------
# The test
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistributionTestResult:
    """The verdict of `distribution_test`; truthy iff it passed, printable with its numbers."""

    statistic: float        # pooled Pearson chi-square; inf if a zero-probability cell was hit
    threshold: float        # Monte-Carlo (1 - false_alarm) quantile under the null
    tv_empirical: float     # 0.5 * sum |counts / n - exact|
    n: int
    passed: bool
    false_alarm: float = 1e-3
    pooled_cells: int = 0   # cells after pooling
    impossible: int = 0     # samples in cells of exact probability 0

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        extra = f", {self.impossible} samples in zero-probability cells" if self.impossible else ""
        return (f"{verdict}: chi2 {self.statistic:.1f} vs threshold {self.threshold:.1f} "
                f"(false alarm {self.false_alarm:g}, {self.pooled_cells} pooled cells, n={self.n}), "
                f"empirical TV {self.tv_empirical:.4f}{extra}")


@dataclasses.dataclass(frozen=True)
class _Pooling:
    cells: np.ndarray        # positive-probability cells, ordered by group
    starts: np.ndarray       # group boundaries into `cells` (for np.add.reduceat)
    group_probs: np.ndarray  # [G]


def _pooling(exact: np.ndarray, n: int, min_expected: float) -> _Pooling:
    """Group positive cells so every group has expected count >= min_expected.

    Cells at or above the bar stay alone (they carry the power). Cells below it are merged with each
    other in ascending order of probability (similar cells together); a last under-filled group
    joins the previous small group, or the smallest big cell if there is none.
    """
    pos = np.flatnonzero(exact > 0)
    order = pos[np.argsort(exact[pos], kind="stable")]
    expected = n * exact[order]
    small, big = order[expected < min_expected], order[expected >= min_expected]
    groups: list[list[int]] = []
    current: list[int] = []
    acc = 0.0
    for cell in small:
        current.append(int(cell))
        acc += n * exact[cell]
        if acc >= min_expected:
            groups.append(current)
            current, acc = [], 0.0
    big_groups = [[int(c)] for c in big]
    if current:
        if groups:
            groups[-1].extend(current)
        elif big_groups:
            big_groups[0].extend(current)
        else:
            groups.append(current)
    groups += big_groups
    cells = np.asarray([c for g in groups for c in g], np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]]).astype(np.int64)
    group_probs = np.add.reduceat(exact[cells], starts)
    return _Pooling(cells=cells, starts=starts, group_probs=group_probs)


def _chi2(pooled_counts: np.ndarray, n: int, group_probs: np.ndarray) -> np.ndarray:
    e = n * group_probs
    return np.sum((pooled_counts - e) ** 2 / e, axis=-1)


_CALIBRATION_CACHE: dict = {}


def _calibrate(exact: np.ndarray, n: int, false_alarm: float, min_expected: float, seed: int):
    """(pooling, threshold): the null (1 - false_alarm) quantile of the pooled chi-square."""
    key = (hashlib.sha1(exact.tobytes()).hexdigest(), n, false_alarm, min_expected, seed)
    if key in _CALIBRATION_CACHE:
        return _CALIBRATION_CACHE[key]
    pool = _pooling(exact, n, min_expected)
    if len(pool.group_probs) < 2:
        result = (pool, 0.0)  # one possible pooled outcome: only the zero-probability check remains
    else:
        # >= 40 expected exceedances so the estimated quantile's false-alarm rate is within ~+-30%.
        sims = max(2000, int(np.ceil(40.0 / false_alarm)))
        rng = np.random.default_rng(seed)
        gp = pool.group_probs / pool.group_probs.sum()
        stats = np.concatenate([
            _chi2(rng.multinomial(n, gp, size=min(10_000, sims - s)), n, gp)
            for s in range(0, sims, 10_000)])
        result = (pool, float(np.quantile(stats, 1.0 - false_alarm, method="higher")))
    if len(_CALIBRATION_CACHE) > 64:
        _CALIBRATION_CACHE.clear()
    _CALIBRATION_CACHE[key] = result
    return result


def _normalised(exact_probs) -> np.ndarray:
    exact = np.asarray(exact_probs, np.float64).reshape(-1)
    if np.any(~np.isfinite(exact)) or np.any(exact < 0) or exact.sum() <= 0:
        raise ValueError("exact_probs must be finite, non-negative and not all zero")
    return exact / exact.sum()


def distribution_test(counts, exact_probs, false_alarm: float = 1e-3, min_expected: float = 5.0,
                      seed: int = 0) -> DistributionTestResult:
    """Are `counts` (a histogram of n independent samples) consistent with `exact_probs`?

    Args:
      counts: `[C]` non-negative integer counts (e.g. from `window_counts`).
      exact_probs: `[C]` the exact distribution (e.g. from `enumerate_window_distribution`).
      false_alarm: probability that an exact sampler fails the test.
      min_expected: pooling bar on expected counts per cell.
      seed: numpy seed of the Monte-Carlo calibration (fixed -> deterministic threshold).
    Returns:
      a `DistributionTestResult` (passed iff the statistic is at most the threshold).
    """
    counts = np.asarray(counts, np.int64).reshape(-1)
    exact = _normalised(exact_probs)
    if counts.shape != exact.shape:
        raise ValueError(f"counts {counts.shape} and exact_probs {exact.shape} differ in shape")
    if np.any(counts < 0):
        raise ValueError("counts must be non-negative")
    n = int(counts.sum())
    if n == 0:
        raise ValueError("no samples")
    if not (0.0 < false_alarm < 1.0):
        raise ValueError(f"false_alarm must be in (0, 1), got {false_alarm}")
    pool, threshold = _calibrate(exact, n, float(false_alarm), float(min_expected), int(seed))
    impossible = int(counts[exact == 0].sum())
    tv = 0.5 * float(np.abs(counts / n - exact).sum())
    if impossible:
        stat = float("inf")
    elif len(pool.group_probs) < 2:
        stat = 0.0
    else:
        pooled = np.add.reduceat(counts[pool.cells], pool.starts)
        stat = float(_chi2(pooled, n, pool.group_probs))
    return DistributionTestResult(statistic=stat, threshold=threshold, tv_empirical=tv, n=n,
                                  passed=bool(stat <= threshold), false_alarm=float(false_alarm),
                                  pooled_cells=len(pool.group_probs), impossible=impossible)


# ----------------------------------------------------------------------------------------------
# Power
# ----------------------------------------------------------------------------------------------
def _move_mass(exact, src, dst, tv):
    """Move `tv` of mass out of cells `src` (proportionally to exact) into `dst` (likewise)."""
    alt = exact.copy()
    alt[src] -= tv * exact[src] / exact[src].sum()
    alt[dst] += tv * exact[dst] / exact[dst].sum()
    return np.clip(alt, 0.0, None)


def _alternatives(exact: np.ndarray, tv: float, seed: int) -> dict[str, np.ndarray]:
    """Distributions at total-variation distance exactly `tv` from `exact`, on its support.

    - likely_to_likely: mass moved from the most likely cell(s) to the next most likely one.
    - likely_to_unlikely: from the most likely cell(s) to the least likely possible cell.
    - unlikely_to_likely: from the least likely cells (a tail holding >= tv) to the mode — what
      greedy-leaning bugs such as argmax matching do.
    - spread: mass moved from a random half of the cells to the other half, proportionally (every
      cell changes by a few %; the hardest case for a chi-square test of this size).
    """
    pos = np.flatnonzero(exact > 0)
    if len(pos) < 2:
        raise ValueError("exact distribution has fewer than two possible cells; nothing to detect")
    desc = pos[np.argsort(-exact[pos], kind="stable")]
    cum = np.cumsum(exact[desc])
    alts = {}
    n_top = int(np.searchsorted(cum, tv)) + 1  # smallest top set holding >= tv
    if n_top < len(desc):
        top = desc[:n_top]
        alts["likely_to_likely"] = _move_mass(exact, top, desc[n_top:n_top + 1], tv)
        alts["likely_to_unlikely"] = _move_mass(exact, top, desc[-1:], tv)
    asc = desc[::-1]
    cum_asc = np.cumsum(exact[asc])
    n_tail = int(np.searchsorted(cum_asc, tv)) + 1
    if n_tail < len(asc):
        alts["unlikely_to_likely"] = _move_mass(exact, asc[:n_tail], asc[-1:], tv)
    rng = np.random.default_rng(seed)
    for _ in range(100):
        plus = rng.random(len(pos)) < 0.5
        if exact[pos[~plus]].sum() >= tv and plus.any():
            alts["spread"] = _move_mass(exact, pos[~plus], pos[plus], tv)
            break
    for name, a in alts.items():
        assert abs(0.5 * np.abs(a - exact).sum() - tv) < 1e-9, name
    return alts


def detection_power_by_alternative(exact_probs, n: int, tv: float = 0.02, trials: int = 400,
                                   false_alarm: float = 1e-3, seed: int = 0,
                                   min_expected: float = 5.0) -> dict[str, float]:
    """Rejection rate of `distribution_test` per alternative (see `_alternatives`), `trials` each.

    exact_probs: `[C]`; n: samples per simulated test; tv: the alternatives' total-variation
    distance from exact; false_alarm: as in `distribution_test`; seed: picks the alternatives and
    the simulated samples. Returns {alternative name: rate in [0, 1]}; deterministic for a fixed seed.
    """
    exact = _normalised(exact_probs)
    pool, threshold = _calibrate(exact, int(n), float(false_alarm), float(min_expected), 0)
    rng = np.random.default_rng(seed + 1)
    out = {}
    for name, alt in _alternatives(exact, tv, seed).items():
        # Alternatives stay on the support, so the pooled counts are multinomial with pooled probs.
        pooled_alt = np.add.reduceat(alt[pool.cells], pool.starts)
        pooled_alt = pooled_alt / pooled_alt.sum()
        if len(pool.group_probs) < 2:
            out[name] = 0.0
            continue
        stats = _chi2(rng.multinomial(int(n), pooled_alt, size=trials), int(n), pool.group_probs)
        out[name] = float(np.mean(stats > threshold))
    return out


def detection_power(exact_probs, n: int, tv: float = 0.02, trials: int = 400,
                    false_alarm: float = 1e-3, seed: int = 0) -> float:
    """Fraction of trials (split evenly over the alternatives) in which samples of size n from an
    alternative at total-variation distance `tv` from exact_probs `[C]` are rejected (the mean of
    `detection_power_by_alternative`). Deterministic for a fixed seed."""
    alts = _alternatives(_normalised(exact_probs), tv, seed)
    per = max(1, trials // len(alts))
    rates = detection_power_by_alternative(exact_probs, n, tv=tv, trials=per,
                                           false_alarm=false_alarm, seed=seed)
    return float(np.mean(list(rates.values())))


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
