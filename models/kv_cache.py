"""KV cache: one static-shape buffer pair per layer plus per-sequence lengths.

Slot s of a sequence's cache holds the KV of the token at position s. A forward over T new tokens
writes them at slots `lengths .. lengths+T-1` and each query attends to slots <= its own position, so
stale KV past the length (a rejected speculation) is masked until it is overwritten. Rollback is
therefore just a new `lengths` — no copies.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ssd_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """Every layer's KV of a batch (a pytree): k and v, per layer `[B, S, KVH, D]` (S slots), and
    lengths `[B]` int32, the committed slots of each sequence."""

    k: tuple[jax.Array, ...]  # per layer [B, S, KVH, D]
    v: tuple[jax.Array, ...]  # per layer [B, S, KVH, D]
    lengths: jax.Array  # [B] int32: slots 0..lengths-1 hold committed KV

    @property
    def batch(self) -> int:
        """B, the sequences."""
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """S, the slots per sequence."""
        return self.k[0].shape[1]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """Rollback / commit: the same buffers with lengths `[B]` as the new length pointers (the
        KV past them becomes stale)."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None, sharding=None) -> KVCache:
    """An empty cache: zeros `[B, S, KVH, D]` per layer (B = batch, S = max_len) in `dtype` (default
    cfg.dtype), lengths `[B]` = 0, every array placed with `sharding` when given."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)

    def zeros():
        z = jnp.zeros(shape, dtype)
        return z if sharding is None else jax.device_put(z, sharding)

    lengths = jnp.zeros((batch,), jnp.int32)
    if sharding is not None:
        lengths = jax.device_put(lengths, sharding)
    return KVCache(k=tuple(zeros() for _ in range(cfg.num_layers)),
                   v=tuple(zeros() for _ in range(cfg.num_layers)), lengths=lengths)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> int:
    """Bytes of the k and v buffers of `init_cache(cfg, batch, max_len)` in cfg.dtype."""
    return 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
