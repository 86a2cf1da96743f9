"""The model protocol: what the engine needs of a target or a draft, and the calls it makes.

A model is three things, gemma / jax-llm-examples style:

- a hashable **static description** `cfg` (a static `jax.jit` argument: one compile per shape),
- a **params** pytree (traced), and
- a **cache** pytree the model makes and the steps thread through (donated).

`ssd_jax.models.model.Model(cfg, params, tokenizer)` holds them. `cfg` is either the built-in
transformer's `ModelConfig` (its forward is `models/transformer.py` over the backend table,
`ssd_jax.models.ops.Ops`) or any hashable object with these members (`ssd_jax.models.adapters`
makes one from a Flax NNX module or from plain functions):

    vocab_size: int                    V, the width of the logits rows (token ids 0..V-1)
    max_position_embeddings: int       the longest sequence it serves (optional; default 2**30)
    init_cache(batch, max_len) -> cache
        an empty cache pytree for `batch` sequences of up to `max_len` tokens. Every leaf leads
        with the batch axis [B, ...]; it holds `lengths` [B] int32 (all 0), the committed tokens
        of each sequence: a dict entry cache["lengths"] or a field cache.lengths (a
        flax.struct.dataclass: the engine sets it with `.replace`, or a `with_lengths` method).
    forward(params, tokens [B, T] int32, cache) -> (logits [B, T, V] float, cache)
        causal: token t of row b sits at position lengths[b] + t, writes its KV at that slot
        and attends to the slots 0..lengths[b] + t (nothing past its own position: slots past a
        row's length hold stale KV of rejected tokens, never cleared), then lengths += T.
        Writes past the cache's end must be dropped (`x.at[slot].set(v, mode="drop")`): they
        happen only for padding. This one call serves prefill (a right-padded prompt),
        decode (T = 1), verify (T = K+1) and the draft's catch-up and glue passes.
    init_branch(batch, branches, depth) -> branch        (optional, with tree_step)
    tree_step(params, tokens [B, MQ], positions [B, MQ], cache, prefix_len [B, MQ], branch,
              step, valid [B, MQ]) -> (logits [B, MQ, V], branch)              (optional)
        one step of SSD's branch decode (docs/ALGORITHM.md §2): branch m of row b is one query
        at `positions[b, m]` that sees cache slots 0..prefix_len[b, m]-1 (read, never written)
        and its own earlier branch tokens (slots 0..step of `branch`, the one it writes at
        `step`, a traced int32 scalar); `valid` False branches may return anything.

Without `tree_step`, SSD's draft uses `branch_from_forward`: every branch gets its own copy of
the row's cache (lengths = prefix_len) and steps with `forward`. It is exact (the same logits as
a branch step, up to float rounding) but costs MQ copies of the cache in memory and traffic, so
it suits research-sized drafts; a model with a large cache should bring its own `tree_step`.

The functions below are what the algorithm's steps call. For a `ModelConfig` each is the
built-in call as before (the same trace, so the same compiled code and speed); for any other
`cfg` they call its members and fix up the lengths.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import init_cache as _kv_init_cache
from ssd_jax.models.ops import XLA, Ops
from ssd_jax.models import transformer

DEFAULT_MAX_POSITIONS = 1 << 30
REQUIRED = ("vocab_size", "init_cache", "forward")


def is_builtin(cfg) -> bool:
    """True for the built-in transformer's `ModelConfig`, False for a model of one's own."""
    return isinstance(cfg, ModelConfig)


def missing_members(cfg) -> list[str]:
    """The protocol members `cfg` lacks (empty when it is a usable static description): the
    required `vocab_size`, `init_cache`, `forward`, `init_branch` when it has `tree_step`, and
    hashability (it is a static jit argument)."""
    if is_builtin(cfg):
        return []
    out = [name for name in REQUIRED if getattr(cfg, name, None) is None]
    if getattr(cfg, "tree_step", None) is not None and getattr(cfg, "init_branch", None) is None:
        out.append("init_branch (tree_step needs it)")
    try:
        hash(cfg)
    except TypeError:
        out.append("__hash__ (a static jit argument: make it a frozen dataclass)")
    return out


def lengths(cache) -> jax.Array:
    """The cache's committed lengths [B] int32 (`cache.lengths` or `cache["lengths"]`)."""
    return cache["lengths"] if isinstance(cache, dict) else cache.lengths


def with_lengths(cache, new: jax.Array):
    """The same cache with lengths [B] `new` (rollback / commit: no KV moves)."""
    if hasattr(cache, "with_lengths"):
        return cache.with_lengths(new)
    new = jnp.asarray(new, jnp.int32)
    if isinstance(cache, dict):
        return {**cache, "lengths": new}
    return cache.replace(lengths=new)


def init_cache(cfg, batch: int, max_len: int, sharding=None):
    """An empty cache for `batch` sequences of `max_len` slots (lengths 0), every leaf placed
    with `sharding` when given."""
    if is_builtin(cfg):
        return _kv_init_cache(cfg, batch, max_len, sharding=sharding)
    cache = cfg.init_cache(int(batch), int(max_len))
    # the steps donate the cache, so no two leaves may share a buffer (`[zeros] * layers` does):
    # every leaf gets its own (once per generate call, for models of one's own only)
    return jax.device_put(cache, sharding, may_alias=False)


def forward(params, cfg, tokens: jax.Array, cache, num_new: jax.Array | None = None, *,
            window: int | None = None, last_only: bool = False, ops: Ops = XLA):
    """`transformer.forward`'s call for any model: tokens [B, T] at positions lengths + t ->
    (logits [B, T, V] float32, or [B, V] at each row's last real token with `last_only`; the
    cache with lengths += num_new [B] (default T)). Static: cfg, window, last_only, ops (the
    built-in transformer's op table; a model of one's own brings its own ops)."""
    if is_builtin(cfg):
        return transformer.forward(params, cfg, tokens, cache, num_new, window=window,
                                   last_only=last_only, ops=ops)
    B, T = tokens.shape
    n = lengths(cache)
    logits, cache = cfg.forward(params, tokens, cache)
    if logits.shape != (B, T, cfg.vocab_size):
        raise ValueError(f"the model's forward returned logits of shape {tuple(logits.shape)} "
                         f"for tokens [B, T] = [{B}, {T}]; the protocol needs [B, T, V] with "
                         f"V = vocab_size = {cfg.vocab_size} (ssd_jax.models.protocol)")
    logits = logits.astype(jnp.float32)
    count = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    cache = with_lengths(cache, n + count)
    if last_only:
        logits = jnp.take_along_axis(logits, jnp.maximum(count - 1, 0)[:, None, None], 1)[:, 0]
    return logits, cache


def select_rows(rows: jax.Array, new, old):
    """Per row b of the batch: the cache `new` where rows[b], else `old` (pytrees of [B, ...])."""
    return jax.tree_util.tree_map(
        lambda a, b: jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


def init_branch(cfg, cache, batch: int, branches: int, depth: int, prefix_len: jax.Array):
    """Branch state for `branches` branches of `depth` steps per row: the transformer's
    `BranchKV`, the model's own `init_branch`, or (no tree_step) `branch_from_forward`'s copies of
    the cache with lengths prefix_len [B, MQ]."""
    if is_builtin(cfg):
        return transformer.init_branch_kv(cfg, batch, branches, depth)
    if getattr(cfg, "tree_step", None) is not None:
        return cfg.init_branch(batch, branches, depth)
    copies = jax.tree_util.tree_map(lambda x: jnp.repeat(x, branches, axis=0), cache)
    return with_lengths(copies, prefix_len.reshape(batch * branches))


def tree_step(params, cfg, tokens: jax.Array, positions: jax.Array, cache, prefix_len: jax.Array,
              branch, step: jax.Array, valid: jax.Array, *, window: int | None = None,
              ops: Ops = XLA):
    """`transformer.tree_step`'s call for any model: one draft step of every branch, tokens,
    positions, prefix_len, valid [B, MQ] -> (logits [B, MQ, V] float32, branch state)."""
    if is_builtin(cfg):
        return transformer.tree_step(params, cfg, tokens, positions, cache, prefix_len, branch,
                                     step, valid, window=window, ops=ops)
    if getattr(cfg, "tree_step", None) is not None:  # its step an array, as it always was
        logits, branch = cfg.tree_step(params, tokens, positions, cache, prefix_len, branch,
                                       jnp.asarray(step, jnp.int32), valid)
        return logits.astype(jnp.float32), branch
    return branch_from_forward(params, cfg, tokens, branch)


def branch_from_forward(params, cfg, tokens: jax.Array, copies):
    """The generic branch step: tokens [B, MQ] forwarded one per branch over `copies`, the
    branches' own caches ([B * MQ, ...] leaves, lengths = prefix_len + step, so each token lands
    at its position n + j + 1 + step and sees the row's prefix and its own path only). Returns
    (logits [B, MQ, V], copies)."""
    B, MQ = tokens.shape
    logits, copies = forward(params, cfg, tokens.reshape(B * MQ, 1), copies)
    return logits.reshape(B, MQ, -1), copies


__all__ = ["DEFAULT_MAX_POSITIONS", "branch_from_forward", "forward", "init_branch",
           "init_cache", "is_builtin", "lengths", "missing_members", "select_rows", "tree_step",
           "with_lengths"]
