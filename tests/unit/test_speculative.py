"""Greedy SD and SSD equal greedy plain decoding (ALGORITHM.md §3 near-tie rule), on tiny random pairs that
make every path run: draft = target, a perturbed copy, an unrelated draft; hits, misses and every
backup; the Pallas kernels against the references."""
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.runtime.device_loop import DeviceLoop
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.algorithm.near_tie import assert_greedy_agreement

from _tiny import padded_draft, padded_model

IDS = 64
CFG = tiny_config("qwen2", vocab_size=IDS)  # the ids; the models carry padded rows past them
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]


@pytest.fixture(scope="module")
def target():
    return padded_model(CFG, 0, scale=1.0, name="tiny-target")


@pytest.fixture(scope="module")
def drafts(target):
    return {
        "same": target,
        "perturbed": padded_draft(target, 1, 0.05),
        "unrelated": padded_model(CFG, 7, scale=1.0),
    }


@pytest.fixture(scope="module")
def ar_reference(target):
    eng = Engine(target, None, compilation_cache=False)
    return eng.generate(PROMPTS, mode="ar", max_new_tokens=24).token_ids


def check(target, prompts, got, want):
    for p, g, w in zip(prompts, got, want):
        assert max(g, default=0) < IDS  # never a padded row
        assert_greedy_agreement(target.params, target.cfg, p, g, w, vocab_size=IDS)


@pytest.mark.parametrize("draft_kind", ["same", "perturbed", "unrelated"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_equals_plain_decoding(target, drafts, ar_reference, draft_kind, k):
    eng = Engine(target, drafts[draft_kind], compilation_cache=False)
    total = np.zeros(k + 1, int)
    for batch in (1, 4):
        out = eng.generate(PROMPTS[:batch], mode="sd", max_new_tokens=24, k=k)
        check(target, PROMPTS[:batch], out.token_ids, ar_reference[:batch])
        hist = out.metrics.accept_hist
        assert len(hist) == k + 1 and sum(hist) > 0
        total += hist
        if draft_kind == "same":
            assert hist[k] == sum(hist)  # every round all-accepted: the catch-up path each round
    if draft_kind == "perturbed":
        # rollback (k < K) and catch-up (k == K) both happened, and every accept length occurred
        assert all(h > 0 for h in total), total


@pytest.mark.parametrize("backup", ["neural", "random", "ngram"])
def test_greedy_ssd_equals_plain_decoding_with_hits_and_misses(target, drafts, ar_reference, backup):
    eng = Engine(target, drafts["perturbed"], compilation_cache=False)
    for k, fan in ((3, (2, 2, 1, 1)), (2, (1, 1, 1))):
        out = eng.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=k,
                           ssd=SSDConfig(fanout=fan, backup=backup))
        check(target, PROMPTS, out.token_ids, ar_reference)
        m = out.metrics
        assert m.hits > 0, "no cache hit occurred"
        assert m.lookups > m.hits, "no cache miss occurred"
        assert m.backups.get(backup, 0) > 0, f"backup {backup} never ran"


def test_greedy_ssd_unrelated_draft_and_allocated_fanout(target, drafts, ar_reference):
    eng = Engine(target, drafts["unrelated"], compilation_cache=False)
    out = eng.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=4,
                       ssd=SSDConfig(fanout=(3, 2, 1, 1, 1), fanout_backup=(5, 1, 1, 1, 0)))
    check(target, PROMPTS, out.token_ids, ar_reference)
    same = Engine(target, drafts["same"], compilation_cache=False)
    out = same.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=4)
    check(target, PROMPTS, out.token_ids, ar_reference)
    assert out.metrics.hit_rate == 1.0  # draft == target, greedy: the fork always caches the bonus


def test_ssd_pallas_kernels_give_identical_tokens(target, drafts):
    kw = dict(mode="ssd", max_new_tokens=10, k=3, ssd=SSDConfig(fanout=(2, 1, 1, 1)))
    ref = Engine(target, drafts["perturbed"], compilation_cache=False, backend="xla").generate(
        PROMPTS[:2], **kw)
    ker = Engine(target, drafts["perturbed"], compilation_cache=False, backend="pallas").generate(
        PROMPTS[:2], **kw)
    assert ker.metrics.backend == {"target": "pallas", "draft": "pallas"}  # interpret mode here
    assert ref.metrics.backend == {"target": "xla", "draft": "xla"}
    assert ref.token_ids == ker.token_ids
    assert ref.metrics.hits == ker.metrics.hits and ref.metrics.hits > 0


def test_ssd_colocated_equals_split(target, drafts):
    kw = dict(mode="ssd", max_new_tokens=12, k=3, ssd=SSDConfig(fanout=(2, 1, 1, 1)))
    a = Engine(target, drafts["perturbed"], placement="split", compilation_cache=False)
    b = Engine(target, drafts["perturbed"], placement="colocated", compilation_cache=False)
    assert a.placement.split and not b.placement.split
    assert a.generate(PROMPTS, **kw).token_ids == b.generate(PROMPTS, **kw).token_ids


def test_speculation_cache_budget_error(target, drafts, monkeypatch):
    """A sampled draft's cache holds its V-wide rows and the budget refuses them, before any
    work (no prefill), timed or not; a greedy draft's rows are implicit in its tokens
    (`SpeculationCache.one_hot_vocab`): nothing to refuse."""
    eng = Engine(target, drafts["same"], compilation_cache=False)
    tight = SSDConfig(cache_budget_bytes=1000)
    with monkeypatch.context() as m:
        def prefill(*a, **k):
            raise AssertionError("the prefill ran before the budget was checked")
        m.setattr(DeviceLoop, "_prefill_target", prefill)
        for timed in (False, True):
            with pytest.raises(ValueError, match="speculation cache needs"):
                eng.generate(PROMPTS, mode="ssd", k=3, ssd=tight, timeline=timed,
                             sampling=SamplingParams(temperature=1.0))
    out = eng.generate(PROMPTS, mode="ssd", k=3, max_new_tokens=4, ssd=tight)
    assert all(len(t) == 4 for t in out.token_ids)


def test_planned_fanout_comes_from_the_engines_own_measurements(target, drafts, ar_reference):
    eng = Engine(target, drafts["perturbed"], compilation_cache=False)
    with pytest.raises(ValueError, match="mode='ar'"):
        eng.generate(PROMPTS, mode="ssd", k=3, ssd=SSDConfig(fanout="plan"))
    with pytest.raises(ValueError, match="'uniform'"):
        SSDConfig(fanout="uniform").lists(3)
    eng.generate(PROMPTS, mode="ar", max_new_tokens=8)
    eng.generate(PROMPTS, mode="sd", max_new_tokens=8, k=3)  # untimed: no phase times
    with pytest.raises(ValueError, match="timeline=True"):
        eng.generate(PROMPTS, mode="ssd", k=3, ssd=SSDConfig(fanout="plan"))
    for mode in ("ar", "sd"):  # twice each: the first run compiles, its rounds are not timed
        for _ in range(2):  # SD's verify and draft times: timed rounds
            eng.generate(PROMPTS, mode=mode, max_new_tokens=24, k=3, timeline=mode == "sd")
    from ssd_jax.algorithm.policy import plan_from_sd
    sd = eng._sd
    slope = eng.draft_width_slope()  # timed on the draft once, then kept for every plan
    assert slope is not None and slope >= 0 and eng.draft_width_slope() == slope
    want = plan_from_sd(eng._t1, sd["tv"], sd["draft_s"], sd["accept_hist"], ks=(3,),
                        batch=len(PROMPTS), width_slope=slope).fanout
    out = eng.generate(PROMPTS, mode="ssd", max_new_tokens=24, k=3, ssd=SSDConfig(fanout="plan"))
    assert out.metrics.fanout == want == eng.plan_fanout(3, len(PROMPTS))
    assert len(want) == 4 and sum(want) >= 1
    check(target, PROMPTS, out.token_ids, ar_reference)
