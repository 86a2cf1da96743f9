"""SSD's hit counting (issue: the hit rate was counted from round 3 and for lookups of rounds that
never happen): one lookup per sequence for every round after its first, the metrics' hits equal
the timeline's, and a draft equal to the target hits every lookup at temperature 0."""
import dataclasses

import jax
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.runtime.engine import Engine, SSDConfig

CFG = tiny_config("qwen2", vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def target():
    return Model(CFG, random_params(CFG, 0, scale=1.0))


@pytest.mark.parametrize("draft_kind", ["same", "perturbed"])
def test_lookups_are_the_rounds_each_sequence_has_after_its_first(target, draft_kind):
    draft = target if draft_kind == "same" else Model(
        CFG, perturb(target.params, jax.random.key(1), 0.2))
    eng = Engine(target, draft, compilation_cache=False, backend="xla")
    # different budgets: the rows finish in different rounds
    out = [eng.generate([p], mode="ssd", k=3, max_new_tokens=n, ssd=SSDConfig(fanout=(2, 1, 1, 1)))
           for p, n in zip(PROMPTS, (9, 13, 21))]
    batch = eng.generate(PROMPTS, mode="ssd", k=3, max_new_tokens=13,
                         ssd=SSDConfig(fanout=(2, 1, 1, 1)))
    for o in out + [batch]:
        m = o.metrics
        rounds_per_row = sum(r.active for r in m.timeline)  # sequence-rounds
        assert m.lookups == rounds_per_row - len(o.token_ids)  # all rounds but each row's first
        assert m.hits == sum(r.hit for r in m.timeline)
        assert m.lookups == sum(r.lookups for r in m.timeline)
        assert m.timeline[-1].lookups == 0  # the last round decides no further round
        if draft_kind == "same":  # greedy, draft == target: the fork always caches the bonus
            assert m.lookups > 0 and m.hits == m.lookups
        assert sum(m.lookups_by_accept) == m.lookups and sum(m.hits_by_accept) == m.hits
        if draft_kind == "same":  # every draft token accepted, every lookup of that outcome a hit
            assert m.lookups_by_accept[:-1] == [0, 0, 0] and m.hits_by_accept == m.lookups_by_accept


def test_hits_by_outcome_match_the_timeline_of_a_single_sequence(target):
    """At batch 1 a round's tokens are its accepted count + 1, and its lookup (hit or not) is the
    lookup of that outcome: the per-outcome split read off the timeline is the metrics' split."""
    draft = Model(CFG, perturb(target.params, jax.random.key(1), 0.2))
    eng = Engine(target, draft, compilation_cache=False, backend="xla")
    m = eng.generate([PROMPTS[0]], mode="ssd", k=3, max_new_tokens=40, eos_ids=[],
                     ssd=SSDConfig(fanout=(2, 1, 1, 1))).metrics
    lookups, hits = [0] * 4, [0] * 4
    for r in m.timeline:
        if r.lookups:
            lookups[r.tokens - 1] += 1
            hits[r.tokens - 1] += r.hit
    assert m.lookups_by_accept == lookups and m.hits_by_accept == hits
    assert sum(lookups[:-1]) > 0 and 0 < sum(hits) < sum(lookups)  # rejections, hits and misses
    rates = m.to_dict()["hit_rate_by_accept"]  # NaN (no lookup of that outcome) is written null
    assert rates == [h / n if n else None for h, n in zip(hits, lookups)]


def test_a_random_backup_round_is_followed_by_a_fork_at_its_outcome(target):
    """After a random backup round (its tokens rejected: outcome j = 0) the fork caches its
    candidates at j = 0, so with the CLI's fan-out 0,...,0,1 a draft equal to the target hits
    every lookup; with the after-hit list there (F_0 = 0) it missed every one, each miss a new
    random round."""
    eng = Engine(target, target, compilation_cache=False, backend="xla")
    ssd = SSDConfig(fanout=(0, 0, 0, 1), backup="random")
    assert ssd.lists(3, CFG.vocab_size)[1] == (1, 0, 0, 0)
    m = eng.generate([PROMPTS[0]], mode="ssd", k=3, max_new_tokens=24, eos_ids=[], ssd=ssd).metrics
    assert m.lookups > 0 and m.hits == m.lookups and m.backups == {}
    stuck = eng.generate([PROMPTS[0]], mode="ssd", k=3, max_new_tokens=24, eos_ids=[],
                         ssd=dataclasses.replace(ssd, fanout_backup=(0, 0, 0, 1))).metrics
    assert stuck.hits == 0 and stuck.backups == {"random": stuck.lookups}
