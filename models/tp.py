"""Where each parameter goes: the tensor-parallel layout, and building a leaf onto its devices.

The layout (Megatron style, over a mesh axis named `model` of size `tp`; the runtime's
`ssd_jax.runtime.sharding` explains the collectives it leaves):

    wqkv  [E, (H + 2 KVH) D]  columns re-laid out group-wise as [tp, (H + 2 KVH)/tp, D]  P(None, model)
    bqkv  [(H + 2 KVH) D]     the same re-layout                                        P(model)
    wo    [H D, E]            rows                                                      P(model, None)
    w_gate_up [E, 2 I]        columns re-laid out as [tp, 2, I/tp]                      P(None, model)
    w_down [I, E]             rows                                                      P(model, None)
    lm_head [E, V]            columns when tp divides V, else replicated
    embed, norms, q/k norms   replicated

`placer(sharding, cfg)` turns what a caller asks for (None: the default device; a
`jax.sharding.Sharding` for every leaf; a `Mesh` with a `model` axis: this layout) into the
function that places one host array as one leaf: `jax.make_array_from_callback`, so each device
receives only its own shard, copied from the host array's slice; no device ever holds a whole
tensor-parallel weight.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ssd_jax.models.config import ModelConfig

TP_AXIS = "model"

# spec of each Params / LayerParams field under the layout above (lm_head: see leaf_spec)
_SPECS = {"wqkv": P(None, TP_AXIS), "bqkv": P(TP_AXIS), "wo": P(TP_AXIS, None),
          "w_gate_up": P(None, TP_AXIS), "w_down": P(TP_AXIS, None)}


def tp_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of `cfg`'s weights re-laid out for tensor parallelism of degree `tp` (KV heads
    replicated up to `tp` when there are fewer), or a ValueError naming the constraint."""
    tp = int(tp)
    H, KVH, I = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    if H % tp:
        raise ValueError(f"tensor parallelism {tp} needs num_heads ({H}) divisible by {tp}")
    if I % tp:
        raise ValueError(f"tensor parallelism {tp} needs intermediate_size ({I}) divisible by {tp}")
    if KVH % tp and tp % KVH:
        raise ValueError(f"tensor parallelism {tp} needs num_kv_heads ({KVH}) to divide or be a "
                         f"multiple of {tp} (KV heads are split over shards, or replicated when "
                         f"there are fewer than shards)")
    return cfg.replace(num_kv_heads=max(KVH, tp))


def qkv_columns(w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """[..., (H + 2 KVH) D] in checkpoint order -> [..., tp * (H/tp + 2 KVH'/tp) * D] group-wise."""
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lead = w.shape[:-1]
    q = w[..., : H * D].reshape(*lead, H, D)
    k = w[..., H * D: (H + KVH) * D].reshape(*lead, KVH, D)
    v = w[..., (H + KVH) * D:].reshape(*lead, KVH, D)
    if KVH < tp:  # replicate each KV head tp/KVH times: head j' serves the q heads of head j'//r
        r = tp // KVH
        k, v = np.repeat(k, r, axis=-2), np.repeat(v, r, axis=-2)
    kvh = k.shape[-2]
    parts = [a.reshape(*lead, tp, n // tp, D) for a, n in ((q, H), (k, kvh), (v, kvh))]
    return np.concatenate(parts, axis=-2).reshape(*lead, -1)


def gate_up_columns(w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """[E, 2 I] ([gate | up]) -> [E, tp * 2 * I/tp] group-wise."""
    E, I = w.shape[0], cfg.intermediate_size
    return w.reshape(E, 2, tp, I // tp).transpose(0, 2, 1, 3).reshape(E, 2 * I)


def relayout(field: str, w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """One logical leaf (a host array) in the TP layout of degree `tp` (unchanged for tp 1 and
    for the fields the layout keeps in checkpoint order)."""
    if tp == 1:
        return w
    if field in ("wqkv", "bqkv"):
        return qkv_columns(w, cfg, tp)
    if field == "w_gate_up":
        return gate_up_columns(w, cfg, tp)
    return w


def undo(field: str, w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """`relayout` reversed: a leaf laid out for degree `tp` (`cfg` its config, as `tp_config`
    made it) back in checkpoint order. KV heads replicated for `tp` stay (as heads of their
    own: the same model, with cfg's KV-head count)."""
    if tp == 1 or field not in ("wqkv", "bqkv", "w_gate_up"):
        return w
    if field == "w_gate_up":
        E, I = w.shape[0], cfg.intermediate_size
        return w.reshape(E, tp, 2, I // tp).transpose(0, 2, 1, 3).reshape(E, 2 * I)
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lead = w.shape[:-1]
    g = w.reshape(*lead, tp, (H + 2 * KVH) // tp, D)
    q, k, v = np.split(g, [H // tp, (H + KVH) // tp], axis=-2)
    return np.concatenate([a.reshape(*lead, -1) for a in (q, k, v)], axis=-1)


def leaf_spec(field: str, shape: tuple[int, ...], tp: int) -> P:
    """The PartitionSpec of the leaf `field` (a Params / LayerParams field name) of `shape`."""
    if tp == 1:
        return P()
    if field == "lm_head":
        return P(None, TP_AXIS) if shape[1] % tp == 0 else P()
    return _SPECS.get(field, P())


def mesh_degree(mesh: Mesh) -> int:
    """The size of `mesh`'s `model` axis, or a ValueError when it has none."""
    if TP_AXIS not in mesh.shape:
        raise ValueError(f"a mesh to load onto needs an axis named {TP_AXIS!r} (tensor "
                         f"parallelism), got axes {tuple(mesh.shape)}")
    return int(mesh.shape[TP_AXIS])


def place(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """`host` as a jax.Array with `sharding`: each device gets only its shard (None: the default
    device, uncommitted, as `jnp.asarray`)."""
    if sharding is None:
        return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def placer(sharding, cfg: ModelConfig) -> tuple[int, ModelConfig, Callable[[str, np.ndarray], jax.Array]]:
    """(tp, the config of the laid-out weights, put(field, host) -> the leaf on its devices) for
    `sharding`: None (default device), a Sharding (every leaf with it) or a Mesh with a `model`
    axis (the TP layout; tp 1: replicated on the mesh). Raises ValueError before any weight is
    read when the model does not split over the mesh."""
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return 1, cfg, lambda field, host: place(host, sharding)
    if not isinstance(sharding, Mesh):
        raise TypeError(f"sharding must be None, a jax.sharding.Sharding or a Mesh with a "
                        f"{TP_AXIS!r} axis, got {type(sharding).__name__}")
    mesh, tp = sharding, mesh_degree(sharding)
    tcfg = tp_config(cfg, tp) if tp > 1 else cfg

    def put(field: str, host: np.ndarray) -> jax.Array:
        host = relayout(field, host, cfg, tp)
        return place(host, NamedSharding(mesh, leaf_spec(field, host.shape, tp)))

    return tp, tcfg, put


__all__ = ["TP_AXIS", "gate_up_columns", "leaf_spec", "mesh_degree", "place", "placer",
           "qkv_columns", "relayout", "tp_config", "undo"]
