"""Shared by tests that swap the draft for a cheaper one (int8 weights, a cut head): greedy SD and
SSD must emit the target's own tokens (near-tie rule, ssd_jax.algorithm.near_tie)."""
from ssd_jax.runtime.engine import Engine
from ssd_jax.algorithm.near_tie import assert_greedy_agreement


def assert_sd_and_ssd_match_ar(target, draft, prompts, max_new_tokens: int, k: int = 3):
    """Returns {mode: accept_hist} of the SD and SSD runs, and the AR tokens."""
    want = Engine(target, None, compilation_cache=False).generate(
        prompts, mode="ar", max_new_tokens=max_new_tokens).token_ids
    eng = Engine(target, draft, compilation_cache=False)
    hists = {}
    for mode in ("sd", "ssd"):
        out = eng.generate(prompts, mode=mode, max_new_tokens=max_new_tokens, k=k)
        for p, g, w in zip(prompts, out.token_ids, want):
            assert_greedy_agreement(target.params, target.cfg, p, g, w)
        hists[mode] = out.metrics.accept_hist
    return hists, want
