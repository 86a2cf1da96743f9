"""Rotary position embeddings (rotate-half, the convention of HF Llama and Qwen), as two plain
functions: the cos / sin tables of some positions, and the rotation of heads by them. Split so
that a forward computes the tables once per call and the CPU attention kernel
(models/cpu_attention.py `attend_qkv`) can rotate inside the kernel with the same tables."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tables(positions: jax.Array, cfg, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [...] -> cos, sin [..., D / 2] in `dtype` (angles in fp32, `cfg.inv_freq()`
    carries the family's RoPE scaling)."""
    ang = positions[..., None].astype(jnp.float32) * jnp.asarray(cfg.inv_freq())
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., N, D] rotated by cos, sin [..., D / 2] (shared by the N heads):
    [x1 c - x2 s, x2 c + x1 s] for the halves x1, x2 of each head."""
    cos, sin = cos[..., None, :], sin[..., None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


__all__ = ["rotate", "tables"]
