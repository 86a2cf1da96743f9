"""The decoder forward as pure functions of (params, cfg, tokens, cache).

- `forward`: T new tokens per sequence appended at `cache.lengths` (prefill, one-token decode, a
  K+1-token verify at per-sequence offsets, a catch-up of the tokens the draft has no KV for).
- `tree_step`: one step of SSD's branch decode (ALGORITHM.md §2): one query per branch at RoPE position
  `n+j+1+d`, seeing cache slots `0..n+j` and its own path, whose KV lives in a per-branch buffer
  so branches never write the shared cache.

Layers are a Python loop over per-layer caches: a `lax.scan` with the cache as scanned state copies
the whole cache every step on XLA CPU. Each layer's KV write and attention is
`ssd_jax.models.cpu_attention.attend`: on the CPU, for up to 16 new tokens, one kernel call that writes the
donated cache in place; else a per-sequence scatter and two dots. `window` (static) bounds
attention to the first `window` cache slots so short sequences do not pay for `max_len`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models import cpu_attention, cpu_matmul, cpu_swiglu
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache
from ssd_jax.models.params import LayerParams, Params
from ssd_jax.models.packed import PackedWeight
from ssd_jax.models.int4 import Int4Weight, matmul_int4
from ssd_jax.models.quant import Int8Weight


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # As HF: normalise in fp32, cast back, then scale (the order matters in bf16).
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [..., N, D] at positions [...] (rotate-half convention of HF Llama/Qwen)."""
    inv = jnp.asarray(cfg.inv_freq())
    ang = positions[..., None].astype(jnp.float32) * inv  # [..., D/2]
    cos = jnp.cos(ang)[..., None, :].astype(x.dtype)
    sin = jnp.sin(ang)[..., None, :].astype(x.dtype)
    half = cfg.head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense(cfg: ModelConfig, x: jax.Array, w: jax.Array | Int8Weight | Int4Weight | PackedWeight,
          transpose_w: bool = False, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] (w [N, K] with `transpose_w`; an Int8Weight, Int4Weight or
    PackedWeight is always [K, N]): the CPU small-M kernel where it serves."""
    if isinstance(w, PackedWeight):
        return cpu_matmul.matmul(x, w.w, enabled=cfg.cpu_kernels, packed=True,
                                 preferred_element_type=preferred_element_type)
    if isinstance(w, Int4Weight):
        return matmul_int4(x, w.tiles, enabled=cfg.cpu_kernels,
                           preferred_element_type=preferred_element_type)
    if isinstance(w, Int8Weight):
        return cpu_matmul.matmul_int8(x, w.q, w.scale, enabled=cfg.cpu_kernels, tiled=w.tiled,
                                      preferred_element_type=preferred_element_type)
    return cpu_matmul.matmul(x, w, transpose_w=transpose_w, enabled=cfg.cpu_kernels,
                             preferred_element_type=preferred_element_type)


def _tp_groups(cfg: ModelConfig) -> int:
    """How many tensor-parallel groups the fused wqkv / w_gate_up columns are laid out in: 1 for
    the checkpoint layout, the TP degree for `ssd_jax.runtime.sharding.TPConfig` (see ssd_jax/runtime/sharding.py)."""
    return int(getattr(cfg, "tp_groups", 1))


def _qkv(lp: LayerParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array):
    """x [B, T, E] -> q [B, T, H, D], k, v [B, T, KVH, D] (normed, rotated)."""
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    qkv = dense(cfg, h, lp.wqkv)
    if lp.bqkv is not None:
        qkv = qkv + lp.bqkv
    lead = x.shape[:-1]
    g = _tp_groups(cfg)
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


def _mlp(lp: LayerParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    gu = dense(cfg, h, lp.w_gate_up)
    g = _tp_groups(cfg)
    if g == 1:
        return dense(cfg, cpu_swiglu.swiglu(gu, enabled=cfg.cpu_kernels), lp.w_down)
    # columns [g, 2, I / g]: group s holds gate and up columns of the same w_down rows
    gu = gu.reshape(*gu.shape[:-1], g, 2, cfg.intermediate_size // g)
    gate = gu[..., 0, :].reshape(*gu.shape[:-3], cfg.intermediate_size)
    up = gu[..., 1, :].reshape(*gu.shape[:-3], cfg.intermediate_size)
    return dense(cfg, jax.nn.silu(gate) * up, lp.w_down)


def _logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:  # tied: the embedding [V, E] read transposed
        out = dense(cfg, x, params.embed, transpose_w=True, preferred_element_type=jnp.float32)
    else:
        out = dense(cfg, x, params.lm_head, preferred_element_type=jnp.float32)
    out = out.astype(jnp.float32)
    n = out.shape[-1]
    if n < cfg.vocab_size:  # a head cut to ids [0, n) (models/draft_head.py): the rest never win
        out = jnp.concatenate([out, jnp.full((*out.shape[:-1], cfg.vocab_size - n), -jnp.inf)], -1)
    return out


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache,
            num_new: jax.Array | None = None, *, window: int | None = None,
            last_only: bool = False) -> tuple[jax.Array, KVCache]:
    """Append `tokens` [B, T] at positions `cache.lengths + t`.

    num_new [B]: how many of the T tokens are real (right padding beyond it writes stale KV past
    the new length, which is masked and later overwritten). Returns logits [B, T, V] fp32 (or
    [B, V] at each row's last real token with `last_only`) and the cache with lengths += num_new.
    """
    B, T = tokens.shape
    if num_new is None:
        num_new = jnp.full((B,), T, jnp.int32)
    W = cache.max_len if window is None else min(int(window), cache.max_len)
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x = params.embed[tokens]
    new_k, new_v = [], []
    for lp, kc, vc in zip(params.layers, cache.k, cache.v):
        q, k, v = _qkv(lp, cfg, x, positions)
        att, kc, vc = cpu_attention.attend(q, k, v, positions, kc, vc, window=W,
                                           enabled=cfg.cpu_kernels)
        x = x + dense(cfg, att, lp.wo)
        x = x + _mlp(lp, cfg, x)
        new_k.append(kc)
        new_v.append(vc)
    if last_only:
        x = jnp.take_along_axis(x, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = _logits(params, cfg, x)
    return logits, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new)


@struct.dataclass
class BranchKV:
    """Own-path KV of every branch of the speculation tree, per layer [B, MQ, K, KVH, D]."""
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_branch_kv(cfg: ModelConfig, batch: int, branches: int, depth: int) -> BranchKV:
    shape = (batch, branches, depth, cfg.num_kv_heads, cfg.head_dim)
    z = jnp.zeros(shape, cfg.dtype)
    return BranchKV(k=(z,) * cfg.num_layers, v=(z,) * cfg.num_layers)


def tree_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
              cache: KVCache, prefix_len: jax.Array, branch: BranchKV, step: jax.Array,
              valid: jax.Array, *, window: int | None = None,
              attention: str = "reference") -> tuple[jax.Array, BranchKV]:
    """One draft step for every branch.

    tokens, positions, prefix_len [B, MQ]; step: int32 scalar (own-path slot written and the last
    one visible); valid [B, MQ]. The shared cache is read, never written. Returns logits
    [B, MQ, V] fp32 and the branch KV with slot `step` filled. `attention` picks the plain-jnp
    reference or the Pallas kernel (both in ssd_jax.pallas_kernels.tree_attention).
    """
    from ssd_jax.pallas_kernels.tree_attention import tree_attention, tree_attention_reference

    if attention == "reference":
        attend = tree_attention_reference
    elif attention == "pallas":
        attend = functools.partial(tree_attention, interpret=jax.default_backend() == "cpu")
    else:
        raise ValueError(f"unknown tree attention {attention!r}: use 'reference' or 'pallas'")
    W = cache.max_len if window is None else min(int(window), cache.max_len)
    x = params.embed[tokens]  # [B, MQ, E]
    new_k, new_v = [], []
    for lp, kc, vc, bk, bv in zip(params.layers, cache.k, cache.v, branch.k, branch.v):
        q, k, v = _qkv(lp, cfg, x, positions)
        bk = jax.lax.dynamic_update_slice_in_dim(bk, k[:, :, None].astype(bk.dtype), step, axis=2)
        bv = jax.lax.dynamic_update_slice_in_dim(bv, v[:, :, None].astype(bv.dtype), step, axis=2)
        att = attend(q, kc[:, :W], vc[:, :W], prefix_len, bk, bv, step, valid)
        B, MQ = tokens.shape
        x = x + dense(cfg, att.reshape(B, MQ, -1), lp.wo)
        x = x + _mlp(lp, cfg, x)
        new_k.append(bk)
        new_v.append(bv)
    return _logits(params, cfg, x), BranchKV(k=tuple(new_k), v=tuple(new_v))
