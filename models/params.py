"""Weights as Flax struct pytrees, and the conversions into them (HF-named tensors, random init).

q/k/v are fused into one [hidden, (H + 2*KVH) * D] matrix and gate/up into one [hidden, 2*I]:
on the CPU a decode step is a chain of small matmuls, and fewer, wider ones read the same bytes
with fewer dispatches.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ssd_jax.models.config import ModelConfig


@struct.dataclass
class LayerParams:
    """One decoder layer's weights (fused qkv and gate/up; see the module docstring)."""
    attn_norm: jax.Array  # [hidden]
    wqkv: jax.Array  # [hidden, (H + 2 KVH) D]
    bqkv: jax.Array | None  # [(H + 2 KVH) D] (Qwen2) or None
    q_norm: jax.Array | None  # [D] (Qwen3) or None
    k_norm: jax.Array | None  # [D] (Qwen3) or None
    wo: jax.Array  # [H D, hidden]
    mlp_norm: jax.Array  # [hidden]
    w_gate_up: jax.Array  # [hidden, 2 I]
    w_down: jax.Array  # [I, hidden]


# The layer's dense matmul weights, each [K, N]: what packing and quantization re-lay out.
DENSE_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


@struct.dataclass
class Params:
    """A decoder's weights: embed [V, E], per-layer `LayerParams`, final_norm [E], lm_head [E, V]
    (None when tied to the embedding). Dense weights are arrays or logical quantized formats
    (models/weights.py); a backend's `prepare` may re-lay them out. tp_groups (static): how many
    tensor-parallel groups the fused wqkv / w_gate_up columns are laid out in (1: checkpoint
    order; `ssd_jax.runtime.sharding.tp_layout` sets the TP degree)."""
    embed: jax.Array  # [V, hidden]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, V], None when tied to embed
    tp_groups: int = struct.field(pytree_node=False, default=1)


def _hf_key_sets(cfg: ModelConfig) -> list[str]:
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_embeddings:
        keys.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        keys += [p + s for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight")]
        if cfg.qkv_bias:
            keys += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if cfg.qk_norm:
            keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return keys


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> Params:
    """HF-named tensors ([out, in] layout) -> Params in cfg.dtype, with shape checks that name the tensor."""
    missing = [k for k in _hf_key_sets(cfg) if k not in tensors]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    dt = jnp.dtype(cfg.dtype)
    H, KVH, D, E, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

    def get(name, shape):
        a = np.asarray(tensors[name])
        if a.shape != tuple(shape):
            raise ValueError(f"tensor {name} has shape {a.shape}, the config expects {tuple(shape)}")
        if not np.all(np.isfinite(a.astype(np.float32))):
            raise ValueError(f"tensor {name} contains NaN or Inf: the checkpoint is corrupt")
        return a.astype(np.float32)

    def arr(a):
        return jnp.asarray(a, dtype=dt)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = get(p + "self_attn.q_proj.weight", (H * D, E))
        k = get(p + "self_attn.k_proj.weight", (KVH * D, E))
        v = get(p + "self_attn.v_proj.weight", (KVH * D, E))
        bqkv = None
        if cfg.qkv_bias:
            bqkv = arr(np.concatenate([get(p + "self_attn.q_proj.bias", (H * D,)),
                                       get(p + "self_attn.k_proj.bias", (KVH * D,)),
                                       get(p + "self_attn.v_proj.bias", (KVH * D,))]))
        gate = get(p + "mlp.gate_proj.weight", (I, E))
        up = get(p + "mlp.up_proj.weight", (I, E))
        layers.append(LayerParams(
            attn_norm=arr(get(p + "input_layernorm.weight", (E,))),
            wqkv=arr(np.concatenate([q, k, v], axis=0).T),
            bqkv=bqkv,
            q_norm=arr(get(p + "self_attn.q_norm.weight", (D,))) if cfg.qk_norm else None,
            k_norm=arr(get(p + "self_attn.k_norm.weight", (D,))) if cfg.qk_norm else None,
            wo=arr(get(p + "self_attn.o_proj.weight", (E, H * D)).T),
            mlp_norm=arr(get(p + "post_attention_layernorm.weight", (E,))),
            w_gate_up=arr(np.concatenate([gate, up], axis=0).T),
            w_down=arr(get(p + "mlp.down_proj.weight", (E, I)).T),
        ))
    embed = get("model.embed_tokens.weight", (cfg.vocab_size, E))
    lm_head = None if cfg.tie_embeddings else arr(get("lm_head.weight", (cfg.vocab_size, E)).T)
    return Params(embed=arr(embed), layers=tuple(layers),
                  final_norm=arr(get("model.norm.weight", (E,))), lm_head=lm_head)


def random_hf_tensors(cfg: ModelConfig, seed: int = 0, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Every parameter randomised, biases and norm scales too (HF's init leaves those trivial),
    so an oracle comparison exercises every term of the forward."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in _hf_key_sets(cfg):
        H, KVH, D, E, I, V = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                              cfg.intermediate_size, cfg.vocab_size)
        shape = {
            "embed_tokens.weight": (V, E), "lm_head.weight": (V, E), "norm.weight": (E,),
            "input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
            "q_proj.weight": (H * D, E), "k_proj.weight": (KVH * D, E), "v_proj.weight": (KVH * D, E),
            "o_proj.weight": (E, H * D), "gate_proj.weight": (I, E), "up_proj.weight": (I, E),
            "down_proj.weight": (E, I), "q_proj.bias": (H * D,), "k_proj.bias": (KVH * D,),
            "v_proj.bias": (KVH * D,), "q_norm.weight": (D,), "k_norm.weight": (D,),
        }[".".join(name.split(".")[-2:])]
        if name.endswith("norm.weight"):
            a = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            a = 0.1 * rng.standard_normal(shape)
        else:
            a = scale * rng.standard_normal(shape) / np.sqrt(shape[-1])
            if name.endswith("embed_tokens.weight"):
                a = rng.standard_normal(shape)
        out[name] = a.astype(np.float32)
    return out


def perturb_hf_tensors(tensors: Mapping[str, np.ndarray], rel: float, seed: int = 1) -> dict[str, np.ndarray]:
    """HF-named tensors with every weight multiplied by (1 + rel * N(0,1)): a draft that mostly
    agrees with its target, as files a separate process can load."""
    rng = np.random.default_rng(seed)
    return {k: (v * (1 + rel * rng.standard_normal(v.shape))).astype(np.float32)
            for k, v in tensors.items()}


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.5) -> Params:
    """Params with every tensor random (`random_hf_tensors`), for tests and notebooks."""
    return params_from_hf(random_hf_tensors(cfg, seed, scale), cfg)


def perturb(params: Params, key: jax.Array, rel: float) -> Params:
    """A copy with every weight multiplied by (1 + rel * N(0,1)): a draft that mostly agrees with its target."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    new = [x * (1 + rel * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
           for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, new)


def param_bytes(params: Params) -> int:
    """Bytes of every array in `params`."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def decode_bytes(params: Params) -> int:
    """Bytes of weights one decode step streams: all but the embedding, of which it gathers a row,
    when the head is its own array (untied, or untied by a backend's `prepare`); the embedding is
    the head if tied."""
    total = param_bytes(params)
    return total - params.embed.size * params.embed.dtype.itemsize if params.lm_head is not None else total


def truncate_layers(params: Params, cfg: ModelConfig, num_layers: int) -> tuple[Params, ModelConfig]:
    """A self-speculative draft derived from a model: its first `num_layers` layers, same embedding,
    final norm and head (shares the tokenizer by construction)."""
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
    return params.replace(layers=params.layers[:num_layers]), cfg.replace(num_layers=num_layers)
