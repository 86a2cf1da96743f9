"""GGUF files -> (HF-style config dict, HF-named float32 numpy tensors).

Only what the project runs is supported: the `llama`, `qwen2` and `qwen3` architectures of llama.cpp.

Two things differ from a transformers checkpoint besides the names:

* GGUF lists tensor dimensions fastest-first (ggml order), so `[in, out]` in the file is `[out, in]` as
  a numpy array, which is the HF order.
* llama.cpp's converter reorders the rows of the q and k projections of `llama` checkpoints, per head,
  from HF's "rotate half" rotary layout to its interleaved-pairs layout: within each head of size d,
  row `i*2 + j` of the file is HF row `j*(d/2) + i`. We undo that. Qwen2/Qwen3 are not reordered by
  the converter (llama.cpp runs them with the NEOX rotary layout, which is HF's). tests/test_loading.py
  settles both by the model's own next-token loss on real text: un-permuting gives the lower loss for
  SmolLM2 (llama), keeping the stored order the lower one for Qwen2.5-Coder-0.5B.

Layout: gguf_reader.py (the container and dequantisation), gguf_config.py (metadata -> config),
gguf_layout.py (GGUF -> HF tensor names, the q/k un-permute); this module assembles them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

# _llama3_freq_factors is re-exported for tests/test_loading.py.
from ssd_jax.models.loading.gguf_config import SUPPORTED_ARCHITECTURES, _config, _llama3_freq_factors  # noqa: F401
from ssd_jax.models.loading.gguf_layout import (_NON_PARAMETER_TENSORS, _PERMUTED_QK, _expected_names, _hf_name,
                                                _unpermute_rows)
from ssd_jax.models.loading.gguf_reader import _parse, _tensor_array, read_gguf_metadata

__all__ = ["load_gguf", "load_gguf_config", "read_gguf_metadata", "SUPPORTED_ARCHITECTURES"]


def load_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Only the HF-style config of a GGUF file (as `load_gguf` returns it), without reading weights."""
    meta, infos, data = _parse(path)
    return _config(meta, infos, data, Path(path))


def load_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a llama/qwen2/qwen3 GGUF: (HF config.json-style dict, HF-named float32 tensors).

    Quantized tensors are dequantized with `gguf.quants.dequantize`; llama q/k rows are un-permuted.
    `lm_head.weight` is present only when the file has its own output matrix (`tie_word_embeddings`
    is False). Raises ValueError for a corrupt or truncated file or an unsupported architecture.
    """
    path = Path(path)
    meta, infos, data = _parse(path)
    config = _config(meta, infos, data, path)
    n_layers = config["num_hidden_layers"]
    permute = config["model_type"] in _PERMUTED_QK

    tensors: dict[str, np.ndarray] = {}
    for t in infos:
        if t.name in _NON_PARAMETER_TENSORS:
            continue
        hf = _hf_name(t.name, n_layers)
        if hf is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for architecture {config['model_type']!r}")
        arr = _tensor_array(t, data)
        if permute and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config["num_attention_heads"] if ".attn_q." in t.name else config["num_key_value_heads"]
            arr = _unpermute_rows(arr, heads)
        tensors[hf] = arr

    expected = _expected_names(config)
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"{path}: GGUF lacks tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    return config, tensors
