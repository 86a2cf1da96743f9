"""Choosing K, the fan-out and the backup from measured quantities (ALGORITHM.md §5, §6).

All formulas are those of the spec; every function takes measured numbers (seconds, rates) and
returns a prediction or a choice, so a notebook can sweep them. `plan` picks (K, fan-out, backup);
`BackupChooser` switches the backup per round from running measurements (`SSDConfig(backup="auto")`).
Users override anything by passing explicit values.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from ssd_jax.algorithm import fanout as fo


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per round with per-token acceptance a: (1 - a^(K+1)) / (1 - a)."""
    a = float(acceptance)
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def sd_speedup(t1: float, tv: float, td: float, k: int, acceptance: float) -> float:
    """Predicted plain-SD speedup over plain decoding, S_SD = T_1 E / (T_v + K T_d): t1 one plain
    decode step, tv one verify (K+1 tokens), td one draft step (seconds), k the lookahead K,
    acceptance the per-token acceptance a (E = `expected_tokens(a, K)`)."""
    return t1 * expected_tokens(acceptance, k) / (tv + k * td)


def expected_round_tokens(p_hit: float, e_hit: float, e_miss: float) -> float:
    """Expected tokens one sequence emits per SSD round: p_hit E_hit + (1 - p_hit) E_miss.

    Per sequence, whatever the batch: a miss elsewhere in the batch stalls the round (see
    `expected_round_time`) but does not change what a hit row verifies, since a row that hit keeps
    its own cached speculation (only the rows that missed are re-drafted by the backup)."""
    p = float(p_hit)
    return p * e_hit + (1.0 - p) * e_miss


def expected_round_time(tv: float, tp: float, tb: float, p_hit: float, batch: int = 1) -> float:
    """Expected seconds per SSD round (spec §6): hit max(T_v, T_p), miss max(T_v, T_p) + T_b (the
    dispatched tree cannot be cancelled). With batch b one miss anywhere stalls the whole batch,
    so the round is a hit round with the all-hit probability p_hit^b:
    max(T_v, T_p) + (1 - p_hit^b) T_b. (The same formula as `ssd_jax.runtime.sharding.ssd_round_time`
    without its transfer term.)"""
    p = float(p_hit) ** int(batch)
    return max(tv, tp) + (1.0 - p) * tb


def ssd_speedup(t1: float, tv: float, tp: float, tb: float, p_hit: float, e_hit: float,
                e_miss: float, batch: int = 1) -> float:
    """Predicted SSD speedup over plain decoding (spec §6), per sequence:

        S = T_1 [p E_hit + (1-p) E_miss] / [P max(T_v,T_p) + (1-P)(max(T_v,T_p) + T_b)],
        p = p_hit (per sequence), P = p_hit^b (all b sequences hit).

    t1: one plain decode step; tv: one verify; tp: the draft tree's time; tb: the backup's time
    (seconds); p_hit: per-sequence hit rate; e_hit / e_miss: expected tokens per round after a hit
    / a miss; batch: b. p_hit^b enters the round time only (`expected_round_time`): a miss stalls
    the batch, but each sequence still emits `expected_round_tokens` per round."""
    return t1 * expected_round_tokens(p_hit, e_hit, e_miss) / expected_round_time(tv, tp, tb, p_hit,
                                                                                 batch)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured times (seconds). tree_step(mq) is one tree-decode step over mq branches (batch 1);
    defaults to the draft step scaled linearly by `width_slope` per extra branch."""
    t1: float  # one plain target decode step
    tv: float  # one verify (K+1 tokens)
    td: float  # one draft decode step (1 token)
    width_slope: float = 0.1  # extra cost per additional row of a draft forward, relative to td
    t_backup_fast: float = 0.0

    @classmethod
    def measured(cls, t1: float, tv: float, draft_s: float, k: int,
                 width_slope: float | None = None) -> "Costs":
        """Costs from one run's medians: t1 a plain decode step, tv a K+1-token verify, draft_s
        an SD round's drafting (catch-up + K draft steps). The extra cost per row of a tree step
        is best measured on the draft itself (`width_slope`, from `width_slope_from_times`);
        without it, it is read off the target, whose verify is the same forward K+1 rows wide:
        (tv / t1 - 1) / K. That guess can be far off: the 1.5B bf16 target's is ~0.07, the 0.5B
        int8 draft's own ~0.26 on a CPU core, and a plan on the guess picked an 8-branch tree
        that took 1.9x the verify it was meant to hide behind."""
        if min(t1, tv, draft_s) <= 0 or k < 1:
            raise ValueError(f"need positive times and K >= 1, got t1={t1}, tv={tv}, "
                             f"draft_s={draft_s}, K={k}")
        if width_slope is None:
            width_slope = max(tv / t1 - 1.0, 0.0) / k
        elif not width_slope >= 0:
            raise ValueError(f"width_slope must be >= 0, got {width_slope}")
        return cls(t1=t1, tv=tv, td=draft_s / k, width_slope=float(width_slope))

    def tree(self, k: int, mq: int) -> float:
        """T_p = glue (K+1 tokens) + K tree steps over MQ branches."""
        step = self.td * (1 + self.width_slope * (mq - 1))
        glue = self.td * (1 + self.width_slope * k)
        return glue + k * step


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` picked: lookahead k, the fan-out F_0..F_K (sum = MQ), the backup ("neural" or
    "random"), the predicted SSD and SD speedups over plain decoding at that k, and the predicted
    per-sequence hit rate p_hit of that fan-out."""
    k: int
    fanout: tuple[int, ...]
    backup: str
    predicted_speedup: float
    predicted_sd_speedup: float
    p_hit: float


def plan(costs: Costs, acceptance: float, miss_c: float = 0.5, miss_r: float = 1.0, *,
         ks: Sequence[int] = range(1, 9), budgets: Sequence[int] | None = None, batch: int = 1,
         vocab: int | None = None, acceptance_after_fast_backup: float = 0.0) -> Plan:
    """Pick K, the fan-out (allocated as in ALGORITHM.md §6) and the backup maximising the predicted speedup.

    Budgets default to MQ = 1 .. 4(K+1): narrow trees (fewer branches than outcomes) win where a
    wide draft forward costs much more than a narrow one, as on a CPU, because a tree slower than
    the verify is on the critical path of every round. With `vocab`, F_j is capped at V - 1 for
    j < K and V at j = K (`fanout.caps`); budgets above the caps' sum are skipped (a ValueError
    when no (K, budget) pair is feasible). batch: b, the all-hit probability p_hit^b sets the round
    time (`ssd_speedup`)."""
    best = None
    for k in ks:
        most = sum(fo.caps(k, vocab)) if vocab is not None else None
        for mq in (budgets or range(1, 4 * (k + 1) + 1)):
            if mq < 1 or (most is not None and mq > most):
                continue
            fan = fo.allocate(k, mq, acceptance, miss_r, vocab=vocab)
            p = fo.hit_probability(fan, acceptance, miss_c, miss_r)
            e = expected_tokens(acceptance, k)
            tp = costs.tree(k, mq)
            for backup, tb, e_miss in (
                    ("neural", k * costs.td, e),
                    ("random", costs.t_backup_fast, expected_tokens(acceptance_after_fast_backup, k))):
                s = ssd_speedup(costs.t1, costs.tv, tp, tb, p, e, e_miss, batch)
                if best is None or s > best.predicted_speedup:
                    best = Plan(k, fan, backup, s, sd_speedup(costs.t1, costs.tv, costs.td, k,
                                                              acceptance), p)
    if best is None:
        raise ValueError(f"no feasible (K, budget) among K in {list(ks)} and budgets {budgets} "
                         f"for a vocabulary of {vocab} tokens")
    return best


def acceptance_from_hist(accept_hist: Sequence[int]) -> float:
    """Maximum-likelihood geometric per-token acceptance from an accepted-length histogram
    (counts of k = 0..K accepted): accepted / (accepted + rejections)."""
    acc = sum(j * c for j, c in enumerate(accept_hist))
    rej = sum(accept_hist[:-1])
    if acc + rej == 0:
        raise ValueError(f"the accept histogram {list(accept_hist)} holds no rounds")
    return acc / (acc + rej)


def width_slope_from_times(times: Mapping[int, float]) -> float:
    """A forward's extra cost per row relative to one row, from measured times {M rows: seconds}
    that include M = 1: the least-squares s (never negative) of T(M) ~= T(1) (1 + s (M - 1))."""
    if 1 not in times or len(times) < 2 or min(times) < 1 or not min(times.values()) > 0:
        raise ValueError(f"need positive times at M = 1 and at least one M > 1, got {dict(times)}")
    t1 = times[1]
    num = sum((m - 1) * (t / t1 - 1.0) for m, t in times.items())
    den = sum((m - 1) ** 2 for m in times)
    return max(num / den, 0.0)


def plan_from_sd(t1: float, tv: float, draft_s: float, accept_hist: Sequence[int], *,
                 miss_c: float | None = None, miss_r: float = 1.0,
                 width_slope: float | None = None, **kw) -> Plan:
    """`plan` from what an AR run and an SD run measure: t1 (AR step), tv and draft_s (SD round
    medians) and the SD accept histogram (its length gives the SD K). miss_c defaults to 1 - a:
    at temperature 0 the one-candidate fork misses exactly when the draft's top bonus guess
    disagrees with the target's, which happens about as often as a draft token is rejected; at
    temperature > 0 fit c, r with `calibrate_miss_rates` and pass them. width_slope: the draft's
    measured extra cost per tree branch (`Costs.measured`). kw go to `plan` (ks, ...)."""
    k = len(accept_hist) - 1
    a = acceptance_from_hist(accept_hist)
    c = max(1.0 - a, 1e-3) if miss_c is None else miss_c
    return plan(Costs.measured(t1, tv, draft_s, k, width_slope), a, miss_c=c, miss_r=miss_r, **kw)


class BackupChooser:
    """backup="auto": per miss round, the backup with the higher predicted speedup given running
    estimates. Neural is tried first (its time is unknown until measured); the fast backup's
    acceptance is taken as 0 until measured."""

    def __init__(self, batch: int):
        self.batch = batch
        self.tb = {"neural": None, "random": 0.0}
        self.tokens_after = {"neural": [], "random": []}

    def record(self, kind: str, backup_s: float | None = None, tokens: Sequence[int] = ()):
        """Record a round of backup `kind` ("neural" / "random"): backup_s its measured time in
        seconds (smoothed, EMA 0.7 / 0.3), tokens the tokens each sequence speculated by that
        backup emitted in the following verify (k accepted + 1)."""
        if backup_s is not None:
            self.tb[kind] = backup_s if self.tb[kind] is None else 0.7 * self.tb[kind] + 0.3 * backup_s
        self.tokens_after[kind].extend(tokens)

    def choose(self, p_hit: float, tv: float | None, tp: float | None, e_hit: float) -> str:
        """The backup ("neural" / "random") with the higher `ssd_speedup` at this batch, given the
        running per-sequence hit rate p_hit, verify time tv, tree time tp (seconds) and tokens per
        round after a hit e_hit. A miss stalls the batch for T_b (so a costly neural backup loses
        as p_hit^b falls), while each missed sequence emits its backup's measured tokens per round.
        tv / tp None: the caller cannot time a round apart from its backup yet (the device loop
        prices T_b against a round that ran no neural backup): once neural has served rows, a
        random round is tried so that it can."""
        if self.tb["neural"] is None:
            return "random" if tv is None and self.tokens_after["neural"] else "neural"
        def e(kind):
            t = self.tokens_after[kind]
            return float(np.mean(t)) if t else 1.0
        s = {kind: ssd_speedup(1.0, tv, tp, self.tb[kind], p_hit, e_hit, e(kind), self.batch)
             for kind in ("neural", "random")}
        return max(s, key=s.get)


def calibrate_miss_rates(generate: Callable[[tuple[int, ...]], object], k: int,
                         fanouts: Sequence[int] = (1, 2, 4, 8)) -> dict:
    """Measure the miss rate at uniform fan-outs and fit 1 - p_hit(F) = c F^(-r).

    generate(fanout_tuple) -> a GenerationResult of an SSD run with that fan-out (e.g.
    `lambda f: engine.generate(prompts, mode="ssd", k=k, ssd=SSDConfig(fanout=f))`).
    Returns {"fanouts", "miss_rates", "c", "r", "acceptance"}.
    """
    miss, acc = [], []
    for f in fanouts:
        m = generate(fo.uniform(k, f)).metrics
        miss.append(1.0 - m.hit_rate)
        acc.append(m.per_token_acceptance)
    c, r = fo.fit_power_law(fanouts, miss)
    return {"fanouts": list(fanouts), "miss_rates": miss, "c": c, "r": r,
            "acceptance": float(np.mean(acc))}
