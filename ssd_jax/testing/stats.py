"""The test statistic, its calibration by simulation, and its power.

Statistic: Pearson chi-square over cells pooled so that every pooled cell has expected count
>= `min_expected` (default 5; the smallest cells are merged together, in order of probability),
plus a hard check that no sample falls in a cell of exact probability 0. The rejection threshold
is the (1 - false_alarm) quantile of the same statistic over Monte-Carlo multinomial draws from the
exact distribution (fixed numpy seed). `detection_power` / `detection_power_by_alternative`
simulate the rejection rate against alternatives at a given total-variation distance. Why
chi-square, what pooling trades, and the suite's chosen sizes: the ssd_jax.testing package
docstring.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

__all__ = ["DistributionTestResult", "distribution_test", "detection_power", "detection_power_by_alternative"]


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
                    false_alarm: float = 1e-3, seed: int = 0, min_expected: float = 5.0) -> float:
    """Fraction of trials (split evenly over the alternatives) in which samples of size n from an
    alternative at total-variation distance `tv` from exact_probs `[C]` are rejected (the mean of
    `detection_power_by_alternative`; min_expected: the test's pooling bar, as in
    `distribution_test`). Deterministic for a fixed seed."""
    alts = _alternatives(_normalised(exact_probs), tv, seed)
    per = max(1, trials // len(alts))
    rates = detection_power_by_alternative(exact_probs, n, tv=tv, trials=per,
                                           false_alarm=false_alarm, seed=seed,
                                           min_expected=min_expected)
    return float(np.mean(list(rates.values())))

