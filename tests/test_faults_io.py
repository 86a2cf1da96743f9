"""Fault injection for the I/O and bookkeeping faults of issue 22 (item 4): a write past a KV
cache's end, a corrupt or half-written conversion cache, a fetch cut off mid-download, a disk that
fills up during conversion, and bad arguments. Tiny models and fake files only; never the network
or the real weights in ~/.cache/ssd_jax."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import kv_cache
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import CacheOverflowError, checked, init_cache
from ssd_jax.models.params import random_params
from ssd_jax.models.transformer import forward, init_branch_kv, tree_step

CFG = dataclasses.replace(tiny_config("llama"), num_layers=1)
S = 8  # cache slots in the overflow tests


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 0)


_fwd = jax.jit(forward, static_argnames=("cfg", "window", "last_only", "ops"))


# ---------------------------------------------------------------------------- (a) KV cache overflow


def test_more_tokens_than_slots_is_an_error_at_trace_time(params):
    toks = jnp.ones((2, S + 1), jnp.int32)
    with pytest.raises(CacheOverflowError, match=f"9 tokens per sequence do not fit .* S = {S}"):
        _fwd.lower(params, CFG, toks, init_cache(CFG, 2, S))  # tracing alone raises
    with pytest.raises(ValueError, match="batch >= 1 and max_len >= 1"):
        init_cache(CFG, 2, 0)


def test_an_eager_write_past_the_end_is_an_error(params):
    _, cache = forward(params, CFG, jnp.ones((2, 5), jnp.int32), init_cache(CFG, 2, S))
    with pytest.raises(CacheOverflowError, match=r"S = 8 slots.*row 0 at length 5 writing 5"):
        forward(params, CFG, jnp.ones((2, 5), jnp.int32), cache)
    # padding past the end is allowed (documented as dropped): only num_new must fit
    _, out = forward(params, CFG, jnp.ones((2, 5), jnp.int32), cache, jnp.asarray([3, 1]))
    np.testing.assert_array_equal(out.lengths, [8, 6])
    with pytest.raises(CacheOverflowError, match=r"row 1 at length 5 writing 4"):
        forward(params, CFG, jnp.ones((2, 5), jnp.int32), cache, jnp.asarray([3, 4]))
    with pytest.raises(CacheOverflowError, match="with_lengths"):
        cache.with_lengths(np.asarray([S, S + 1]))
    assert int(cache.with_lengths(np.asarray([S, 0])).lengths[0]) == S  # full is fine
    with pytest.raises(CacheOverflowError, match="with_lengths"):
        cache.with_lengths(np.asarray([-1, 0]))


def test_checked_mode_catches_a_traced_overflow(params):
    cache = _fwd(params, CFG, jnp.ones((2, 5), jnp.int32), init_cache(CFG, 2, S))[1]
    toks = jnp.ones((2, 5), jnp.int32)
    # the fast path does not check (that is what `checked` is for) ...
    assert int(_fwd(params, CFG, toks, cache)[1].lengths[0]) == 10
    # ... the checked one raises, naming the lengths and S
    fwd = checked(_fwd)
    with pytest.raises(CacheOverflowError, match=r"forward: .*lengths \[5 5\] \+ written 5 exceed S = 8"):
        fwd(params, CFG, toks, cache)
    # within capacity it returns exactly what the unchecked call returns
    small = jnp.ones((2, 3), jnp.int32)
    want, wc = _fwd(params, CFG, small, cache)
    got, gc = fwd(params, CFG, small, cache)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gc.lengths, wc.lengths)
    # per-row counts: row 1 overflows by one
    with pytest.raises(CacheOverflowError, match="exceed S = 8"):
        fwd(params, CFG, toks, cache, jnp.asarray([3, 4], jnp.int32))


def _instructions(compiled_text: str) -> list[str]:
    out = []
    for ln in compiled_text.splitlines():
        if " = " in ln and "(" in ln:
            ln = re.sub(r", metadata=\{[^}]*\}", "", ln)
            out.append(re.sub(r"\.\d+", "", ln.strip()))
    return sorted(out)


def test_the_debug_check_costs_nothing_on_the_fast_path(params, monkeypatch):
    toks, cache = jnp.ones((2, 3), jnp.int32), init_cache(CFG, 2, S)

    def hlo():
        f = jax.jit(lambda p, t, c: forward(p, CFG, t, c))
        return _instructions(f.lower(params, toks, cache).compile().as_text())

    with_check = hlo()
    monkeypatch.setattr(kv_cache.checkify, "debug_check", lambda *a, **k: None)
    assert hlo() == with_check


def test_tree_step_refuses_a_branch_slot_past_its_depth(params):
    B, MQ, K = 1, 2, 3
    cache = forward(params, CFG, jnp.ones((B, 4), jnp.int32), init_cache(CFG, B, S))[1]
    args = (jnp.ones((B, MQ), jnp.int32), jnp.full((B, MQ), 4), cache, jnp.full((B, MQ), 4),
            init_branch_kv(CFG, B, MQ, K))
    valid = jnp.ones((B, MQ), bool)
    tree_step(params, CFG, *args, jnp.int32(K - 1), valid)  # the last slot is fine
    with pytest.raises(CacheOverflowError, match="branch KV slot"):
        tree_step(params, CFG, *args, jnp.int32(K), valid)  # eager: at once
    step = jax.jit(tree_step, static_argnames=("cfg", "window", "ops"))
    with pytest.raises(CacheOverflowError, match=r"branch KV slot .*exceed S = 3"):
        checked(step)(params, CFG, *args, jnp.int32(K), valid)
    over = (*args[:3], jnp.full((B, MQ), S + 1), args[4])
    with pytest.raises(CacheOverflowError, match="prefix_len"):
        checked(step)(params, CFG, *over, jnp.int32(0), valid)
    checked(step)(params, CFG, *over, jnp.int32(0), jnp.zeros((B, MQ), bool))  # invalid: unread
