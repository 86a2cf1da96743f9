"""A user-supplied proposer plugs into SD: prompt lookup (one-hot rows) stays exact, and runs on
the device loop with the rows' history kept on the device."""
import jax
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.runtime.engine import Engine
from ssd_jax.algorithm.near_tie import assert_greedy_agreement
from ssd_jax.runtime.proposer import PromptLookupProposer, Proposer
from ssd_jax.algorithm.sampling import SamplingParams

from _tiny import padded_model

IDS = 32
CFG = tiny_config("llama", vocab_size=IDS)  # the ids; the model carries padded rows past them
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7]]


@pytest.fixture(scope="module")
def target():
    return padded_model(CFG, 2, scale=1.0)


def test_prompt_lookup_proposer_is_exact_greedy(target):
    prop = PromptLookupProposer(IDS, row_vocab=target.cfg.vocab_size)
    assert isinstance(prop, Proposer)
    eng = Engine(target, proposer=prop, compilation_cache=False)
    ar = Engine(target, compilation_cache=False).generate(PROMPTS, mode="ar", max_new_tokens=20)
    out = eng.generate(PROMPTS, mode="sd", max_new_tokens=20, k=3)
    for p, g, w in zip(PROMPTS, out.token_ids, ar.token_ids):
        assert_greedy_agreement(target.params, target.cfg, p, g, w, vocab_size=IDS)
    assert sum(out.metrics.accept_hist) > 0
    # sampling works too (one-hot rows: accepted with probability p(s))
    s = eng.generate(PROMPTS, mode="sd", max_new_tokens=10, k=3,
                     sampling=SamplingParams(temperature=1.0))
    assert all(len(t) == 10 for t in s.token_ids)


def test_proposer_errors(target):
    with pytest.raises(ValueError, match="start, propose and finish"):
        Engine(target, proposer=object(), compilation_cache=False)
    eng = Engine(target, proposer=PromptLookupProposer(IDS, row_vocab=target.cfg.vocab_size),
                 compilation_cache=False)
    with pytest.raises(ValueError, match="serves mode 'sd'"):
        eng.generate(PROMPTS, mode="ssd")
    bad = Engine(target, proposer=PromptLookupProposer(IDS),  # rows of the ids only
                 compilation_cache=False)
    with pytest.raises(ValueError, match="rows of shape"):
        bad.generate(PROMPTS, mode="sd", k=2)


class _Recording(PromptLookupProposer):
    """Prompt lookup that logs the engine's calls and makes its 'prefill' take a known time."""

    def __init__(self, *a, delay: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.calls, self.delay = [], delay

    def start(self, *a):
        self.calls.append("start")

    def ready(self):
        import time
        time.sleep(self.delay)
        self.calls.append("ready")

    def propose(self, state, run):
        self.calls.append("propose")
        return super().propose(state, run)


def test_proposer_ready_is_billed_to_prefill(target):
    """The draft's prefill ends inside the prefill phase, not in the first round's drafting."""
    prop = _Recording(IDS, target.cfg.vocab_size, delay=0.5)
    eng = Engine(target, proposer=prop, compilation_cache=False)
    eng.generate(PROMPTS, mode="sd", max_new_tokens=6, k=2)  # compile
    prop.calls.clear()
    out = eng.generate(PROMPTS, mode="sd", max_new_tokens=6, k=2)
    assert prop.calls[:3] == ["start", "ready", "propose"]
    assert prop.calls.count("ready") == 1
    assert out.metrics.prefill_s >= 0.5
    assert out.metrics.draft_s < out.metrics.prefill_s


def test_proposer_without_ready_still_runs(target):
    class NoReady:
        def __init__(self):
            self.inner = PromptLookupProposer(IDS, row_vocab=target.cfg.vocab_size)

        def start(self, *a):
            self.inner.start(*a)

        def propose(self, state, run):
            return self.inner.propose(state, run)

        def finish(self):
            self.inner.finish()

    out = Engine(target, proposer=NoReady(), compilation_cache=False).generate(
        PROMPTS, mode="sd", max_new_tokens=6, k=2)
    assert all(len(t) == 6 for t in out.token_ids)


class _Histories(PromptLookupProposer):
    """Prompt lookup that keeps, per call to propose, each active row's history as the engine
    handed it (`[B, H]` by position, up to the row's bonus at n)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen, self.kinds = [], set()

    def propose(self, state, run):
        active, n = np.asarray(state.active), np.asarray(state.n)
        self.kinds.add(type(state.history).__name__)
        hist = np.asarray(state.history)
        rows = [hist[b, :n[b] + 1].tolist() for b in range(len(n))]
        self.seen.append([r if a else None for r, a in zip(rows, active)])
        return super().propose(state, run)


def test_a_proposer_sees_each_rows_committed_tokens(target):
    """The round loop keeps the rows' history on the device (the prompt block, then each round's
    committed tokens from its report): every call of prompt lookup gets each active row's prompt
    and committed tokens up to its bonus, one round's tokens more each call; sampled, with rows
    ending at an EOS and on their budget, prompts of different lengths."""
    prompts = PROMPTS + [[9, 4, 9, 4, 9]]
    kw = dict(mode="sd", max_new_tokens=14, k=3, sampling=SamplingParams(temperature=0.8),
              seed=3)
    free = Engine(target, proposer=PromptLookupProposer(IDS, row_vocab=target.cfg.vocab_size),
                  compilation_cache=False).generate(prompts, **kw)
    kw["eos_ids"] = [free.token_ids[0][4]]  # ends row 0 mid-call, maybe others
    prop = _Histories(IDS, row_vocab=target.cfg.vocab_size)
    out = Engine(target, proposer=prop, compilation_cache=False).generate(prompts, **kw)
    assert "eos" in out.finish_reasons and "length" in out.finish_reasons
    assert prop.kinds == {type(jax.numpy.zeros(1)).__name__} and len(prop.seen) > 2
    full = [p + t for p, t in zip(prompts, out.token_ids)]
    # the first proposal follows the prefill: each prompt and its first token
    assert prop.seen[0] == [f[:len(p) + 1] for f, p in zip(full, prompts)]
    last = [len(p) + 1 for p in prompts]
    for seen in prop.seen[1:]:
        for b, got in enumerate(seen):
            if got is None:
                continue
            assert got == full[b][:len(got)], (b, got, full[b])  # the committed tokens
            assert last[b] < len(got) <= last[b] + kw["k"] + 1  # one round's (accepted + bonus)
            last[b] = len(got)
    # each row's history reached its last round's tokens: all it emitted, or all but the round
    # that ended it (the speculation after a row's last round is never drafted for it)
    assert all(len(f) - (kw["k"] + 1) <= n <= len(f) for f, n in zip(full, last)), (last, full)
