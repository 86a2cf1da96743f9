"""Weights as Flax struct pytrees, and the conversions into them (HF-named tensors, random init).

q/k/v are fused into one [hidden, (H + 2*KVH) * D] matrix and gate/up into one [hidden, 2*I]:
on the CPU a decode step is a chain of small matmuls, and fewer, wider ones read the same bytes
with fewer dispatches.
"""
from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.loading.source import TensorSource, as_source
from ssd_jax.models.tp import placer


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
    order; `ssd_jax.models.tp` lays them out for a TP degree)."""
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


_CHUNK = 16 << 20  # float32 values converted at a time (64 MiB): the host's transient per tensor


@functools.cache
def _malloc_trim():
    try:
        import ctypes
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def trim_host() -> None:
    """Hand the host buffers just freed back to the OS (glibc's malloc_trim). glibc raises its
    mmap threshold to the largest block freed so far (up to 32 MiB), so tensor-sized buffers then
    come from the heap and its holes stay resident: without this a load's RSS creeps up a few MB
    a layer (and on a CPU the devices' memory is the host's)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _fill(dst: np.ndarray, src: TensorSource, name: str, transpose: bool = False) -> None:
    """Write tensor `name` into `dst` (its shape, or transposed), in `dst`'s dtype, a block of
    rows at a time: each block read as float32, checked finite, converted (rounded to nearest
    even, as XLA converts) and written; the float32 copy never exceeds one block."""
    shape = src.shape(name)
    n = shape[0] if shape else 1
    step = max(1, _CHUNK // max(1, int(np.prod(shape[1:], dtype=np.int64))))
    for a in range(0, n, step):
        block = src.rows(name, a, min(n, a + step))
        if not np.isfinite(block).all():
            raise ValueError(f"tensor {name} contains NaN or Inf: the checkpoint is corrupt")
        if transpose:
            dst[:, a:a + block.shape[0]] = block.T
        elif dst.ndim:
            dst[a:a + block.shape[0]] = block.reshape(-1, *dst.shape[1:])
        else:
            dst[...] = block.reshape(())


def params_from_hf(tensors: Mapping[str, np.ndarray] | TensorSource, cfg: ModelConfig,
                   sharding=None) -> Params:
    """HF-named tensors ([out, in] layout) -> Params in cfg.dtype, each leaf built straight onto
    its devices (`ssd_jax.models.tp.placer`): `sharding` None (the default device), a
    `jax.sharding.Sharding` for every leaf, or a `Mesh` with a `model` axis (the tensor-parallel
    layout, `tp_groups` = its size; each device receives only its shard).

    `tensors` is a dict or a lazy `TensorSource` (what the loaders return): one tensor at a time
    is read, converted to cfg.dtype a block of rows at a time, fused / transposed / re-laid out on
    the host and placed, so the host holds a few tensors, never the model. Every tensor's
    presence and shape is checked, naming it, before the first is read."""
    src = as_source(tensors)
    missing = [k for k in _hf_key_sets(cfg) if k not in src]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    dt = np.dtype(jnp.dtype(cfg.dtype))
    H, KVH, D, E, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    V = cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (H * D, E), p + "self_attn.k_proj.weight": (KVH * D, E),
            p + "self_attn.v_proj.weight": (KVH * D, E), p + "self_attn.o_proj.weight": (E, H * D),
            p + "mlp.gate_proj.weight": (I, E), p + "mlp.up_proj.weight": (I, E),
            p + "mlp.down_proj.weight": (E, I), p + "self_attn.q_proj.bias": (H * D,),
            p + "self_attn.k_proj.bias": (KVH * D,), p + "self_attn.v_proj.bias": (KVH * D,),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
    for name in _hf_key_sets(cfg):
        if tuple(src.shape(name)) != shapes[name]:
            raise ValueError(f"tensor {name} has shape {tuple(src.shape(name))}, the config "
                             f"expects {shapes[name]}")
    tp, _, put = placer(sharding, cfg)

    def one(field, name, transpose=False):
        shape = shapes[name][::-1] if transpose else shapes[name]
        host = np.empty(shape, dt)
        _fill(host, src, name, transpose)
        out = put(field, host)
        del host
        trim_host()
        return out

    def fused(field, names, transpose):
        """Tensors stacked on their rows ([out, in]) -> one host array, transposed for a matmul."""
        rows = sum(shapes[n][0] for n in names)
        host = np.empty((shapes[names[0]][1], rows) if transpose else (rows,), dt)
        at = 0
        for n in names:
            r = shapes[n][0]
            _fill(host[:, at:at + r] if transpose else host[at:at + r], src, n, transpose)
            at += r
        out = put(field, host)
        del host
        trim_host()
        return out

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
        layers.append(LayerParams(
            attn_norm=one("attn_norm", p + "input_layernorm.weight"),
            wqkv=fused("wqkv", [n + ".weight" for n in qkv], True),
            bqkv=fused("bqkv", [n + ".bias" for n in qkv], False) if cfg.qkv_bias else None,
            q_norm=one("q_norm", p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=one("k_norm", p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            wo=one("wo", p + "self_attn.o_proj.weight", True),
            mlp_norm=one("mlp_norm", p + "post_attention_layernorm.weight"),
            w_gate_up=fused("w_gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], True),
            w_down=one("w_down", p + "mlp.down_proj.weight", True),
        ))
    lm_head = None if cfg.tie_embeddings else one("lm_head", "lm_head.weight", True)
    return Params(embed=one("embed", "model.embed_tokens.weight"), layers=tuple(layers),
                  final_norm=one("final_norm", "model.norm.weight"), lm_head=lm_head, tp_groups=tp)


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


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.5) -> Params:
    """Random Params drawn with `jax.random` on the default device, in cfg.dtype: the host never
    holds them, so a real model's shapes (a 1.5B target on a GPU, say) are ready in a second
    rather than the minutes `random_params`' NumPy draw and conversion take. The same
    distribution as `random_params` (norm scales 1 + 0.2 N, biases 0.1 N, the embedding N(0, 1),
    matrices scale N / sqrt(fan-in)), but not the same numbers: use that one where a test needs
    HF-named tensors or NumPy's values."""
    H, KVH, D, E, I, V = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                          cfg.intermediate_size, cfg.vocab_size)
    dt = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(key, 8 + 9 * cfg.num_layers))

    def normal(shape, std, mean=0.0):
        return (mean + std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    def matrix(fan_in, fan_out):  # [in, out], the layout Params keeps
        return normal((fan_in, fan_out), scale / np.sqrt(fan_in))

    qkv = (H + 2 * KVH) * D
    layers = tuple(LayerParams(
        attn_norm=normal((E,), 0.2, 1.0), wqkv=matrix(E, qkv),
        bqkv=normal((qkv,), 0.1) if cfg.qkv_bias else None,
        q_norm=normal((D,), 0.2, 1.0) if cfg.qk_norm else None,
        k_norm=normal((D,), 0.2, 1.0) if cfg.qk_norm else None,
        wo=matrix(H * D, E), mlp_norm=normal((E,), 0.2, 1.0), w_gate_up=matrix(E, 2 * I),
        w_down=matrix(I, E)) for _ in range(cfg.num_layers))
    return Params(embed=normal((V, E), 1.0), layers=layers, final_norm=normal((E,), 0.2, 1.0),
                  lm_head=None if cfg.tie_embeddings else matrix(E, V))


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
