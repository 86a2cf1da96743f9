"""The decoder forward as pure functions of (params, cfg, tokens, cache, ops).

- `forward`: T new tokens per sequence appended at `cache.lengths` (prefill, one-token decode, a
  K+1-token verify at per-sequence offsets, a catch-up of the tokens the draft has no KV for).
- `tree_step`: one step of SSD's branch decode (docs/ALGORITHM.md §2): one query per branch at RoPE
  position `n+j+1+d`, seeing cache slots `0..n+j` and its own path, whose KV lives in a per-branch
  buffer so branches never write the shared cache.

Every matmul, KV write + attention, SwiGLU, residual add + norm and tree attention (with its
branch write) is a named op of `ops`
(`ssd_jax.models.ops.Ops`, default the plain-XLA reference): a backend swaps the table, never this
file. Layers are a Python loop over per-layer caches: a `lax.scan` with the cache as scanned state
copies the whole cache every step on XLA CPU. `window` (static) bounds attention to the first
`window` cache slots so short sequences do not pay for `max_len`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models import arguments as args
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import CacheOverflowError, KVCache, check_room
from ssd_jax.models.ops import XLA, Ops, rms_norm
from ssd_jax.models.params import LayerParams, Params


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The rows of `table` [V, E] at `tokens` [...] -> [..., E].

    The table passes an optimization barrier tied to the tokens. XLA:CPU gathers a bf16 table
    through an fp32 convert of the whole table; at top level that convert fuses into the gather,
    but in a loop body (`round_steps.decode_chunk` / `sd_chunk` / `ssd_chunk`, the scanned tree)
    loop-invariant code motion hoisted it out of the loop, so every chunk wrote the whole table
    again in fp32 (benchmarks/README.md at 8faea7c, "A chunk's loop rewrote the embedding in fp32"). Tied
    to the loop-varying tokens, the table is not invariant and nothing is hoisted; the barrier
    costs nothing at run time and the rows are the same.
    """
    table, tokens = jax.lax.optimization_barrier((table, tokens))
    return table[tokens]


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [..., N, D] at positions [...] (rotate-half convention of HF Llama/Qwen)."""
    inv = jnp.asarray(cfg.inv_freq())
    ang = positions[..., None].astype(jnp.float32) * inv  # [..., D/2]
    cos = jnp.cos(ang)[..., None, :].astype(x.dtype)
    sin = jnp.sin(ang)[..., None, :].astype(x.dtype)
    half = cfg.head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _qkv(lp: LayerParams, cfg: ModelConfig, ops: Ops, h: jax.Array, positions: jax.Array,
         g: int):
    """h [B, T, E] (the normed residual) -> q [B, T, H, D], k, v [B, T, KVH, D] (rotated). g: how
    many tensor-parallel groups the fused columns are laid out in (`Params.tp_groups`)."""
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = ops.dense(h, lp.wqkv)
    if lp.bqkv is not None:
        qkv = qkv + lp.bqkv
    lead = h.shape[:-1]
    if g == 1:
        q = qkv[..., : H * D].reshape(*lead, H, D)
        k = qkv[..., H * D: (H + KVH) * D].reshape(*lead, KVH, D)
        v = qkv[..., (H + KVH) * D:].reshape(*lead, KVH, D)
    else:  # columns [g, (H + 2 KVH) / g, D]: group s holds whole heads of q, k and v
        hg, kg = H // g, KVH // g
        qkv = qkv.reshape(*lead, g, hg + 2 * kg, D)
        q = qkv[..., :hg, :].reshape(*lead, H, D)
        k = qkv[..., hg: hg + kg, :].reshape(*lead, KVH, D)
        v = qkv[..., hg + kg:, :].reshape(*lead, KVH, D)
    if lp.q_norm is not None:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, positions, cfg), apply_rope(k, positions, cfg), v


def _mlp(lp: LayerParams, cfg: ModelConfig, ops: Ops, h: jax.Array, g: int) -> jax.Array:
    """h [..., E] (the normed residual) -> the MLP's output [..., E]."""
    gu = ops.dense(h, lp.w_gate_up)
    if g == 1:
        return ops.dense(ops.swiglu(gu), lp.w_down)
    # columns [g, 2, I / g]: group s holds gate and up columns of the same w_down rows
    gu = gu.reshape(*gu.shape[:-1], g, 2, cfg.intermediate_size // g)
    gate = gu[..., 0, :].reshape(*gu.shape[:-3], cfg.intermediate_size)
    up = gu[..., 1, :].reshape(*gu.shape[:-3], cfg.intermediate_size)
    return ops.dense(jax.nn.silu(gate) * up, lp.w_down)


def _logits(params: Params, cfg: ModelConfig, ops: Ops, x: jax.Array) -> jax.Array:
    """x [..., E] (normed by the final norm) -> fp32 logits [..., V]."""
    if params.lm_head is None:  # tied: the embedding [V, E] read transposed
        out = ops.dense(x, params.embed, transpose_w=True, preferred_element_type=jnp.float32)
    else:
        out = ops.dense(x, params.lm_head, preferred_element_type=jnp.float32)
    out = out.astype(jnp.float32)
    n = out.shape[-1]
    if n < cfg.vocab_size:  # a head cut to ids [0, n) (models/draft_head.py): the rest never win
        out = jnp.concatenate([out, jnp.full((*out.shape[:-1], cfg.vocab_size - n), -jnp.inf)], -1)
    return out


def _next_norm(params: Params, i: int) -> jax.Array:
    """The norm weight of what follows layer i: layer i+1's attention norm, or the final norm."""
    return params.layers[i + 1].attn_norm if i + 1 < len(params.layers) else params.final_norm


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache,
            num_new: jax.Array | None = None, *, window: int | None = None,
            last_only: bool = False, ops: Ops = XLA) -> tuple[jax.Array, KVCache]:
    """Append `tokens` [B, T] at positions `cache.lengths + t` and return their logits.

    params: the model's weights (logical, or laid out by `ops.prepare`); cfg: its static config;
    cache: a `KVCache` [B, S, KVH, D] per layer. num_new [B]: how many of the T tokens are real
    (right padding beyond it writes stale KV past the new length, which is masked and later
    overwritten). window (static): attend to the first `window` slots only. ops: the backend
    table (`ssd_jax.models.ops`; default the differentiable XLA reference). Returns logits
    [B, T, V] fp32 (or [B, V] at each row's last real token with `last_only`) and the cache with
    lengths += num_new. Pure: jit it with `static_argnames=("cfg", "window", "last_only", "ops")`.

    tokens must be integer ids in [0, cfg.vocab_size) (their values checked where known, as an
    eager call's are) and num_new integers in [0, T]: else a `ValueError` naming the argument.
    Writing real tokens past slot S-1 raises `CacheOverflowError` (`ssd_jax.models.kv_cache`):
    at trace time when T > S with every token real, at once for host lengths (an eager call),
    and under `kv_cache.checked` for traced ones (free otherwise). Padding past num_new may run
    past the end: it is dropped, as documented above.
    """
    fn = "forward"
    B, T = args.shape(fn, "tokens", tokens, 2, "[B, T]")
    args.integer(fn, "tokens", tokens)
    if T < 1:
        raise ValueError(f"{fn}: tokens must be [B, T] with T >= 1, got {[B, T]}")
    args.in_range(fn, "tokens", tokens, 0, cfg.vocab_size)
    if cache.lengths.shape != (B,):
        raise ValueError(f"forward: tokens are [B={B}, T={T}] but the cache holds "
                         f"{cache.lengths.shape} lengths, one per sequence expected")
    if num_new is None:
        if T > cache.max_len:
            raise CacheOverflowError(f"forward: {T} tokens per sequence do not fit a cache of "
                                     f"S = {cache.max_len} slots")
        check_room(cache.lengths, T, cache.max_len, "forward")
        num_new = jnp.full((B,), T, jnp.int32)
    else:
        if jnp.shape(num_new) != (B,):
            raise ValueError(f"forward: num_new must be [B={B}], got shape {jnp.shape(num_new)}")
        args.integer(fn, "num_new", num_new)
        args.in_range(fn, "num_new", num_new, 0, T + 1)
        check_room(cache.lengths, num_new, cache.max_len, "forward")
    W = cache.max_len if window is None else min(int(window), cache.max_len)
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x = embed(params.embed, tokens)
    h = rms_norm(x, params.layers[0].attn_norm, cfg.rms_norm_eps)
    new_k, new_v = [], []
    g = params.tp_groups
    for i, (lp, kc, vc) in enumerate(zip(params.layers, cache.k, cache.v)):
        q, k, v = _qkv(lp, cfg, ops, h, positions, g)
        att, kc, vc = ops.attend(q, k, v, positions, kc, vc, window=W)
        x, h = ops.add_norm(x, ops.dense(att, lp.wo), lp.mlp_norm, eps=cfg.rms_norm_eps)
        x, h = ops.add_norm(x, _mlp(lp, cfg, ops, h, g), _next_norm(params, i),
                            eps=cfg.rms_norm_eps)
        new_k.append(kc)
        new_v.append(vc)
    if last_only and T == 1:
        h = h[:, 0]
    elif last_only:  # the final norm of the rows kept only, as a prefill needs
        x = jnp.take_along_axis(x, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
        h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    logits = _logits(params, cfg, ops, h)
    return logits, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)


@struct.dataclass
class BranchKV:
    """Own-path KV of every branch of the speculation tree, per layer [B, MQ, K, KVH, D]."""
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_branch_kv(cfg: ModelConfig, batch: int, branches: int, depth: int) -> BranchKV:
    """Zero own-path KV for `branches` branches of `depth` tokens, [B, MQ, depth, KVH, D] per layer."""
    shape = (batch, branches, depth, cfg.num_kv_heads, cfg.head_dim)
    z = jnp.zeros(shape, cfg.dtype)
    return BranchKV(k=(z,) * cfg.num_layers, v=(z,) * cfg.num_layers)


def tree_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
              cache: KVCache, prefix_len: jax.Array, branch: BranchKV, step: jax.Array,
              valid: jax.Array, *, window: int | None = None,
              ops: Ops = XLA) -> tuple[jax.Array, BranchKV]:
    """One draft step for every branch of the speculation tree.

    tokens, positions, prefix_len [B, MQ]; cache: the draft's `KVCache` [B, S, KVH, D] per layer,
    read, never written; branch: `BranchKV` [B, MQ, K, KVH, D] per layer; step: int32 scalar
    (own-path slot written and the last one visible; the Python int 0 is the first step, whose
    branch KV comes back as new buffers, zero past slot 0, whatever `branch` held); valid
    [B, MQ]. Returns logits [B, MQ, V] fp32 and the branch KV with slot `step` filled. The write and the attention are
    `ops.tree_attention` (the plain-jnp reference, or the Pallas kernel of the `pallas` backend).

    tokens, positions, prefix_len and step must be integers, valid bool, tokens in
    [0, cfg.vocab_size) where known: else a `ValueError` naming the argument.
    A step outside [0, K) (its write would be clamped onto the last slot) or a valid branch's
    prefix_len past the cache's S raises `CacheOverflowError`: at once for host values, under
    `kv_cache.checked` for traced ones (free otherwise).
    """
    fn = "tree_step"
    B, MQ = args.shape(fn, "tokens", tokens, 2, "[B, MQ]")
    args.integer(fn, "tokens", tokens)
    args.integer(fn, "positions", positions)
    args.integer(fn, "prefix_len", prefix_len)
    args.integer(fn, "step", step)
    if jnp.ndim(step) != 0:
        raise ValueError(f"{fn}: step must be a scalar, got shape {jnp.shape(step)}")
    if jnp.shape(valid) != (B, MQ) or jnp.result_type(valid) != jnp.bool_:
        raise ValueError(f"{fn}: valid must be bool [B, MQ] = {[B, MQ]}, got "
                         f"{jnp.result_type(valid)} {list(jnp.shape(valid))}")
    args.in_range(fn, "tokens", tokens, 0, cfg.vocab_size)
    depth = branch.k[0].shape[2]
    if branch.k[0].shape[:2] != (B, MQ) or positions.shape != (B, MQ) or prefix_len.shape != (B, MQ):
        raise ValueError(f"tree_step: tokens [B, MQ] = {[B, MQ]}, positions {list(positions.shape)}, "
                         f"prefix_len {list(prefix_len.shape)} and branch KV "
                         f"{list(branch.k[0].shape[:2])} must agree")
    check_room(step, 1, depth, "tree_step (branch KV slot `step`)")
    check_room(jnp.where(valid, prefix_len, 0), 0, cache.max_len, "tree_step (prefix_len)")
    W = cache.max_len if window is None else min(int(window), cache.max_len)
    x = embed(params.embed, tokens)  # [B, MQ, E]
    h = rms_norm(x, params.layers[0].attn_norm, cfg.rms_norm_eps)
    new_k, new_v = [], []
    g = params.tp_groups
    for i, (lp, kc, vc, bk, bv) in enumerate(zip(params.layers, cache.k, cache.v, branch.k,
                                                 branch.v)):
        q, k, v = _qkv(lp, cfg, ops, h, positions, g)
        att, bk, bv = ops.tree_attention(q, k, v, kc, vc, prefix_len, bk, bv, step, valid, window=W)
        x, h = ops.add_norm(x, ops.dense(att.reshape(B, MQ, -1), lp.wo), lp.mlp_norm,
                            eps=cfg.rms_norm_eps)
        x, h = ops.add_norm(x, _mlp(lp, cfg, ops, h, g), _next_norm(params, i),
                            eps=cfg.rms_norm_eps)
        new_k.append(bk)
        new_v.append(bv)
    return _logits(params, cfg, ops, h), BranchKV(k=tuple(new_k), v=tuple(new_v))
