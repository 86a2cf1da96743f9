"""GGUF metadata -> an HF config.json-style dict (architecture, sizes, rope scaling).

llama3 rope scaling is stored by llama.cpp as a `rope_freqs` tensor of divisors; `_llama3_rope_scaling`
recovers HF's `rope_scaling` from it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.models.loading.gguf_reader import _tensor_array, _TensorInfo

__all__ = ["SUPPORTED_ARCHITECTURES"]

# GGUF general.architecture -> the HF class name written into the config's "architectures".
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}



# --------------------------------------------------------------------------------------------- config


def _f32(x: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _llama3_rope_scaling(freq_factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's precomputed `rope_freqs` divisors.

    llama.cpp bakes the llama3 scaling into one divisor per frequency. The divisors are 1 for high
    frequencies and `factor` for low ones, so `factor` is their maximum; the remaining parameters are
    the ones every Llama 3.x release uses, and we check that they reproduce the tensor exactly.
    """
    factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    for original in (8192, 4096, 16384, 32768, 131072):
        guess = {
            "rope_type": "llama3",
            "factor": _f32(factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original,
        }
        if np.allclose(_llama3_freq_factors(guess, rope_theta, head_dim), factors, rtol=1e-4, atol=1e-5):
            return guess
    raise ValueError(
        "the GGUF has a rope_freqs tensor that matches no llama3 rope scaling we can reconstruct "
        f"(max divisor {factor}); this rope scaling is not supported"
    )


def _llama3_freq_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama3 scaling applies (HF's formula, written as divisors)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen > low_wavelen, factor, 1.0)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    out = np.where(mid, 1.0 / ((1 - smooth) / factor + smooth), out)
    return out


def _config(meta: dict[str, Any], infos: list[_TensorInfo], data: np.ndarray, path: Path) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )

    def key(name, default=None, required=False):
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if required:
            raise ValueError(f"{path}: GGUF metadata lacks the required key {full!r}")
        return default

    tensors = {t.name: t for t in infos}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer lists appear in some hybrid models
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{path}: per-layer head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    vocab_rows = int(tensors["token_embd.weight"].shape[0])
    rope_theta = _f32(key("rope.freq_base", 10000.0))

    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        factor = key("rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{path}: rope scaling {scaling_type!r} without rope.scaling.factor")
        rope_scaling = {"rope_type": scaling_type, "factor": _f32(factor)}
        original = key("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: unsupported rope scaling type {scaling_type!r}")
    if "rope_freqs.weight" in tensors:
        if rope_scaling is not None:
            raise ValueError(f"{path}: both rope.scaling.type and a rope_freqs tensor; not supported")
        rope_scaling = _llama3_rope_scaling(_tensor_array(tensors["rope_freqs.weight"], data), rope_theta, head_dim)

    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "vocab_size": vocab_rows,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensors,
        "max_position_embeddings": int(key("context_length", 4096)),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2" and not config["attention_bias"]:
        raise ValueError(f"{path}: qwen2 GGUF without attention biases (blk.0.attn_q.bias)")
    if key("attention.sliding_window") is not None:
        config["sliding_window"] = int(key("attention.sliding_window"))
    return config

