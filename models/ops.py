"""The backend table: the named ops the forward calls, and the plain-XLA reference of each.

`forward` and `tree_step` (models/transformer.py) never call a kernel by name; they call
`ops.dense`, `ops.attend`, `ops.swiglu`, `ops.add_norm` and `ops.tree_attention` of the `Ops` they
are given, and the speculation cache's lookup calls `ops.cache_gather`. An `Ops` is a frozen
dataclass of functions, so it is hashable and goes to `jax.jit` as a static argument: choosing a
backend is choosing a table, once per mesh (`ssd_jax.models.backends.select`), never a flag
inside the model.

`XLA` below is the reference table: plain `jnp` on every platform, differentiable, and what the
other backends are tested against. A backend replaces some entries and supplies `prepare`, its
layout pass over logical params (models/weights.py), applied once after placement.

Op signatures (shapes per sequence batch B, new tokens T, heads H, kv heads KVH, head dim D):

- `dense(x [..., K], w, *, transpose_w=False, preferred_element_type=None) -> [..., N]`: w an
  array [K, N] ([N, K] with `transpose_w`), a logical `Int8Weight` / `Int4Weight`, or a layout of
  the backend's own `prepare`.
- `attend(q [B, T, H, D], k_new, v_new [B, T, KVH, D], positions [B, T], k_cache, v_cache
  [B, S, KVH, D], *, window) -> (out [B, T, H*D], k_cache, v_cache)`: write the new rows at their
  positions (dropped past the cache), then attend over slots s <= position and s < window.
- `swiglu(gate_up [..., 2I]) -> [..., I]`: silu(gate) * up, gate columns first.
- `add_norm(x [..., E], delta [..., E], w [E], *, eps) -> (x + delta, rms_norm(x + delta, w))`:
  the residual add and the RMSNorm after it (the next block's input).
- `tree_attention(q [B, MQ, H, D], k_new, v_new [B, MQ, KVH, D], k_cache, v_cache [B, S, KVH, D],
  prefix_len [B, MQ], branch_k, branch_v [B, MQ, K, KVH, D], step, valid [B, MQ], *, window)
  -> (out [B, MQ, H, D], branch_k, branch_v)`: write the new rows at entry `step` of the branch
  buffers, then attend each branch's query over cache slots < prefix_len (and < window) and its
  own entries 0..step. A `step` that is the Python int 0 is a tree's first step: the branch KV
  comes back as new buffers, the new rows at entry 0 and zeros after, whatever the given ones
  held (`pallas_kernels.tree_attention.write_branch`); an op may read the given buffers' shape
  only.
- `cache_gather(keys [B, MQ, 2], valid [B, MQ], tokens [B, MQ, K], rows [B, MQ, K, V],
  outcome [B, 2]) -> (hit [B], index [B], tokens [B, K], rows [B, K, V])`.
- `prepare(params) -> params`: layer-local, and leaving what it already laid out as it is: the
  engine calls it on the embedding and head, then on them with one layer at a time, so the
  un-prepared weights are released as it goes (one copy on the device). A layout class must not
  equal, as a pytree node, the weight it replaces: on JAX 0.10.2 two dataclass nodes with as many
  children compare equal whatever their classes, and jit may then run one's program on the other
  (give the layout a static field, as models/cpu/layouts.py does; tests/unit/test_pytree_nodes.py).

Two hints travel with a table, for choosing defaults (`ssd_jax.models.backends.defaults`):
`fast_dtypes`, the weight dtypes its ops run fastest in, best first; `fast_quant`, the draft
weight formats ("none", "int8", "int4") that have a fast path in it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax.models.weights import Int4Weight, Int8Weight

_NEG_INF = -1e30


def xla_dense(x: jax.Array, w, *, transpose_w: bool = False,
              preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] (w [N, K] with `transpose_w`) -> [..., N] in x's dtype (or
    `preferred_element_type`); a quantized w is dequantized to fp32 first."""
    out_dtype = x.dtype if preferred_element_type is None else preferred_element_type
    if isinstance(w, (Int8Weight, Int4Weight)):
        if transpose_w:
            raise ValueError("a quantized weight is always [K, N]: transpose_w does not apply")
        out = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w.dequantize(jnp.float32))
        return out.astype(out_dtype)
    if not isinstance(w, jax.Array) and not hasattr(w, "__array__"):
        raise TypeError(f"the xla backend takes dense weights as arrays, Int8Weight or Int4Weight; "
                        f"got {type(w).__name__}, a layout of another backend (an Engine took "
                        f"the Model over): pass model.logical_params(), or call forward with the "
                        f"ops of the backend whose `prepare` made it")
    return jnp.einsum("...k,nk->...n" if transpose_w else "...k,kn->...n", x, w,
                      preferred_element_type=preferred_element_type).astype(out_dtype)


@functools.partial(jax.vmap, in_axes=(0, 0, 0))
def write_kv(c, positions, new):
    """c[b, positions[b, t]] = new[b, t] (slots past the buffer dropped). Written per sequence with
    `vmap`, so the scatter carries the batch as a batching dimension: a cache sharded over the batch
    (data-parallel draft) is updated on each shard without gathering the new KV across devices."""
    return c.at[positions].set(new.astype(c.dtype), mode="drop")


def cache_attention(q, k, v, positions):
    """q [B, T, H, D] at positions [B, T] over cache k, v [B, W, KVH, D]: slot s visible iff
    s <= pos. fp32 logits scaled by D^-0.5, fp32 softmax, probabilities rounded to the cache dtype,
    p @ v summed in fp32. Returns [B, T, H * D] in q's dtype."""
    B, T, H, D = q.shape
    W, KVH = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, KVH, H // KVH, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = s * (D ** -0.5)
    mask = jnp.arange(W)[None, None, :] <= positions[:, :, None]  # [B, T, W]
    s = jnp.where(mask[:, None, None], s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H * D).astype(q.dtype)


def xla_attend(q, k_new, v_new, positions, k_cache, v_cache, *, window: int | None = None):
    """`write_kv` the new rows, then `cache_attention` over the first `window` slots (default
    all). Returns (out [B, T, H * D], k_cache, v_cache)."""
    W = k_cache.shape[1] if window is None else window
    k_cache = write_kv(k_cache, positions, k_new)
    v_cache = write_kv(v_cache, positions, v_new)
    return cache_attention(q, k_cache[:, :W], v_cache[:, :W], positions), k_cache, v_cache


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [..., E] normalised by its root mean square (in fp32), cast back, scaled by w [E]."""
    # As HF: normalise in fp32, cast back, then scale (the order matters in bf16).
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def xla_add_norm(x: jax.Array, delta: jax.Array, w: jax.Array, *, eps: float):
    """(y, rms_norm(y, w, eps)) with y = x + delta [..., E]: a residual add and the norm of the
    next block's input."""
    y = x + delta
    return y, rms_norm(y, w, eps)


def xla_swiglu(gate_up: jax.Array) -> jax.Array:
    """gate_up [..., 2I] -> silu(gate_up[..., :I]) * gate_up[..., I:], [..., I]."""
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] (gate columns, then up), got shape "
                         f"{list(gate_up.shape)}")
    I = gate_up.shape[-1] // 2
    return jax.nn.silu(gate_up[..., :I]) * gate_up[..., I:]


def xla_tree_attention(q, k_new, v_new, k_cache, v_cache, prefix_len, branch_k, branch_v, step,
                       valid, *, window: int | None = None):
    """The branch write (`ssd_jax.pallas_kernels.tree_attention.write_branch`), then the plain-jnp
    tree attention (`tree_attention_reference`) over the first `window` slots (default all).
    Returns (out [B, MQ, H, D], branch_k, branch_v)."""
    from ssd_jax.pallas_kernels.tree_attention import tree_attention_reference, write_branch
    W = k_cache.shape[1] if window is None else window
    branch_k, branch_v = write_branch(branch_k, branch_v, k_new, v_new, step)
    out = tree_attention_reference(q, k_cache[:, :W], v_cache[:, :W], prefix_len, branch_k,
                                   branch_v, step, valid)
    return out, branch_k, branch_v


def xla_cache_gather(*args):
    """The plain-jnp outcome-conditioned gather (`ssd_jax.pallas_kernels.cache_gather_reference`)."""
    from ssd_jax.pallas_kernels.cache_gather import cache_gather_reference
    return cache_gather_reference(*args)


def identity(params):
    """The reference `prepare`: the logical weights as they are. A weight another backend laid
    out (it has `.logical()`: an engine of that backend took the Model over first) goes back to
    its logical value, so one Model serves engines of two backends in turn."""
    return jax.tree_util.tree_map(lambda w: w.logical() if hasattr(w, "logical") else w, params,
                                  is_leaf=lambda w: hasattr(w, "logical"))


@dataclasses.dataclass(frozen=True)
class Ops:
    """One backend's implementation of each named op (module docstring). Frozen and made of plain
    functions, so hashable: pass it to `jax.jit` as a static argument. `dataclasses.replace` a
    field to swap one op (a kernel under test, a planted bug)."""
    name: str = "xla"
    dense: Callable = xla_dense
    attend: Callable = xla_attend
    swiglu: Callable = xla_swiglu
    add_norm: Callable = xla_add_norm
    tree_attention: Callable = xla_tree_attention
    cache_gather: Callable = xla_cache_gather
    prepare: Callable = identity
    fast_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    fast_quant: tuple[str, ...] = ("none",)
    # the custom-call targets this table's ops lower to (other than JAX's own): what
    # `jax.export` may keep in a stored step (ssd_jax/algorithm/aot.py)
    custom_calls: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Ops({self.name!r})"


XLA = Ops()

__all__ = ["XLA", "Ops", "cache_attention", "identity", "rms_norm", "write_kv", "xla_add_norm",
           "xla_attend", "xla_cache_gather", "xla_dense", "xla_swiglu", "xla_tree_attention"]
