"""Scale-out: a tensor-parallel target, a data-parallel draft, and the bytes that cross meshes.

Target layout over the target mesh's `model` axis (degree `tp`), Megatron style, so every matmul
runs on local shards and the only collectives are two all-reduces per layer (after `wo` and
`w_down`) plus the vocab-parallel logits:

    wqkv  [E, (H + 2 KVH) D]  columns re-laid out group-wise at load time as [tp, (H + 2 KVH)/tp, D]:
                              shard s holds q heads s*H/tp.., k and v heads s*KVH/tp..  -> P(None, model)
    bqkv  [(H + 2 KVH) D]     the same re-layout                                        -> P(model)
    wo    [H D, E]            rows (heads, checkpoint order)                            -> P(model, None)
    w_gate_up [E, 2 I]        columns re-laid out as [tp, 2, I/tp] (gate and up of the same rows
                              of w_down on one shard)                                   -> P(None, model)
    w_down [I, E]             rows                                                      -> P(model, None)
    lm_head [E, V]            columns (vocab parallel) when tp divides V, else replicated
    embed, norms, q/k norms   replicated
    KV cache [B, S, KVH, D]   KV-head axis -> P(None, None, model, None); lengths replicated

The re-layout is recorded with the weights: `Params.tp_groups = tp` (static), which
`ssd_jax.models.transformer` reads to split q/k/v and gate/up per group; with 1 nothing changes.
The config stays a statement of model facts (`tp_config` only raises the KV-head count when heads
are replicated).
GQA with fewer KV heads than `tp` (tp a multiple of KVH) replicates each KV head tp/KVH times
(weights and cache); anything else is a clear error.

The draft runs on its own mesh (`data` axis): replicated weights, and with 2+ devices its cache and
every per-sequence input are sharded over the batch when the batch divides evenly (else replicated).
Only token ids, outcome integers and proposal rows cross meshes; rows go to the target sharded over
the vocabulary (`Placement.target_rows`), so each byte crosses once whatever the TP degree.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache, init_cache
from ssd_jax.models.params import LayerParams, Params
from ssd_jax.models.quant import is_quantized

TP_AXIS = "model"
DP_AXIS = "data"


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


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _qkv_columns(w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
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


def _gate_up_columns(w: np.ndarray, cfg: ModelConfig, tp: int) -> np.ndarray:
    """[E, 2 I] ([gate | up]) -> [E, tp * 2 * I/tp] group-wise."""
    E, I = w.shape[0], cfg.intermediate_size
    return w.reshape(E, 2, tp, I // tp).transpose(0, 2, 1, 3).reshape(E, 2 * I)


def tp_layout(params: Params, cfg: ModelConfig, tp: int) -> tuple[ModelConfig, Params]:
    """Host-side (numpy) re-layout of logical `params` for TP degree `tp`; returns (config,
    params with `tp_groups = tp`)."""
    if is_quantized(params):
        raise ValueError("tensor-parallel placement takes unquantized params: int8 weights "
                         "(models/quant.py) are for a single-device draft")
    tcfg = tp_config(cfg, tp)
    layers = []
    for lp in params.layers:
        layers.append(lp.replace(
            wqkv=_qkv_columns(_np(lp.wqkv), cfg, tp),
            bqkv=None if lp.bqkv is None else _qkv_columns(_np(lp.bqkv), cfg, tp),
            w_gate_up=_gate_up_columns(_np(lp.w_gate_up), cfg, tp),
            **{n: _np(getattr(lp, n)) for n in ("attn_norm", "wo", "mlp_norm", "w_down")
               if getattr(lp, n) is not None},
            **{n: _np(getattr(lp, n)) for n in ("q_norm", "k_norm") if getattr(lp, n) is not None}))
    return tcfg, Params(embed=_np(params.embed), layers=tuple(layers),
                        final_norm=_np(params.final_norm),
                        lm_head=None if params.lm_head is None else _np(params.lm_head),
                        tp_groups=tp)


def param_specs(params: Params, tp: int) -> Params:
    """PartitionSpecs (a Params-shaped pytree) of the TP layout above."""
    rep = P()

    def layer(lp: LayerParams) -> LayerParams:
        return LayerParams(
            attn_norm=rep, wqkv=P(None, TP_AXIS),
            bqkv=None if lp.bqkv is None else P(TP_AXIS),
            q_norm=None if lp.q_norm is None else rep, k_norm=None if lp.k_norm is None else rep,
            wo=P(TP_AXIS, None), mlp_norm=rep, w_gate_up=P(None, TP_AXIS), w_down=P(TP_AXIS, None))

    lm = None
    if params.lm_head is not None:
        lm = P(None, TP_AXIS) if params.lm_head.shape[1] % tp == 0 else rep
    return Params(embed=rep, layers=tuple(layer(lp) for lp in params.layers), final_norm=rep,
                  lm_head=lm, tp_groups=params.tp_groups)


def shard_target(params: Params, cfg: ModelConfig, mesh: Mesh) -> tuple[ModelConfig, Params]:
    """Re-lay out and place the target's weights on `mesh` (axis `model`, degree mesh.size).

    Each device receives only its shards (host -> device per shard). With a 1-device mesh the
    weights are placed unchanged and `cfg` is returned as is."""
    tp = int(mesh.shape[TP_AXIS])
    if tp == 1:
        return cfg, jax.device_put(params, NamedSharding(mesh, P()))
    tcfg, host = tp_layout(params, cfg, tp)
    specs = param_specs(host, tp)
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                       is_leaf=lambda x: isinstance(x, P))
    return tcfg, jax.device_put(host, shardings)


def cache_specs(num_layers: int) -> KVCache:
    """PartitionSpecs of a TP target's KV cache: the KV-head axis over `model`, lengths replicated."""
    kv = P(None, None, TP_AXIS, None)
    return KVCache(k=(kv,) * num_layers, v=(kv,) * num_layers, lengths=P())


def init_target_cache(cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh) -> KVCache:
    """A zero KV cache on the target mesh: sharded on the KV-head axis when TP > 1, created in place
    (no full copy on one device)."""
    if int(mesh.shape[TP_AXIS]) == 1:
        return init_cache(cfg, batch, max_len, sharding=NamedSharding(mesh, P()))
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), cache_specs(cfg.num_layers),
                                       is_leaf=lambda x: isinstance(x, P))
    return jax.jit(lambda: init_cache(cfg, batch, max_len), out_shardings=shardings)()


# ------------------------------------------------------------------------------------------------
# Bytes that cross meshes, and the ALGORITHM.md §6 round-time arithmetic (docs/SCALE_OUT.md)
# ------------------------------------------------------------------------------------------------
def bytes_per_round(batch: int, k: int, vocab: int, row_dtype="float32", *, target_devices: int = 1,
                    draft_devices: int = 1, rows_sharded: bool = True) -> dict[str, int]:
    """Bytes crossing between the draft and target meshes in one SD/SSD round, as the engine moves
    them (`Placement.target_rows`, `DraftWorker` batch sharding).

    draft -> target: the speculation (K int32 tokens per sequence, replicated on each target device)
    and its proposal rows (K x vocab x row dtype per sequence), sharded over the vocabulary on the
    target (`rows_sharded`, when tp divides the vocabulary) so each row byte crosses once, else
    replicated so it crosses once per target device. target -> draft: the outcome (k, t*), two int32
    per sequence, batch-sharded on a data-parallel draft whose size divides the batch, else replicated
    on every draft device. Returns totals and the busiest single device's receive / send bytes.
    """
    B, K, V, T, D = int(batch), int(k), int(vocab), int(target_devices), int(draft_devices)
    row_b = B * K * V * jnp.dtype(row_dtype).itemsize
    tok_b = B * K * 4
    out_b = B * 2 * 4
    dp_sharded = D > 1 and B % D == 0
    rows_total = row_b if (rows_sharded or T == 1) else row_b * T
    to_target = rows_total + tok_b * T
    to_draft = out_b * (1 if dp_sharded else D)
    return {
        "draft_to_target": to_target,
        "target_to_draft": to_draft,
        "total": to_target + to_draft,
        "per_target_device_in": to_target // T,
        "per_draft_device_out": to_target // D if dp_sharded else to_target,
    }


def tokens_per_round(a: float, k: int) -> float:
    """Spec §6: expected tokens emitted per round with per-token acceptance a (K drafts + bonus)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def ssd_round_time(t_v: float, t_p: float, t_b: float, p_hit: float, batch: int = 1,
                   transfer_s: float = 0.0) -> float:
    """Spec §6 expected SSD round time: hit max(T_v, T_p), miss max(T_v, T_p) + T_b (a dispatched
    tree cannot be cancelled); with batch b the all-hit probability is p_hit ** b. `transfer_s` adds
    the cross-mesh transfer (rows + outcome) that is on the critical path."""
    p = float(p_hit) ** int(batch)
    return max(t_v, t_p) + (1.0 - p) * t_b + transfer_s
