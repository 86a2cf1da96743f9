"""The jit-compiled steps of AR, SD and SSD, each a pure function of (params, cache, inputs).

Each step runs where its inputs live: target params and cache on the target mesh, draft ones on the
draft mesh; only token ids, outcome integers and proposal rows cross between them. Caches are
donated so XLA updates KV in place. Static arguments (model config, K, fan-out, the verifier
function, the op table `ops`) are hashable, so one compile serves every round. `ops` is a
`ssd_jax.models.ops.Ops` backend table (default the plain-XLA reference), passed to `forward`.
`cfg` is the model's static description: the built-in transformer's `ModelConfig`, or a model of
one's own (`ssd_jax.models.protocol`; params and cache then any pytrees that model defines).

Sampling is not static: `sampling` (a `SamplingParams` pytree, scalars or `[B]` per request) and
Saguaro's C are traced arguments, so a new temperature, top-k, top-p or C compiles nothing. What
does recompile: greedy vs sampled parameters (`SamplingParams.greedy`: a greedy step holds no
sampling op at all), a new shape (batch, bucket, K, fan-out, Saguaro's top-n per step), and the
other static arguments.

Positions and keys: a sequence with `n` committed tokens has its bonus token `b` at position `n`
(not yet in either KV cache). Every random draw is keyed by (request id, position of the token it
decides, stream) — see `ssd_jax.algorithm.sampling.position_keys`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.ops import XLA, Ops
from ssd_jax.models.params import Params
from ssd_jax.models.protocol import forward, is_builtin, lengths, select_rows, with_lengths
from ssd_jax.algorithm import sampling as smp
from ssd_jax.algorithm.aot import stored_jit
from ssd_jax.algorithm.saguaro import normalise_rows, propose


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits `[..., V]`, tokens `[...]` int32 -> `[...]` float32: the model's log-probability of
    each token under its raw logits (temperature 1, no top-k/top-p); -1 padding tokens get 0."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    got = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(tokens >= 0, got, 0.0)


@stored_jit(static_argnames=("cfg", "vocab_size", "ops"), donate_argnames=("cache",))
def prefill(params: Params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array, lens: jax.Array,
            seed: jax.Array, request_ids: jax.Array, sampling: smp.SamplingParams,
            vocab_size: int, ops: Ops = XLA):
    """Prompt tokens `[B, T]` (right-padded to a bucket), lens `[B]` -> the first generated token
    `[B]` (the first bonus, at position lens, keyed (request, lens, STREAM_SAMPLE)), its log-prob
    `[B]`, and the cache (donated) with lengths = lens.

    seed: scalar int or key; request_ids `[B]`; sampling: the user's SamplingParams (traced; one
    value or `[B]`). Static: `cfg` (the target's ModelConfig), `vocab_size` (real rows of V),
    `ops` (the op table).
    """
    cache = with_lengths(cache, jnp.zeros_like(lens))
    logits, cache = forward(params, cfg, tokens, cache, lens, last_only=True, ops=ops)
    keys = smp.position_keys(seed, request_ids, lens, smp.STREAM_SAMPLE)
    tok, _ = smp.sample(logits, sampling, keys, vocab_size)
    return tok, token_logprobs(logits, tok), cache


@stored_jit(static_argnames=("cfg", "ops"), donate_argnames=("cache",))
def prefill_cache(params: Params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
                  lens: jax.Array, ops: Ops = XLA) -> KVCache:
    """Draft-side prefill: tokens `[B, T]` (right-padded), lens `[B]` -> the cache (donated) holding
    KV for the prompt only, lengths = lens (the draft never picks the first token). Static: `cfg`,
    `ops` (the op table).
    """
    cache = with_lengths(cache, jnp.zeros_like(lens))
    _, cache = forward(params, cfg, tokens, cache, lens, last_only=True, ops=ops)
    return cache


def _one_row(cache):
    """(row 0 of a cache pytree whose leaves are `[B, ...]`: `[1, ...]`, B)."""
    return (jax.tree_util.tree_map(lambda x: x[:1], cache),
            jax.tree_util.tree_leaves(cache)[0].shape[0])


def _to_rows(tree, rows: int):
    """A pytree of `[1, ...]` leaves copied to `[rows, ...]`."""
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (rows,) + x.shape[1:]), tree)


@stored_jit(static_argnames=("cfg", "vocab_size", "ops"), donate_argnames=("cache",))
def prefill_shared(params: Params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
                   lens: jax.Array, seed: jax.Array, request_ids: jax.Array,
                   sampling: smp.SamplingParams, vocab_size: int, ops: Ops = XLA):
    """`prefill` for B rows that all hold one prompt (n samples of a prompt, pass@k): tokens
    `[1, T]`, lens `[1]`, request_ids `[B]`, cache `[B, ...]` (donated). The prompt is forwarded
    once; its KV and last logits are copied to the B rows, and each row draws its first token with
    its own key, as `prefill` does: the same tokens as `prefill` of the B rows, the KV and
    log-probs to float32 rounding (a forward over one row rounds its dots as a batch of one;
    tests/unit/test_shared_prefill.py). For the built-in transformer's cache (every leaf `[B, ...]`)."""
    one, rows = _one_row(cache)
    one = with_lengths(one, jnp.zeros_like(lens))
    logits, one = forward(params, cfg, tokens, one, lens, last_only=True, ops=ops)
    logits, lens = _to_rows(logits, rows), _to_rows(lens, rows)
    keys = smp.position_keys(seed, request_ids, lens, smp.STREAM_SAMPLE)
    tok, _ = smp.sample(logits, sampling, keys, vocab_size)
    return tok, token_logprobs(logits, tok), _to_rows(one, rows)


@stored_jit(static_argnames=("cfg", "ops"), donate_argnames=("cache",))
def prefill_cache_shared(params: Params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
                         lens: jax.Array, ops: Ops = XLA) -> KVCache:
    """`prefill_cache` for a cache whose B rows all hold one prompt: tokens `[1, T]`, lens `[1]`;
    the prompt's KV is computed once and copied to every row of the cache (donated)."""
    one, rows = _one_row(cache)
    one = with_lengths(one, jnp.zeros_like(lens))
    _, one = forward(params, cfg, tokens, one, lens, last_only=True, ops=ops)
    return _to_rows(one, rows)


@stored_jit(static_argnames=("cfg", "vocab_size", "ops"), donate_argnames=("cache",))
def decode(params: Params, cfg: ModelConfig, cache: KVCache, bonus: jax.Array, active: jax.Array,
           seed: jax.Array, request_ids: jax.Array, sampling: smp.SamplingParams, vocab_size: int,
           ops: Ops = XLA):
    """Plain decoding: forward the bonus `[B]` at position n = cache.lengths, sample position n+1.

    active `[B]` bool (inactive rows commit no KV: their length stays n), seed a scalar int or key,
    request_ids `[B]`, sampling the user's SamplingParams (traced). Returns (token `[B]` int32, its
    log-prob `[B]`, cache (donated) with lengths n+1 on active rows). Static: `cfg`, `vocab_size`
    (real rows of V), `ops` (the op table).
    """
    n = lengths(cache)
    logits, cache = forward(params, cfg, bonus[:, None], cache, active.astype(jnp.int32), ops=ops)
    keys = smp.position_keys(seed, request_ids, n + 1, smp.STREAM_SAMPLE)
    tok, _ = smp.sample(logits[:, 0], sampling, keys, vocab_size)
    return tok, token_logprobs(logits[:, 0], tok), cache


@stored_jit(static_argnames=("cfg", "vocab_size", "verifier", "ops"),
            donate_argnames=("cache",))
def verify(params: Params, cfg: ModelConfig, cache: KVCache, bonus: jax.Array, spec: jax.Array,
           rows: jax.Array, active: jax.Array, seed: jax.Array, request_ids: jax.Array,
           sampling: smp.SamplingParams, vocab_size: int, verifier: Callable, ops: Ops = XLA):
    """One target pass over [b, s_1..s_K] at positions n..n+K, then lossless rejection sampling.

    bonus `[B]` at position n = cache.lengths, spec `[B, K]` int32, rows `[B, K, V]` the proposal
    rows s_i was drawn from (any dtype; normalised here), active `[B]` bool, seed a scalar int or
    key, request_ids `[B]`. Returns (VerifyResult, log-probs `[B, K+1]` of its tokens (0 for -1
    padding), cache (donated) with lengths n + num_accepted + 1 on active rows, n on inactive ones).

    sampling: the user's SamplingParams (traced; one value or `[B]`). Static: `cfg` (the target's
    ModelConfig), `vocab_size` (real rows of V), `verifier`, a function with the signature of
    `ssd_jax.algorithm.verify.rejection_sample` (it, or a planted bug in the exactness tests), and `ops`
    (the op table).
    """
    n = lengths(cache)
    K = spec.shape[1]
    logits, cache = forward(params, cfg, jnp.concatenate([bonus[:, None], spec], 1), cache, ops=ops)
    p = smp.probs_from_logits(logits, sampling, vocab_size)
    q = normalise_rows(rows)
    ar = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    acc_keys = smp.position_keys(seed, request_ids, n[:, None] + 1 + ar[:, :K], smp.STREAM_ACCEPT)
    res_keys = smp.position_keys(seed, request_ids, n[:, None] + 1 + ar, smp.STREAM_RESIDUAL)
    res = verifier(p, q, spec, acc_keys, res_keys)
    lp = token_logprobs(logits, res.tokens)
    new_len = jnp.where(active, n + res.num_accepted + 1, n)
    return res, lp, with_lengths(cache, new_len)


@stored_jit(static_argnames=("cfg", "vocab_size", "k", "saguaro_top_n", "row_dtype", "ops"),
            donate_argnames=("cache",))
def draft_chain(params: Params, cfg: ModelConfig, cache: KVCache, prev: jax.Array, bonus: jax.Array,
                n: jax.Array, seed: jax.Array, request_ids: jax.Array, sampling: smp.SamplingParams,
                vocab_size: int, k: int, saguaro_top_n: tuple[int, ...] = (),
                saguaro_c: float | jax.Array = 1.0, row_dtype: str = "float32", ops: Ops = XLA,
                draft_rows: jax.Array | None = None):
    """SD drafting (and the neural backup): K sequential draft steps from bonus b at position n.

    The first forward covers [token at n-1, b] so a committed token the draft has no KV for (s_K
    after an all-accept round) is caught up in the same pass. Draft token i (position n+i) is keyed
    by (request, n+i, STREAM_DRAFT): the same draw a tree branch makes for that position.
    prev `[B]` (the token at n-1), bonus `[B]`, n `[B]`, seed a scalar int or key, request_ids
    `[B]`. Returns tokens `[B, K]` int32, rows `[B, K, V]` (row_dtype), cache (donated) with KV for
    positions n-1..n+K-1. draft_rows `[B]` bool (default all): the rows drafted; the others'
    cache is left exactly as it was (their writes land past the cache and are dropped, their
    lengths are kept) and their tokens and rows are meaningless. Why: a neural backup for the rows
    that missed must not rewrite the draft KV of the rows that hit, or a request's later draws
    could depend on its batch companions.

    Traced: `sampling` (the draft's SamplingParams, one value or `[B]`) and `saguaro_c` (Saguaro's
    C, a scalar or `[B]`). Static: `cfg` (the draft's ModelConfig), `vocab_size` (real rows of V),
    `k` (K), `saguaro_top_n` (Saguaro's top-n per draft step, K entries, or () for none),
    `row_dtype` (the rows' dtype name) and `ops` (the op table).
    """
    kept, old = lengths(cache), cache
    if draft_rows is None or not is_builtin(cfg):
        start = n - 1
    else:  # the undrafted rows write past the cache's end: dropped, nothing copied
        start = jnp.where(draft_rows, n - 1, cache.max_len)
    cache = with_lengths(cache, start)
    # last_only: the logits of `prev` are never used, and the vocab projection is a large share
    # of a small draft's forward
    last, cache = forward(params, cfg, jnp.stack([prev, bonus], 1), cache, last_only=True, ops=ops)
    toks, rows = [], []
    for i in range(k):
        keys = smp.position_keys(seed, request_ids, n + 1 + i, smp.STREAM_DRAFT)
        top_n = saguaro_top_n[i] if saguaro_top_n else 0
        t, r = propose(last, sampling, keys, vocab_size=vocab_size, saguaro_top_n=top_n,
                       saguaro_c=saguaro_c, row_dtype=jnp.dtype(row_dtype))
        toks.append(t)
        rows.append(r)
        if i < k - 1:
            logits, cache = forward(params, cfg, t[:, None], cache, ops=ops)
            last = logits[:, 0]
    if draft_rows is not None:
        if not is_builtin(cfg):  # a model of one's own: its cache rows selected, whatever its layout
            cache = select_rows(draft_rows, cache, old)
        cache = with_lengths(cache, jnp.where(draft_rows, lengths(cache), kept))
    return jnp.stack(toks, 1), jnp.stack(rows, 1), cache
