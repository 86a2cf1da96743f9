"""ModelConfig: the static, hashable description of a decoder that `jit` takes as a static argument.

One decoder covers the families users bring: Llama 3.x (RoPE scaling), Qwen2/2.5 (qkv bias),
Qwen3 (per-head q/k RMSNorm); GQA; tied or untied embeddings; fp32 or bf16 weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")  # the values ModelConfig.arch accepts

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def canonical_dtype(name: str) -> str:
    """'fp32' / 'bf16' / ... -> 'float32' / 'bfloat16'; a clear error for anything else."""
    try:
        return _DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {name!r}: use one of float32/fp32 or bfloat16/bf16"
        ) from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The facts of one decoder-only transformer (frozen and hashable: `jit`'s static argument).

    arch: "llama" | "qwen2" | "qwen3" (HF's model_type).
    vocab_size: V, embedding (and lm-head) rows; may exceed the tokenizer's size (padded rows).
    hidden_size: the residual stream's width E. intermediate_size: the SwiGLU MLP's inner width.
    num_layers: decoder blocks. num_heads: H query heads. num_kv_heads: KVH key/value heads (GQA;
    H must be a multiple of KVH). head_dim: D, the width of one head (H * D need not equal E).
    rms_norm_eps: the epsilon of every RMSNorm. rope_theta: RoPE's base.
    rope_scaling: Llama-3 frequency scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position), or None for plain RoPE.
    qkv_bias: q/k/v projections have biases (Qwen2). qk_norm: per-head RMSNorm of q and k before
    RoPE (Qwen3). tie_embeddings: the lm head is the embedding matrix (no separate lm_head).
    max_position_embeddings: the longest context the model supports (the engine refuses more).
    dtype: the weights' and KV cache's dtype, "float32" or "bfloat16" (aliases accepted, stored
    canonical).
    """

    arch: str
    vocab_size: int  # embedding rows; may exceed the tokenizer's size (padded rows)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama-3 style scaling: (factor, low_freq_factor, high_freq_factor, original_max_position)
    rope_scaling: tuple[float, float, float, int] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unknown architecture {self.arch!r}: ssd_jax supports {', '.join(SUPPORTED_ARCHS)}"
            )
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        """H / KVH: query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **kw) -> "ModelConfig":
        """A copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **kw)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies `[D // 2]` float32 numpy, with Llama-3 scaling applied
        (host-side, static)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_scaling is not None:
            factor, low, high, old_ctx = self.rope_scaling
            low_wavelen = old_ctx / low
            high_wavelen = old_ctx / high
            wavelen = 2 * np.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], dtype: str = "float32") -> "ModelConfig":
        """Build from a HF `config.json` dict (also what the GGUF loader produces); `dtype` is the
        dtype to hold the weights in, not the checkpoint's. Raises ValueError for an unsupported
        architecture or rope scaling."""
        model_type = str(hf.get("model_type", "")).lower()
        if model_type not in SUPPORTED_ARCHS:
            archs = hf.get("architectures") or []
            raise ValueError(
                f"unknown architecture model_type={model_type!r} {archs}: "
                f"ssd_jax supports {', '.join(SUPPORTED_ARCHS)}"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = float(hf.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0)
        rope_scaling = None
        if scaling and str(scaling.get("rope_type", scaling.get("type", ""))) == "llama3":
            rope_scaling = (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        elif scaling and str(scaling.get("rope_type", scaling.get("type", "default"))) not in ("default", ""):
            raise ValueError(f"unsupported rope scaling {scaling!r}: only llama3 scaling is implemented")
        qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        return cls(
            arch=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            dtype=dtype,
        )

    def to_hf(self) -> dict:
        """The HF config.json dict of this config (used to build oracle models in tests)."""
        d = {
            "model_type": self.arch,
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM"}[self.arch]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
        }
        if self.arch == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = False
        if self.rope_scaling is not None:
            f, lo, hi, old = self.rope_scaling
            d["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                 "high_freq_factor": hi, "original_max_position_embeddings": old}
        return d


# A pytree node with no leaves (the config rides in the treedef, compared by ==): so
# `jax.jit(forward)(params, cfg, tokens, cache)` treats cfg as static without static_argnames.
jax.tree_util.register_static(ModelConfig)


def tiny_config(arch: str = "qwen2", vocab_size: int = 64, **kw) -> ModelConfig:
    """A tiny config for random-init models in tests and notebooks (`kw` overrides any field);
    llama gets a Llama-3 rope scaling so that path is exercised."""
    base = dict(
        arch=arch, vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        qkv_bias=(arch == "qwen2"), qk_norm=(arch == "qwen3"), tie_embeddings=False,
        max_position_embeddings=2048,
    )
    if arch == "llama":
        base["rope_scaling"] = (8.0, 1.0, 4.0, 64)
    base.update(kw)
    return ModelConfig(**base)
