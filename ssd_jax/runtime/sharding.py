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

The layout itself lives in `ssd_jax.models.tp` (so `load_model(..., sharding=mesh)` builds each
leaf straight into it); this module places params already loaded and the target's KV cache.
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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache, init_cache
from ssd_jax.models.params import LayerParams, Params, trim_host
from ssd_jax.models.quant import is_quantized
from ssd_jax.models.tp import TP_AXIS, leaf_spec, mesh_degree, placer, relayout, tp_config, undo  # noqa: F401

DP_AXIS = "data"


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _fields(params: Params, fn) -> Params:
    """`params` with each array leaf replaced by fn(field name, leaf) (None leaves kept)."""
    def layer(lp: LayerParams) -> LayerParams:
        return LayerParams(**{f.name: None if getattr(lp, f.name) is None else fn(f.name, getattr(lp, f.name))
                              for f in dataclasses.fields(LayerParams)})
    return Params(embed=fn("embed", params.embed), layers=tuple(layer(lp) for lp in params.layers),
                  final_norm=fn("final_norm", params.final_norm),
                  lm_head=None if params.lm_head is None else fn("lm_head", params.lm_head),
                  tp_groups=params.tp_groups)


def tp_layout(params: Params, cfg: ModelConfig, tp: int) -> tuple[ModelConfig, Params]:
    """Host-side (numpy) re-layout of logical `params` for TP degree `tp`; returns (config,
    params with `tp_groups = tp`)."""
    if is_quantized(params):
        raise ValueError("tensor-parallel placement takes unquantized params: int8 weights "
                         "(models/quant.py) are for a single-device draft")
    tcfg = tp_config(cfg, tp)
    return tcfg, _fields(params, lambda f, x: relayout(f, _np(x), cfg, tp)).replace(tp_groups=tp)


def param_specs(params: Params, tp: int) -> Params:
    """PartitionSpecs (a Params-shaped pytree) of the TP layout (`ssd_jax.models.tp`)."""
    return _fields(params, lambda f, x: leaf_spec(f, x.shape, tp))


def _leaf_placer(params: Params, cfg: ModelConfig, mesh: Mesh):
    """(config of the placed weights, tp, place(field, leaf)) for putting `params` on `mesh`."""
    tp, had = mesh_degree(mesh), params.tp_groups
    if had == tp:
        return cfg, tp, lambda f, x: jax.device_put(
            x, NamedSharding(mesh, leaf_spec(f, x.shape, tp) if tp > 1 else P()))
    if is_quantized(params):
        raise ValueError("tensor-parallel placement takes unquantized params: int8 weights "
                         "(models/quant.py) are for a single-device draft")

    def logical(f, x):  # another degree's layout back to checkpoint order, on the host
        return undo(f, _np(x), cfg, had)

    if tp == 1:
        return cfg, 1, lambda f, x: jax.device_put(logical(f, x), NamedSharding(mesh, P()))
    _, tcfg, put = placer(mesh, cfg)
    return tcfg, tp, lambda f, x: put(f, logical(f, x))


def shard_target(params: Params, cfg: ModelConfig, mesh: Mesh) -> tuple[ModelConfig, Params]:
    """Re-lay out and place the target's weights on `mesh` (axis `model`, degree mesh.size),
    one leaf at a time.

    Logical params (`tp_groups` 1) are re-laid out per leaf on the host and each device receives
    only its shard (`ssd_jax.models.tp.placer`); params already in this degree's layout (loaded
    with `load_model(..., sharding=mesh)`, or an engine's) are only moved where they are not in
    place yet (a leaf already there is not copied), with `cfg` returned as is. With a 1-device
    mesh the weights are placed unchanged. Another degree's layout is a ValueError."""
    tcfg, tp, put = _leaf_placer(params, cfg, mesh)
    return tcfg, _fields(params, put).replace(tp_groups=tp)


def consume(model, put, prepare, tp_groups: int | None = None) -> Params:
    """`model.params` placed (`put(field, leaf)`) and laid out by a backend's `prepare`, taken
    from `model`: the embedding and head first, then one layer at a time, `model.params` pointed
    at the result after each, so the un-prepared arrays are released as they are replaced (when
    nothing else holds them) and the devices never hold the model twice. `prepare` sees a Params
    of the (prepared) embedding and head and one layer: a layout pass is layer-local and leaves
    what it already laid out as it is (`ssd_jax.models.ops`). Returns the laid-out params, which
    `model.params` now is."""
    params = model.params
    tp = params.tp_groups if tp_groups is None else tp_groups
    outer = prepare(_fields(params.replace(layers=()), put).replace(tp_groups=tp))
    layers = list(params.layers)
    del params  # from here only `layers` and `model.params` hold the un-prepared layers
    model.params = outer.replace(layers=tuple(layers))
    for i, lp in enumerate(layers):
        placed = _fields(outer.replace(layers=(lp,)), lambda f, x: x if f in _OUTER else put(f, x))
        outer = prepare(placed)
        layers[i] = outer.layers[0]
        outer = outer.replace(layers=())
        model.params = outer.replace(layers=tuple(layers))
        del placed, lp
        trim_host()  # on a CPU the devices' memory is the host's: hand the freed layer back
    return model.params


_OUTER = ("embed", "final_norm", "lm_head")


def take_target(model, mesh: Mesh, prepare) -> tuple[ModelConfig, Params]:
    """The target `model`'s weights on `mesh` (`shard_target`'s layout) and laid out by
    `prepare`, consumed from `model` (`consume`): afterwards `model.params` and `model.cfg` are
    the laid-out weights and their config, and the devices held one copy of the model
    throughout (a tensor-parallel re-layout of logical params holds one more layer)."""
    tcfg, tp, put = _leaf_placer(model.params, model.cfg, mesh)
    params = consume(model, put, prepare, tp)
    model.cfg = tcfg
    return tcfg, params


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
