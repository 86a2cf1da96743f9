"""Pallas GPU kernels for SSD (Triton backend), each with a plain-jnp reference beside it.

  * `cache_attention`: a few new tokens' cache write and attention in one launch (decode, verify,
    the draft chain); its reference is `ssd_jax.models.ops.xla_attend`.
  * `add_norm`: one row's residual add and RMSNorm in one launch; its reference is
    `ssd_jax.models.ops.xla_add_norm`.
  * `tree_attention` / `tree_attention_reference`: the draft's branch write and decode attention.
  * `cache_gather` / `cache_gather_reference`: the outcome-conditioned speculation-cache lookup.

Kernels take arrays and static sizes only (nothing from ssd_jax/ or models/). On the CPU run them
with `interpret=True`. See pallas_kernels/BENCHMARKS.md for the GPU benchmark.
"""
from ssd_jax.pallas_kernels.add_norm import add_norm
from ssd_jax.pallas_kernels.cache_attention import cache_attention
from ssd_jax.pallas_kernels.cache_gather import cache_gather, cache_gather_reference
from ssd_jax.pallas_kernels.tree_attention import (tree_attention, tree_attention_reference,
                                           tree_attention_xla)

__all__ = ["add_norm", "cache_attention", "cache_gather", "cache_gather_reference",
           "tree_attention", "tree_attention_reference", "tree_attention_xla"]
