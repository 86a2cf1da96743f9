"""A user-supplied proposer plugs into SD: prompt lookup (one-hot rows) stays exact, and runs on
the device loop with the rows' history kept on the device."""
import contextlib

import jax
import numpy as np
import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.runtime.engine import Engine
from ssd_jax.algorithm.near_tie import assert_greedy_agreement
from ssd_jax.runtime.proposer import PromptLookupProposer, Proposer
from ssd_jax.algorithm.sampling import SamplingParams

from _host_loop import on_host_loop
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
    handed it (a list per row on the host loop, `[B, H]` by position on the device loop)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen, self.kinds = [], set()

    def propose(self, state, run):
        active, n = np.asarray(state.active), np.asarray(state.n)
        on_host = isinstance(state.history, list)
        self.kinds.add("lists" if on_host else type(state.history).__name__)
        if on_host:
            rows = [list(h) for h in state.history]
        else:
            hist = np.asarray(state.history)
            rows = [hist[b, :n[b] + 1].tolist() for b in range(len(n))]
        self.seen.append([r if a else None for r, a in zip(rows, active)])
        return super().propose(state, run)


def test_a_proposer_on_the_device_loop_sees_the_host_loops_history(target):
    """The device loop keeps the rows' history on the device (the prompt block, then each
    round's committed tokens from its report): prompt lookup there gets each active row's
    tokens as the host loop's lists hold them, round for round, and so drafts and emits the same
    tokens; sampled, with rows ending at an EOS and on their budget, prompts of different
    lengths."""
    prompts = PROMPTS + [[9, 4, 9, 4, 9]]
    kw = dict(mode="sd", max_new_tokens=14, k=3, sampling=SamplingParams(temperature=0.8),
              seed=3)
    free = Engine(target, proposer=PromptLookupProposer(IDS, row_vocab=target.cfg.vocab_size),
                  compilation_cache=False).generate(prompts, **kw)
    kw["eos_ids"] = [free.token_ids[0][4]]  # ends row 0 mid-call, maybe others
    outs, props = [], []
    for host in (True, False):
        prop = _Histories(IDS, row_vocab=target.cfg.vocab_size)
        eng = Engine(target, proposer=prop, compilation_cache=False)
        with on_host_loop() if host else contextlib.nullcontext():
            outs.append(eng.generate(prompts, **kw))
        props.append(prop)
    host, device = outs
    assert device.token_ids == host.token_ids and device.finish_reasons == host.finish_reasons
    assert device.metrics.accept_hist == host.metrics.accept_hist
    assert "eos" in host.finish_reasons and "length" in host.finish_reasons
    assert props[0].kinds == {"lists"} and props[1].kinds == {type(jax.numpy.zeros(1)).__name__}
    # the device loop may draft once more (the speculation after the last round)
    assert len(props[1].seen) >= len(props[0].seen) > 2
    for want, got in zip(props[0].seen, props[1].seen):
        assert got == want
