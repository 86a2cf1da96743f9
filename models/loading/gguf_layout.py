"""How GGUF tensors map onto HF's: the name map, the names a checkpoint must hold, and llama's q/k rows.

llama.cpp's converter reorders the q and k rows of `llama` checkpoints per head (rotate-half ->
interleaved pairs); `_permuted_rows` undoes it (an index of the file's rows). See ssd_jax.models.loading.gguf for which
architectures are permuted and how that was settled.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_QK = {"llama"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that carry no HF parameter (read for the config instead).
_NON_PARAMETER_TENSORS = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _permuted_rows(rows: int, n_heads: int) -> np.ndarray:
    """For each HF q/k row, the file row holding it: llama.cpp's per-head order (pairs
    interleaved) undone, file row (h, i, j) with j the pair member -> HF row (h, j, i)."""
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} q/k rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(rows)


def _hf_name(name: str, n_layers: int) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_TENSORS and int(m.group(1)) < n_layers:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


def _expected_names(config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    parts = ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    parts += [f"self_attn.{p}_proj" for p in "qkvo"]
    if config["model_type"] == "qwen3":
        parts += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{p}.weight" for p in parts)
        if config["attention_bias"]:
            names.update(f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv")
    return names
