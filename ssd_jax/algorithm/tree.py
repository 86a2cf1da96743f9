"""`draft_tree`: glue pass, fork and K-step tree decode (ALGORITHM.md §2, step 2) as one jitted function.

It needs only what the draft already has (the speculation in flight), so it is dispatched on the
draft mesh right after `verify` is dispatched on the target mesh, and runs while the target verifies.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.ops import XLA, Ops
from ssd_jax.models.params import Params
from ssd_jax.models.protocol import forward, init_branch, tree_step, with_lengths
from ssd_jax.algorithm import sampling as smp
from ssd_jax.algorithm.saguaro import propose
from ssd_jax.algorithm.small_topk import top_k_indices
from ssd_jax.algorithm.speculation_cache import SpeculationCache


def fork(glue_logits: jax.Array, spec: jax.Array, fanout: tuple[int, ...],
         vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """The fork (docs/ALGORITHM.md §2): the outcomes (j, c) to pre-draft, from the glue rows.

    glue_logits `[B, K+1, V]`: row j is the draft's next-token row after b, s_1..s_j; spec
    `[B, K]` int32 s_1..s_K. For j < K the drafted s_{j+1} is masked out (a rejected token is never
    the bonus), then the top F_j tokens are taken. Static: `fanout` (F_0..F_K, K+1 entries) and
    `vocab_size` (entries >= it are padded rows, never taken). Returns (j `[B, MQ]`, c `[B, MQ]`)
    int32 with MQ = sum(fanout), grouped by j in increasing order.
    """
    B, K1, V = glue_logits.shape
    K = K1 - 1
    if len(fanout) != K1:
        raise ValueError(f"fan-out needs K+1 = {K1} entries, got {fanout}")
    js, cs = [], []
    for j, f in enumerate(fanout):
        if f == 0:
            continue
        row = glue_logits[:, j]
        if vocab_size < V:
            row = jnp.where(jnp.arange(V) < vocab_size, row, -jnp.inf)
        if j < K:
            # per sequence (vmap: the batch stays a batching dim, nothing crosses DP shards)
            row = jax.vmap(lambda r, t: r.at[t].set(-jnp.inf))(row, spec[:, j])
        cs.append(top_k_indices(row, f))
        js.append(jnp.full((B, f), j, jnp.int32))
    return jnp.concatenate(js, 1), jnp.concatenate(cs, 1)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "vocab_size", "fanout_hit", "fanout_backup",
                     "saguaro_top_n", "row_dtype", "ops"),
    donate_argnames=("cache",))
def draft_tree(params: Params, cfg: ModelConfig, cache: KVCache, bonus: jax.Array, spec: jax.Array,
               n: jax.Array, active: jax.Array, from_backup: jax.Array, seed: jax.Array,
               request_ids: jax.Array, sampling: smp.SamplingParams, vocab_size: int,
               fanout_hit: tuple[int, ...], fanout_backup: tuple[int, ...],
               saguaro_top_n: tuple[int, ...] = (), saguaro_c: float | jax.Array = 1.0,
               row_dtype: str = "float32", ops: Ops = XLA):
    """bonus `[B]` at position n `[B]`, speculation in flight spec `[B, K]` -> (SpeculationCache,
    cache): the speculation cache for the next round (docs/ALGORITHM.md §2, step 2).

    Rows whose speculation came from a backup (from_backup `[B]` bool) fork with `fanout_backup`,
    the others with `fanout_hit` (equal sums, so MQ is static). Branch (j, c): token c at position
    n+j+1, its d-th drafted token at n+j+1+d, drawn with key (request, position, STREAM_DRAFT) —
    the same draw a direct draft from outcome (j, c) makes, so a hit equals a direct draft. The glue
    pass leaves KV for positions n..n+K in the cache (lengths n+K+1; `cache` is donated). Rows with
    active `[B]` False get valid = False branches. seed: scalar int or key; request_ids `[B]`.
    The result's keys are `[B, MQ, 2]`, tokens `[B, MQ, K]`, rows `[B, MQ, K, V]` in `row_dtype`.

    Traced, so new values compile nothing: `sampling` (the draft's SamplingParams, one value or
    `[B]`; only `sampling.greedy` is static) and `saguaro_c` (Saguaro's C, a scalar or `[B]`).
    Static arguments: `cfg` (the draft's ModelConfig, or its `ssd_jax.models.protocol`
    description: its own tree_step, or branches forwarded over copies of the cache),
    `vocab_size` (real rows of V), `fanout_hit` / `fanout_backup` (F_0..F_K, K+1 entries each), `saguaro_top_n` (Saguaro's top-n
    per depth d, K entries, or () for none), `row_dtype` (the cache rows' dtype name) and `ops`
    (the backend table, `ssd_jax.models.ops.Ops`, whose `tree_attention` the branch steps use).
    """
    B, K = spec.shape
    cache = with_lengths(cache, n)
    glue, cache = forward(params, cfg, jnp.concatenate([bonus[:, None], spec], 1), cache, ops=ops)
    j_hit, c_hit = fork(glue, spec, fanout_hit, vocab_size)
    if fanout_backup != fanout_hit:
        j_b, c_b = fork(glue, spec, fanout_backup, vocab_size)
        j_hit = jnp.where(from_backup[:, None], j_b, j_hit)
        c_hit = jnp.where(from_backup[:, None], c_b, c_hit)
    kj, kc = j_hit, c_hit
    MQ = kj.shape[1]
    valid = jnp.broadcast_to(active[:, None], (B, MQ))
    prefix_len = n[:, None] + kj + 1  # slots 0..n+j: prefix, b, s_1..s_j (never s_{j+1})
    branch = init_branch(cfg, cache, B, MQ, K, prefix_len)
    tok = kc
    toks, rows = [], []
    for d in range(K):
        pos = n[:, None] + kj + 1 + d
        logits, branch = tree_step(params, cfg, tok, pos, cache, prefix_len, branch,
                                   jnp.int32(d), valid, ops=ops)
        keys = smp.position_keys(seed, request_ids, pos + 1, smp.STREAM_DRAFT)
        top_n = saguaro_top_n[d] if saguaro_top_n else 0
        tok, r = propose(logits, sampling, keys, vocab_size=vocab_size, saguaro_top_n=top_n,
                         saguaro_c=saguaro_c, row_dtype=jnp.dtype(row_dtype))
        toks.append(tok)
        rows.append(r)
    spec_cache = SpeculationCache(keys=jnp.stack([kj, kc], -1), tokens=jnp.stack(toks, 2),
                                  rows=jnp.stack(rows, 2), valid=valid)
    return spec_cache, cache
