"""Fan-out allocation, the miss model fit, the ALGORITHM.md §6 formulas, the policy's choices, and the
engine's auto backup and §6 prediction."""
import jax
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.algorithm import fanout as fo
from ssd_jax.algorithm import policy
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.algorithm.near_tie import assert_greedy_agreement


def test_expected_tokens_and_sd_speedup():
    assert policy.expected_tokens(0.0, 5) == 1.0
    assert policy.expected_tokens(1.0, 5) == 6.0
    assert policy.expected_tokens(0.5, 2) == pytest.approx(1.75)
    # S_SD = T1 E / (Tv + K Td)
    assert policy.sd_speedup(1.0, 1.0, 0.1, 2, 0.5) == pytest.approx(1.75 / 1.2)


def test_ssd_speedup_hand_computed():
    # all hits: T1 E_hit / max(Tv, Tp), whatever the batch
    assert policy.ssd_speedup(1.0, 1.0, 0.5, 0.3, 1.0, 4.0, 2.0) == pytest.approx(4.0)
    assert policy.ssd_speedup(1.0, 1.0, 2.0, 0.3, 1.0, 4.0, 2.0) == pytest.approx(2.0)
    assert policy.ssd_speedup(1.0, 1.0, 0.5, 0.3, 1.0, 4.0, 2.0, batch=8) == pytest.approx(4.0)
    # p_hit 0.8, batch 1: tokens 0.8*4 + 0.2*2 = 3.6; time 1 + 0.2*0.3 = 1.06 (a miss costs the
    # tree and the backup)
    assert policy.expected_round_tokens(0.8, 4.0, 2.0) == pytest.approx(3.6)
    assert policy.expected_round_time(1.0, 0.5, 0.3, 0.8) == pytest.approx(1.06)
    assert policy.ssd_speedup(1.0, 1.0, 0.5, 0.3, 0.8, 4.0, 2.0) == pytest.approx(3.6 / 1.06)
    # batch 2: all-hit 0.64, so time 1 + 0.36*0.3 = 1.108; each sequence still emits 3.6
    assert policy.expected_round_time(1.0, 0.5, 0.3, 0.8, batch=2) == pytest.approx(1.108)
    assert policy.ssd_speedup(1.0, 1.0, 0.5, 0.3, 0.8, 4.0, 2.0, batch=2) == pytest.approx(3.6 / 1.108)
    # T1 = 2, Tp > Tv, batch 3: tokens 0.5*3 + 0.5*1 = 2; time 1.5 + (1 - 0.125)*0.4 = 1.85
    assert policy.ssd_speedup(2.0, 1.0, 1.5, 0.4, 0.5, 3.0, 1.0, batch=3) == pytest.approx(4.0 / 1.85)
    # a free backup: the batch's misses cost no time, so the batch size does not matter
    assert policy.ssd_speedup(1.0, 1.0, 0.5, 0.0, 0.5, 3.0, 1.0, batch=64) == pytest.approx(2.0)


def test_round_time_is_the_sharding_round_time():
    from ssd_jax.runtime.sharding import ssd_round_time
    for tv, tp, tb in ((1.0, 0.5, 0.3), (18.3, 12.0, 10.5), (10.0, 12.0, 5.0)):
        for p in (0.0, 0.3, 0.9, 1.0):
            for b in (1, 2, 16):
                assert policy.expected_round_time(tv, tp, tb, p, b) == pytest.approx(
                    ssd_round_time(tv, tp, tb, p, b))


def _simulate_rounds(rng, rounds, batch, k, p_hit, a_hit, a_miss, tv, tp, tb):
    """Monte-Carlo SSD rounds: per sequence a hit with probability p_hit; accepted draft tokens
    min(Geometric, K) with acceptance a_hit after a hit, a_miss after a miss (+1 bonus); the round
    takes max(Tv, Tp), plus Tb when any sequence of the batch missed. Returns (mean tokens per
    sequence per round, mean round time)."""
    hit = rng.random((rounds, batch)) < p_hit
    acc = np.where(hit, a_hit, a_miss)
    # number of accepted tokens before the first rejection, each accepted with probability acc
    u = rng.random((rounds, batch, k))
    accepted = np.cumprod(u < acc[..., None], axis=-1).sum(-1)
    tokens = accepted + 1
    time = max(tv, tp) + tb * (~hit).any(axis=1)
    return tokens.mean(), time.mean()


@pytest.mark.parametrize("batch,p_hit,tb", [(1, 0.8, 0.4), (4, 0.9, 0.4), (16, 0.8, 0.4),
                                            (16, 0.8, 0.0), (8, 0.6, 1.2)])
def test_ssd_speedup_matches_a_monte_carlo_of_rounds(batch, p_hit, tb):
    rng = np.random.default_rng(1234 + batch)
    k, a_hit, a_miss, t1, tv, tp = 4, 0.8, 0.3, 1.0, 1.0, 0.7
    tokens, time = _simulate_rounds(rng, 20000, batch, k, p_hit, a_hit, a_miss, tv, tp, tb)
    e_hit, e_miss = policy.expected_tokens(a_hit, k), policy.expected_tokens(a_miss, k)
    assert policy.expected_round_tokens(p_hit, e_hit, e_miss) == pytest.approx(tokens, rel=0.01)
    assert policy.expected_round_time(tv, tp, tb, p_hit, batch) == pytest.approx(time, rel=0.01)
    assert policy.ssd_speedup(t1, tv, tp, tb, p_hit, e_hit, e_miss, batch) == pytest.approx(
        t1 * tokens / time, rel=0.02)


def test_backup_crossover_with_batch():
    # The example: a = 0.8, K = 4, p_hit = 0.8, T1 = Tv = Tp, neural Tb = 0.4 Tv (and
    # E_miss = E_hit), random Tb = 0 (and E_miss = 1). Tokens per sequence do not depend on b.
    a, k, p = 0.8, 4, 0.8
    e = policy.expected_tokens(a, k)
    assert e == pytest.approx(3.3616)

    def s(b):
        return (policy.ssd_speedup(1.0, 1.0, 1.0, 0.4, p, e, e, b),
                policy.ssd_speedup(1.0, 1.0, 1.0, 0.0, p, e, 1.0, b))
    neural, random = s(1)  # 3.3616 / 1.08 vs 0.8 * 3.3616 + 0.2
    assert neural == pytest.approx(3.3616 / 1.08) and random == pytest.approx(2.88928)
    assert neural > random
    neural, random = s(16)  # 3.3616 / (1 + 0.4 (1 - 0.8^16)) vs the same 2.88928
    assert neural == pytest.approx(3.3616 / (1 + 0.4 * (1 - 0.8 ** 16)))
    assert neural == pytest.approx(2.42, abs=0.005) and random == pytest.approx(2.89, abs=0.005)
    assert random > neural

    # plan makes the same choice: fan-out one per position, so p_hit = 1 - c = 0.8; the tree
    # (5 x 0.1 x 1.2 = 0.6) hides behind the verify; the neural backup is K draft steps = 0.4
    costs = policy.Costs(t1=1.0, tv=1.0, td=0.1, width_slope=0.05)
    for b, want in ((1, "neural"), (16, "random")):
        pl = policy.plan(costs, a, miss_c=0.2, miss_r=1.0, ks=(k,), budgets=(5,), batch=b,
                         acceptance_after_fast_backup=0.0)
        assert pl.fanout == (1, 1, 1, 1, 1) and pl.p_hit == pytest.approx(0.8)
        assert pl.backup == want
        assert pl.predicted_speedup == pytest.approx(max(s(b)))

    # and so does the per-round chooser of backup="auto", from measurements of the same shape
    # (tokens after a neural backup 3.5 on average, as after a hit; 1 after a random one):
    # b = 1: 3.5 / 1.08 = 3.24 vs 3.0; b = 16: 3.5 / 1.389 = 2.52 vs 3.0
    for b, want in ((1, "neural"), (16, "random")):
        ch = policy.BackupChooser(b)
        ch.record("neural", backup_s=0.4, tokens=[3, 4])
        ch.record("random", backup_s=0.0, tokens=[1, 1, 1])
        assert ch.choose(p, 1.0, 1.0, 3.5) == want


def test_allocate_follows_the_capped_geometric_series():
    a, r, k, budget = 0.8, 1.0, 6, 24
    f = fo.allocate(k, budget, a, r=r)
    assert sum(f) == budget and len(f) == k + 1 and min(f) >= 0
    assert list(f[:k]) == sorted(f[:k], reverse=True)  # F_j = F_0 a^(j/(1+r)) decreases for j < K
    w = np.array([(a ** j * (1 - a)) ** (1 / (1 + r)) for j in range(k)] + [(a ** k) ** (1 / (1 + r))])
    ideal = budget * w / w.sum()
    assert np.all(np.abs(np.array(f) - ideal) < 1.0)  # the integer rounding of the formula
    with pytest.raises(ValueError, match="budget"):
        fo.allocate(3, 0, 0.5)


def test_allocate_caps_by_the_vocabulary_small_cases():
    # j < K masks the drafted token out of the row: at most V - 1 candidates there, V at j = K
    assert fo.caps(2, 3) == (2, 2, 3)
    # V = 3, K = 2: caps (2, 2, 3) sum to 7, so MQ = 7 is exactly the caps, whatever a
    for a in (0.0, 0.5, 0.8, 0.99, 1.0):
        assert fo.allocate(2, 7, a, vocab=3) == (2, 2, 3)
    # MQ = 6, a = 0.8: P = (0.2, 0.16, 0.64), weights sqrt(P) = (0.447, 0.4, 0.8), shares
    # 6 w / sum w = (1.63, 1.46, 2.91) -> floors (1, 1, 2), largest remainders j = 2, 0 -> (2, 1, 3)
    assert fo.allocate(2, 6, 0.8, vocab=3) == (2, 1, 3)
    # a = 0.95: F_2's share 4.10 is held at its cap 3; the 3 left split (1.52, 1.48) -> (2, 1, 3)
    assert fo.allocate(2, 6, 0.95, vocab=3) == (2, 1, 3)
    # a = 0.2, V = 2: shares (2.88, 1.29, 0.82, 0.55) of MQ 5 -> F_0 held at V - 1 = 1, and so on
    f = fo.allocate(3, 5, 0.2, vocab=2)
    assert f == (1, 1, 1, 2) and sum(f) == 5
    # V = 1: the only token is the drafted one, so j < K holds nothing; F_K = 1
    assert fo.allocate(3, 1, 0.5, vocab=1) == (0, 0, 0, 1)
    for mq, v, k in ((8, 3, 2), (4, 1, 3), (6, 2, 3)):
        with pytest.raises(ValueError, match=f"MQ={mq}.*V={v}.*K={k}"):
            fo.allocate(k, mq, 0.8, vocab=v)


def test_allocate_properties_over_a_grid():
    for k in (1, 2, 3, 4, 6):
        for v in (1, 2, 3, 5, 8, None):
            top = sum(fo.caps(k, v)) if v is not None else 3 * (k + 1)
            for mq in range(1, top + 3):
                for a in (0.0, 0.3, 0.8, 0.99, 1.0):
                    for r in (0.5, 1.0, 2.0):
                        cap = fo.caps(k, v, mq)
                        if mq > sum(cap):
                            with pytest.raises(ValueError, match=f"MQ={mq}"):
                                fo.allocate(k, mq, a, r=r, vocab=v)
                            continue
                        f = fo.allocate(k, mq, a, r=r, vocab=v)
                        assert len(f) == k + 1 and sum(f) == mq, (k, v, mq, a, r, f)
                        assert all(0 <= x <= c for x, c in zip(f, cap)), (k, v, mq, a, r, f)
                        # P_j (hence F_j) does not increase with j < K
                        assert list(f[:k]) == sorted(f[:k], reverse=True), (k, v, mq, a, r, f)
                        if v is None or max(f) < v - 1:  # no cap binds: the rounded formula
                            w = fo.outcome_probs(k, a) ** (1 / (1 + r))
                            assert np.all(np.abs(np.array(f) - mq * w / w.sum()) < 1.0)


def test_plan_keeps_the_fanout_within_the_vocabulary():
    costs = policy.Costs(t1=1.0, tv=1.0, td=0.05, width_slope=0.0)
    p = policy.plan(costs, 0.9, miss_c=0.5, miss_r=1.0, ks=(2,), vocab=3)
    assert sum(p.fanout) <= 7 and all(f <= c for f, c in zip(p.fanout, fo.caps(2, 3)))
    assert policy.plan(costs, 0.9, ks=(2,), budgets=(7, 9), vocab=3).fanout == (2, 2, 3)
    with pytest.raises(ValueError, match="no feasible"):
        policy.plan(costs, 0.9, ks=(2,), budgets=(8, 9), vocab=3)


def test_power_law_fit_recovers_c_and_r():
    fs = [1, 2, 4, 8, 16]
    miss = [0.6 * f ** -0.7 for f in fs]
    c, r = fo.fit_power_law(fs, miss)
    assert c == pytest.approx(0.6, rel=1e-6) and r == pytest.approx(0.7, rel=1e-6)
    assert fo.hit_probability((1, 1, 1), 0.0, 0.5, 1.0) == pytest.approx(0.5)
    assert fo.hit_probability((0, 1, 1), 0.0, 0.5, 1.0) == 0.0  # F_0 = 0 never hits at j = 0


def test_plan_picks_the_backup_the_formulas_favour():
    # cheap accurate drafting at batch 1: the neural backup
    costs = policy.Costs(t1=1.0, tv=1.0, td=0.1, width_slope=0.05)
    small = policy.plan(costs, 0.8, miss_c=0.4, miss_r=0.8, batch=1, ks=(3, 4, 5))
    assert small.backup == "neural"
    assert small.predicted_speedup > small.predicted_sd_speedup > 1
    assert sum(small.fanout) >= small.k + 1
    # a large batch misses almost every round; when the draft barely helps (low acceptance) and
    # costs a third of a verify per token, the free random backup wins
    costly = policy.Costs(t1=1.0, tv=1.0, td=0.3, width_slope=0.05)
    big = policy.plan(costly, 0.1, miss_c=0.4, miss_r=0.8, batch=64, ks=(1, 2, 3))
    assert big.backup == "random"
    chosen = policy.ssd_speedup(1.0, 1.0, costly.tree(big.k, sum(big.fanout)), 0.0, big.p_hit,
                                policy.expected_tokens(0.1, big.k), 1.0, 64)
    assert big.predicted_speedup == pytest.approx(chosen)


def test_costs_measured_reads_the_width_cost_off_the_verify():
    c = policy.Costs.measured(t1=0.25, tv=0.5, draft_s=0.4, k=4)
    assert c.td == pytest.approx(0.1) and c.width_slope == pytest.approx(0.25)
    assert policy.Costs.measured(0.25, 0.2, 0.4, 4).width_slope == 0.0  # never negative
    with pytest.raises(ValueError, match="positive times"):
        policy.Costs.measured(0.25, 0.0, 0.4, 4)


def test_a_measured_draft_width_slope_replaces_the_verify_guess():
    # T(M) = T(1) (1 + 0.25 (M - 1)) exactly, then with noise around it
    assert policy.width_slope_from_times({1: 0.02, 4: 0.035, 8: 0.055}) == pytest.approx(0.25)
    assert policy.width_slope_from_times({1: 0.02, 8: 0.0549, 4: 0.0352}) == pytest.approx(0.25, abs=0.01)
    assert policy.width_slope_from_times({1: 0.02, 8: 0.019}) == 0.0  # never negative
    for bad in ({8: 0.05}, {1: 0.02}, {1: 0.0, 8: 0.05}, {0: 0.01, 1: 0.02, 8: 0.05}):
        with pytest.raises(ValueError, match="M = 1"):
            policy.width_slope_from_times(bad)
    c = policy.Costs.measured(t1=0.158, tv=0.204, draft_s=0.108, k=4, width_slope=0.26)
    assert c.width_slope == 0.26 and c.td == pytest.approx(0.027)
    with pytest.raises(ValueError, match="width_slope"):
        policy.Costs.measured(0.158, 0.204, 0.108, 4, width_slope=-0.1)
    # The paper-shape run that motivated it: on the target's slope (~0.07) the plan takes a wide
    # tree it predicts to fit behind the verify; on the draft's measured 0.26 the tree narrows.
    hist = [3, 9, 4, 4, 40]
    guess = policy.plan_from_sd(0.158, 0.204, 0.108, hist, ks=(4,))
    measured = policy.plan_from_sd(0.158, 0.204, 0.108, hist, ks=(4,), width_slope=0.26)
    assert sum(measured.fanout) < sum(guess.fanout)
    assert policy.Costs.measured(0.158, 0.204, 0.108, 4, 0.26).tree(4, sum(measured.fanout)) < 0.204


def test_plan_from_sd_reads_k_and_acceptance_off_the_histogram():
    hist = [2, 6, 2, 3, 37]  # k = 0..4 accepted
    a = policy.acceptance_from_hist(hist)
    assert a == pytest.approx(167 / (167 + 13))
    p = policy.plan_from_sd(0.26, 0.57, 0.45, hist, ks=(4,))
    assert p == policy.plan(policy.Costs.measured(0.26, 0.57, 0.45, 4), a, miss_c=1 - a, ks=(4,))
    with pytest.raises(ValueError, match="no rounds"):
        policy.acceptance_from_hist([0, 0, 0])


def test_plan_narrows_the_tree_when_width_is_expensive():
    # The same acceptance and draft cost; only what an extra row costs differs. Where a 5-row
    # verify costs 2.1 decode steps (XLA:CPU) a wide tree would outlast the verify, so the plan
    # drafts fewer branches than outcomes; where width is nearly free (a GPU) it covers them all.
    a = 0.93
    cpu = policy.plan(policy.Costs.measured(0.28, 0.59, 0.45, 4), a, miss_c=1 - a, ks=(4,))
    gpu = policy.plan(policy.Costs.measured(0.28, 0.29, 0.45, 4), a, miss_c=1 - a, ks=(4,))
    assert sum(cpu.fanout) < 5 <= sum(gpu.fanout)
    assert cpu.fanout[-1] >= 1  # the likeliest outcome (all K accepted) is always covered
    # and it beats the uniform fan-out (one candidate per position) under the same costs
    costs = policy.Costs.measured(0.28, 0.59, 0.45, 4)
    uni = fo.uniform(4, 1)
    s_uni = policy.ssd_speedup(costs.t1, costs.tv, costs.tree(4, 5), 4 * costs.td,
                               fo.hit_probability(uni, a, 1 - a, 1.0),
                               policy.expected_tokens(a, 4), policy.expected_tokens(a, 4))
    assert cpu.predicted_speedup > s_uni


CFG = tiny_config("qwen2", vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]


@pytest.fixture(scope="module")
def engine():
    t = Model(CFG, random_params(CFG, 0, scale=1.0))
    d = Model(CFG, perturb(t.params, jax.random.key(1), 0.05))
    return Engine(t, d, compilation_cache=False)


def test_auto_backup_is_exact_and_prediction_is_reported(engine):
    # Untimed rounds (the default) and timed ones (timeline=True, which also predicts the
    # speedup) each choose their backups from their own measurements.
    ar = engine.generate(PROMPTS, mode="ar", max_new_tokens=24)
    auto = SSDConfig(fanout=(2, 2, 1, 1), backup="auto")
    dev = engine.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=3, ssd=auto)
    out = engine.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=3, ssd=auto, timeline=True)
    for res in (dev, out):
        for p, g, w in zip(PROMPTS, res.token_ids, ar.token_ids):
            assert_greedy_agreement(engine.target.params, CFG, p, g, w)
        assert sum(res.metrics.backups.values()) > 0
    assert out.metrics.predicted_speedup is not None and out.metrics.predicted_speedup > 0
    d = out.metrics.to_dict()
    assert d["predicted_speedup"] == out.metrics.predicted_speedup
    assert 0 <= d["per_token_acceptance"] <= 1


def test_calibration_measures_miss_rate_falling_with_fan_out(engine):
    cal = policy.calibrate_miss_rates(
        lambda f: engine.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=2,
                                  ssd=SSDConfig(fanout=f)), k=2, fanouts=(1, 4))
    assert cal["miss_rates"][1] <= cal["miss_rates"][0]
    assert 0 < cal["c"] and 0 < cal["r"]
