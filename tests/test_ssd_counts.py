"""SSD's hit counting (issue: the hit rate was counted from round 3 and for lookups of rounds that
never happen): one lookup per sequence for every round after its first, the metrics' hits equal
the timeline's, and a draft equal to the target hits every lookup at temperature 0."""
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
