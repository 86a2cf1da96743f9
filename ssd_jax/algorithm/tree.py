"""`draft_tree`: glue pass, fork and K-step tree decode (ALGORITHM.md §2, step 2) as one jitted function.

It needs only what the draft already has (the speculation in flight), so it is dispatched on the
draft mesh right after `verify` is dispatched on the target mesh, and runs while the target verifies.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.models import arguments as args
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.ops import XLA, Ops
from ssd_jax.models.params import Params
from ssd_jax.models.protocol import forward, init_branch, tree_step, with_lengths
from ssd_jax.algorithm import sampling as smp
from ssd_jax.algorithm.aot import stored_jit
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


TREE_LOOPS = ("unroll", "scan")


def _check_tree_args(cfg, bonus, spec, n, active, from_backup, request_ids, vocab_size,
                     fanout_hit, fanout_backup, saguaro_top_n, row_dtype, tree_loop):
    fn = "draft_tree"
    if tree_loop not in TREE_LOOPS:
        raise ValueError(f"{fn}: tree_loop must be one of {TREE_LOOPS}, got {tree_loop!r}")
    B, K = args.shape(fn, "spec", spec, 2, "[B, K]")
    if K < 1:
        raise ValueError(f"{fn}: spec must be [B, K] with K >= 1 drafted tokens, got {[B, K]}")
    args.integer(fn, "spec", spec)
    for name, x, kind in (("bonus", bonus, "int"), ("n", n, "int"), ("request_ids", request_ids, "int"),
                          ("active", active, "bool"), ("from_backup", from_backup, "bool")):
        args.same(fn, name, jnp.shape(x), (B,), "[B] (spec's batch)")
        if kind == "int":
            args.integer(fn, name, x)
        elif jnp.result_type(x) != jnp.bool_:
            raise ValueError(f"{fn}: {name} must be bool [B], got dtype {jnp.result_type(x)}")
    for name, f in (("fanout_hit", fanout_hit), ("fanout_backup", fanout_backup)):
        if len(f) != K + 1 or any(int(x) != x or x < 0 for x in f):
            raise ValueError(f"{fn}: {name} must be F_0..F_K, K+1 = {K + 1} non-negative "
                             f"integers, got {tuple(f)}")
    if sum(fanout_hit) != sum(fanout_backup) or sum(fanout_hit) == 0:
        raise ValueError(f"{fn}: fanout_hit {tuple(fanout_hit)} and fanout_backup "
                         f"{tuple(fanout_backup)} must have one positive sum (the branches MQ)")
    if len(saguaro_top_n) not in (0, K):
        raise ValueError(f"{fn}: saguaro_top_n must have K = {K} entries or none, got "
                         f"{tuple(saguaro_top_n)}")
    rows = getattr(cfg, "vocab_size", None)
    if not 1 <= int(vocab_size) <= (rows or int(vocab_size)):
        raise ValueError(f"{fn}: vocab_size must be in [1, {rows}] (the draft's rows), got "
                         f"{vocab_size}")
    if not jnp.issubdtype(jnp.dtype(row_dtype), jnp.floating):
        raise ValueError(f"{fn}: row_dtype must be floating point, got {row_dtype!r}")
    return B, K


def _decode_unrolled(step, K: int, tok, branch, saguaro_top_n, implicit: bool, row_dtype):
    """The K branch steps traced one after another -> (tokens `[B, MQ, K]`, rows `[B, MQ, K, V]`,
    or `[B, MQ, K, 0]` where the rows are `implicit` one-hot rows: the steps' rows go unused)."""
    toks, rows = [], []
    for d in range(K):
        # d a Python int: the first step starts the branch buffers (`tree_step`)
        tok, r, branch = step(tok, branch, d, saguaro_top_n[d] if saguaro_top_n else 0)
        toks.append(tok)
        rows.append(r)
    toks = jnp.stack(toks, 2)
    if implicit:
        return toks, jnp.zeros(toks.shape + (0,), row_dtype)
    return toks, jnp.stack(rows, 2)


def _decode_scan(step, K: int, tok, branch, saguaro_top_n, V: int, row_dtype):
    """Branch step 0 traced on its own, steps 1..K-1 as one `lax.scan` body, tokens and rows
    written in place into `[B, MQ, K]` / `[B, MQ, K, V]` buffers. Step 0 keeps its Python 0 so that
    `tree_step` starts the branch buffers from its new KV, as the unrolled form does; a traced 0
    would make every step zero the buffers past slot 0 again. Saguaro's top-n per depth is the one
    static per-step value: equal at every depth (the common case) it stays a Python int, else it
    is indexed by d."""
    B, MQ = tok.shape
    same = len(set(saguaro_top_n)) <= 1
    top = (saguaro_top_n[0] if saguaro_top_n else 0) if same else jnp.asarray(saguaro_top_n, jnp.int32)
    tok, r, branch = step(tok, branch, 0, saguaro_top_n[0] if saguaro_top_n else 0)
    toks = jnp.zeros((B, MQ, K), jnp.int32).at[:, :, 0].set(tok)
    rows = jnp.zeros((B, MQ, K, V), row_dtype)
    if V:  # V = 0: implicit one-hot rows (`_decode_unrolled`)
        rows = rows.at[:, :, 0].set(r.astype(row_dtype))

    def body(carry, d):
        tok, branch, toks, rows = carry
        tok, r, branch = step(tok, branch, d, top if same else top[d])
        toks = jax.lax.dynamic_update_index_in_dim(toks, tok, d, axis=2)
        if V:
            rows = jax.lax.dynamic_update_index_in_dim(rows, r, d, axis=2)
        return (tok, branch, toks, rows), None

    (_, _, toks, rows), _ = jax.lax.scan(body, (tok, branch, toks, rows),
                                         jnp.arange(1, K, dtype=jnp.int32))
    return toks, rows


@stored_jit(static_argnames=("cfg", "vocab_size", "fanout_hit", "fanout_backup",
                             "saguaro_top_n", "row_dtype", "ops", "tree_loop"),
            donate_argnames=("cache",))
def draft_tree(params: Params, cfg: ModelConfig, cache: KVCache, bonus: jax.Array, spec: jax.Array,
               n: jax.Array, active: jax.Array, from_backup: jax.Array, seed: jax.Array,
               request_ids: jax.Array, sampling: smp.SamplingParams, vocab_size: int,
               fanout_hit: tuple[int, ...], fanout_backup: tuple[int, ...],
               saguaro_top_n: tuple[int, ...] = (), saguaro_c: float | jax.Array = 1.0,
               row_dtype: str = "float32", ops: Ops = XLA, tree_loop: str = "unroll"):
    """bonus `[B]` at position n `[B]`, speculation in flight spec `[B, K]` -> (SpeculationCache,
    cache): the speculation cache for the next round (docs/ALGORITHM.md §2, step 2).

    Rows whose speculation came from a backup (from_backup `[B]` bool) fork with `fanout_backup`,
    the others with `fanout_hit` (equal sums, so MQ is static). Branch (j, c): token c at position
    n+j+1, its d-th drafted token at n+j+1+d, drawn with key (request, position, STREAM_DRAFT) —
    the same draw a direct draft from outcome (j, c) makes, so a hit equals a direct draft. The glue
    pass leaves KV for positions n..n+K in the cache (lengths n+K+1; `cache` is donated). Rows with
    active `[B]` False get valid = False branches. seed: scalar int or key; request_ids `[B]`.
    The result's keys are `[B, MQ, 2]`, tokens `[B, MQ, K]`, rows `[B, MQ, K, V]` in `row_dtype`
    (a greedy draft: `[B, MQ, K, 0]`, the one-hot rows implicit in the tokens,
    `SpeculationCache.one_hot_vocab` = V; `lookup` gives the same rows either way).

    Traced, so new values compile nothing: `sampling` (the draft's SamplingParams, one value or
    `[B]`; only `sampling.greedy` is static) and `saguaro_c` (Saguaro's C, a scalar or `[B]`).
    Static arguments: `cfg` (the draft's ModelConfig, or its `ssd_jax.models.protocol`
    description: its own tree_step, or branches forwarded over copies of the cache),
    `vocab_size` (real rows of V), `fanout_hit` / `fanout_backup` (F_0..F_K, K+1 entries each), `saguaro_top_n` (Saguaro's top-n
    per depth d, K entries, or () for none), `row_dtype` (the cache rows' dtype name) and `ops`
    (the backend table, `ssd_jax.models.ops.Ops`, whose `tree_attention` the branch steps use)
    and `tree_loop`: "unroll" (the default) traces the K branch steps one after another, "scan"
    one step inside `lax.scan`: the same numbers bit for bit, a few times fewer ops to trace,
    compile and load, but on XLA:CPU a slower step (benchmarks/README.md at 8faea7c, "The tree as a scan").

    A `ValueError` naming the argument, before anything is traced: spec not integer `[B, K]`
    with K >= 1; bonus, n, request_ids (integers), active or from_backup (bools) not `[B]`; a
    fan-out without K+1 non-negative entries, the two fan-outs' sums unequal or zero; a
    saguaro_top_n of neither 0 nor K entries; vocab_size outside [1, the draft's rows]; an unknown
    tree_loop. These are checked as it traces; the ids' values are not read (the engine dispatches
    it while the target verifies: reading them would wait for the device).
    """
    B, K = _check_tree_args(cfg, bonus, spec, n, active, from_backup, request_ids, vocab_size,
                            fanout_hit, fanout_backup, saguaro_top_n, row_dtype, tree_loop)
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

    def step(tok, branch, d, top_n):
        """Branch step d: tokens `[B, MQ]` at positions n+j+1+d -> (the next tokens `[B, MQ]`,
        the rows they were drawn from `[B, MQ, V]`, the branch state)."""
        pos = n[:, None] + kj + 1 + d
        logits, branch = tree_step(params, cfg, tok, pos, cache, prefix_len, branch, d, valid,
                                   ops=ops)
        keys = smp.position_keys(seed, request_ids, pos + 1, smp.STREAM_DRAFT)
        tok, r = propose(logits, sampling, keys, vocab_size=vocab_size, saguaro_top_n=top_n,
                         saguaro_c=saguaro_c, row_dtype=jnp.dtype(row_dtype))
        return tok, r, branch

    # a greedy draft's rows are the one-hot rows at its tokens (`saguaro.propose`; Saguaro's
    # scaling multiplies the one nonzero entry by C and renormalises it to C / C = 1 exactly):
    # the rows are the tokens, kept implicit (`SpeculationCache`)
    implicit = sampling.greedy
    V = glue.shape[-1]
    if tree_loop == "scan":
        tokens, rows = _decode_scan(step, K, kc, branch, saguaro_top_n, 0 if implicit else V,
                                    jnp.dtype(row_dtype))
    else:
        tokens, rows = _decode_unrolled(step, K, kc, branch, saguaro_top_n, implicit,
                                        jnp.dtype(row_dtype))
    spec_cache = SpeculationCache(keys=jnp.stack([kj, kc], -1), tokens=tokens, rows=rows,
                                  valid=valid, one_hot_vocab=V if implicit else 0)
    return spec_cache, cache
