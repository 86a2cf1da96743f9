"""The test statistic, its calibration by simulation, and its power.

Statistic: Pearson chi-square over cells pooled so that every pooled cell has expected count
>= `min_expected` (default 5; the smallest cells are merged together, in order of probability),
plus FINE_WEIGHT (1/4) x the chi-square over cells pooled only to expected count FINE_EXPECTED (5)
when `min_expected` pools more coarsely than that, plus a hard check that no sample falls in a cell
of exact probability 0. The rejection threshold is the (1 - false_alarm) quantile of the same
combined statistic over Monte-Carlo multinomial draws over every possible cell from the exact
distribution (fixed numpy seed), so the false-alarm rate is the one asked for whatever the
pooling and weights. `detection_power` / `detection_power_by_alternative` simulate the rejection
rate against alternatives at a given total-variation distance.

Why two terms. Pooling (the coarse term) buys power against a deviation spread over many cells,
but moving mass between cells inside one pooled group leaves every pooled count as it was: such a
TV-0.01 deviation was rejected at the false-alarm rate (0.003 on the engine's sd-t1.0 case). The
fine term sees it (the same alternative: 1.00); at weight 1/4 its ~df extra degrees of freedom add
little noise to the coarse term, and the coarse term's power against the spread alternative moves
by at most ~0.01 (measured: 0.995 -> 0.995, 0.985 -> 0.98, 0.953 -> 0.963 on three engine cases).
Why chi-square, and the suite's chosen sizes: the ssd_jax.testing package docstring.
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
    fine_cells: int = 0     # cells of the fine chi-square (0: not part of the statistic)
    statistic_pooled: float = 0.0  # its two parts: the pooled chi-square ...
    statistic_fine: float = 0.0    # ... and the fine one, weighted by `fine_weight` in `statistic`
    fine_weight: float = 0.0

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        extra = f", {self.impossible} samples in zero-probability cells" if self.impossible else ""
        parts = (f" = pooled {self.statistic_pooled:.1f} + {self.fine_weight:g} x fine "
                 f"{self.statistic_fine:.1f} over {self.fine_cells} cells"
                 if self.fine_cells and not self.impossible else "")
        return (f"{verdict}: chi2 {self.statistic:.1f}{parts} vs threshold {self.threshold:.1f} "
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


FINE_EXPECTED = 5.0  # the fine statistic's pooling bar (expected count per pooled cell)
FINE_WEIGHT = 0.25   # its weight in the combined statistic


@dataclasses.dataclass(frozen=True)
class _Statistic:
    """The combined statistic over the positive cells: the chi-square pooled at `min_expected`
    plus `fine_weight` x the chi-square pooled only to expected count FINE_EXPECTED (the second
    term is dropped when both poolings are the same). Its poolings index the positive cells
    `pos` of the exact distribution, and it takes counts over those cells only."""
    n: int
    pos: np.ndarray
    coarse: _Pooling
    fine: _Pooling | None
    fine_weight: float

    def parts(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """counts [..., len(pos)] over the positive cells -> (coarse, fine chi-square) [...]."""
        c = _chi2(np.add.reduceat(counts[..., self.coarse.cells], self.coarse.starts, axis=-1),
                  self.n, self.coarse.group_probs)
        if self.fine is None:
            return c, np.zeros_like(c)
        f = _chi2(np.add.reduceat(counts[..., self.fine.cells], self.fine.starts, axis=-1),
                  self.n, self.fine.group_probs)
        return c, f

    def __call__(self, counts: np.ndarray) -> np.ndarray:
        c, f = self.parts(counts)
        return c + self.fine_weight * f


def _statistic(exact: np.ndarray, n: int, min_expected: float, fine_weight: float) -> _Statistic:
    pos = np.flatnonzero(exact > 0)
    coarse = _pooling(exact[pos], n, min_expected)
    fine = _pooling(exact[pos], n, min(FINE_EXPECTED, min_expected))
    same = len(fine.group_probs) == len(coarse.group_probs)
    return _Statistic(n=n, pos=pos, coarse=coarse, fine=None if same or fine_weight == 0 else fine,
                      fine_weight=float(fine_weight))


def _multinomial_cells(rng, n: int, probs: np.ndarray, pos: np.ndarray, size: int) -> np.ndarray:
    """[size, len(pos)] multinomial counts over the cells `pos` of `probs` (which holds all of
    its mass there)."""
    return rng.multinomial(n, probs[pos] / probs[pos].sum(), size=size)


_CALIBRATION_CACHE: dict = {}


def _calibrate(exact: np.ndarray, n: int, false_alarm: float, min_expected: float, seed: int,
               fine_weight: float = FINE_WEIGHT):
    """(statistic, threshold): the null (1 - false_alarm) quantile of the combined statistic,
    from multinomial draws over every cell."""
    key = (hashlib.sha1(exact.tobytes()).hexdigest(), n, false_alarm, min_expected, seed, fine_weight)
    if key in _CALIBRATION_CACHE:
        return _CALIBRATION_CACHE[key]
    stat = _statistic(exact, n, min_expected, fine_weight)
    if len(stat.coarse.group_probs) < 2:
        result = (stat, 0.0)  # one possible pooled outcome: only the zero-probability check remains
    else:
        # >= 40 expected exceedances so the estimated quantile's false-alarm rate is within ~+-30%.
        sims = max(2000, int(np.ceil(40.0 / false_alarm)))
        rng = np.random.default_rng(seed)
        chunk = max(1, min(10_000, 2_500_000 // max(1, len(stat.pos))))
        stats = np.concatenate([stat(_multinomial_cells(rng, n, exact, stat.pos, min(chunk, sims - s)))
                                for s in range(0, sims, chunk)])
        result = (stat, float(np.quantile(stats, 1.0 - false_alarm, method="higher")))
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
                      seed: int = 0, fine_weight: float = FINE_WEIGHT) -> DistributionTestResult:
    """Are `counts` (a histogram of n independent samples) consistent with `exact_probs`?

    Args:
      counts: `[C]` non-negative integer counts (e.g. from `window_counts`).
      exact_probs: `[C]` the exact distribution (e.g. from `enumerate_window_distribution`).
      false_alarm: probability that an exact sampler fails the test.
      min_expected: pooling bar on expected counts per cell of the main chi-square.
      seed: numpy seed of the Monte-Carlo calibration (fixed -> deterministic threshold).
      fine_weight: weight of the fine chi-square (cells pooled only to expected count
        FINE_EXPECTED) added to the main one when min_expected pools more coarsely; 0 = the
        pooled chi-square alone.
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
    stat_fn, threshold = _calibrate(exact, n, float(false_alarm), float(min_expected), int(seed),
                                    float(fine_weight))
    impossible = int(counts[exact == 0].sum())
    tv = 0.5 * float(np.abs(counts / n - exact).sum())
    coarse = fine = 0.0
    if impossible:
        stat = float("inf")
    elif len(stat_fn.coarse.group_probs) < 2:
        stat = 0.0
    else:
        coarse, fine = (float(x) for x in stat_fn.parts(counts[stat_fn.pos]))
        stat = coarse + stat_fn.fine_weight * fine
    return DistributionTestResult(statistic=stat, threshold=threshold, tv_empirical=tv, n=n,
                                  passed=bool(stat <= threshold), false_alarm=float(false_alarm),
                                  pooled_cells=len(stat_fn.coarse.group_probs), impossible=impossible,
                                  fine_cells=0 if stat_fn.fine is None else len(stat_fn.fine.group_probs),
                                  statistic_pooled=coarse, statistic_fine=fine,
                                  fine_weight=stat_fn.fine_weight if stat_fn.fine is not None else 0.0)


# ----------------------------------------------------------------------------------------------
# Power
# ----------------------------------------------------------------------------------------------
def _move_mass(exact, src, dst, tv):
    """Move `tv` of mass out of cells `src` (proportionally to exact) into `dst` (likewise)."""
    alt = exact.copy()
    alt[src] -= tv * exact[src] / exact[src].sum()
    alt[dst] += tv * exact[dst] / exact[dst].sum()
    return np.clip(alt, 0.0, None)


def _in_cells(pool: _Pooling, pos: np.ndarray) -> _Pooling:
    """A pooling of the positive cells `pos` re-indexed to all cells."""
    return dataclasses.replace(pool, cells=pos[pool.cells])


def _alternatives(exact: np.ndarray, tv: float, seed: int,
                  pool: _Pooling | None = None) -> dict[str, np.ndarray]:
    """Distributions at total-variation distance exactly `tv` from `exact`, on its support.

    - likely_to_likely: mass moved from the most likely cell(s) to the next most likely one.
    - likely_to_unlikely: from the most likely cell(s) to the least likely possible cell.
    - unlikely_to_likely: from the least likely cells (a tail holding >= tv) to the mode — what
      greedy-leaning bugs such as argmax matching do.
    - spread: mass moved from a random half of the cells to the other half, proportionally (every
      cell changes by a few %; the hardest case for a chi-square test of this size).
    - adjacent_windows: from the most likely cell to the window next to it in index order (the
      same tokens but the last: a bug in one token's draw).
    - within_tail: inside the least likely cells (the smallest set, in ascending order, holding
      >= 4 tv), from every other one to the ones between, so every stretch of neighbours in the
      sorted order keeps about its mass: what a chi-square over cells pooled in that order cannot
      see.
    - within_pooled_group (when `pool`, the test's pooling, is given and one of its groups of more
      than one cell holds enough mass): inside the heaviest such group, from all its cells but the
      least likely to that one; the group's total is unchanged.
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
    mode = int(desc[0])
    if exact[mode] > tv:
        nearest = pos[pos != mode][np.argmin(np.abs(pos[pos != mode] - mode))]
        alts["adjacent_windows"] = _move_mass(exact, np.array([mode]), np.array([nearest]), tv)
    for m in range(2, len(asc) + 1):
        tail = asc[:m]
        if exact[tail].sum() >= 4 * tv and exact[tail[0::2]].sum() > tv:
            alts["within_tail"] = _move_mass(exact, tail[0::2], tail[1::2], tv)
            break
    if pool is not None:
        groups = np.split(pool.cells, pool.starts[1:])
        big = [g for g in groups if len(g) > 1 and exact[g].sum() - exact[g].min() > tv]
        if big:
            g = max(big, key=lambda g: exact[g].sum())
            low = g[np.argmin(exact[g])]
            alts["within_pooled_group"] = _move_mass(exact, g[g != low], np.array([low]), tv)
    for name, a in alts.items():
        assert abs(0.5 * np.abs(a - exact).sum() - tv) < 1e-9, name
    return alts


def detection_power_by_alternative(exact_probs, n: int, tv: float = 0.02, trials: int = 400,
                                   false_alarm: float = 1e-3, seed: int = 0,
                                   min_expected: float = 5.0,
                                   fine_weight: float = FINE_WEIGHT) -> dict[str, float]:
    """Rejection rate of `distribution_test` per alternative (see `_alternatives`), `trials` each.

    exact_probs: `[C]`; n: samples per simulated test; tv: the alternatives' total-variation
    distance from exact; false_alarm, min_expected, fine_weight: as in `distribution_test`; seed:
    picks the alternatives and the simulated samples. Returns {alternative name: rate in [0, 1]};
    deterministic for a fixed seed.
    """
    exact = _normalised(exact_probs)
    stat, threshold = _calibrate(exact, int(n), float(false_alarm), float(min_expected), 0,
                                 float(fine_weight))
    rng = np.random.default_rng(seed + 1)
    out = {}
    for name, alt in _alternatives(exact, tv, seed, pool=_in_cells(stat.coarse, stat.pos)).items():
        if len(stat.coarse.group_probs) < 2:
            out[name] = 0.0
            continue
        # Alternatives stay on the support: no sample lands in a zero-probability cell.
        out[name] = float(np.mean(stat(_multinomial_cells(rng, int(n), alt, stat.pos, trials))
                                  > threshold))
    return out


def detection_power(exact_probs, n: int, tv: float = 0.02, trials: int = 400,
                    false_alarm: float = 1e-3, seed: int = 0, min_expected: float = 5.0,
                    fine_weight: float = FINE_WEIGHT) -> float:
    """Fraction of trials (split evenly over the alternatives) in which samples of size n from an
    alternative at total-variation distance `tv` from exact_probs `[C]` are rejected (the mean of
    `detection_power_by_alternative`; min_expected, fine_weight: the test's, as in
    `distribution_test`). Deterministic for a fixed seed."""
    exact = _normalised(exact_probs)
    alts = _alternatives(exact, tv, seed, pool=_pooling(exact, int(n), float(min_expected)))
    per = max(1, trials // len(alts))
    rates = detection_power_by_alternative(exact_probs, n, tv=tv, trials=per,
                                           false_alarm=false_alarm, seed=seed,
                                           min_expected=min_expected, fine_weight=fine_weight)
    return float(np.mean(list(rates.values())))
