"""GGUF files -> (HF-style config dict, HF-named tensors read lazily from the memory map).

Only what the project runs is supported: the `llama`, `qwen2` and `qwen3` architectures of llama.cpp.

Two things differ from a transformers checkpoint besides the names:

* GGUF lists tensor dimensions fastest-first (ggml order), so `[in, out]` in the file is `[out, in]` as
  a numpy array, which is the HF order.
* llama.cpp's converter reorders the rows of the q and k projections of `llama` checkpoints, per head,
  from HF's "rotate half" rotary layout to its interleaved-pairs layout: within each head of size d,
  row `i*2 + j` of the file is HF row `j*(d/2) + i`. We undo that. Qwen2/Qwen3 are not reordered by
  the converter (llama.cpp runs them with the NEOX rotary layout, which is HF's). tests/real_weights/test_loading.py
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

# _llama3_freq_factors is re-exported for tests/real_weights/test_loading.py.
from ssd_jax.models.loading.gguf_config import SUPPORTED_ARCHITECTURES, _config, _llama3_freq_factors  # noqa: F401
from ssd_jax.models.loading.gguf_layout import (_NON_PARAMETER_TENSORS, _PERMUTED_QK, _expected_names, _hf_name,
                                                _permuted_rows)
from ssd_jax.models.loading.gguf_reader import _parse, _tensor_rows, read_gguf_metadata
from ssd_jax.models.loading.source import TensorSource

__all__ = ["load_gguf", "load_gguf_config", "read_gguf_metadata", "GGUFSource", "SUPPORTED_ARCHITECTURES"]


def load_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Only the HF-style config of a GGUF file (as `load_gguf` returns it), without reading weights."""
    meta, infos, data = _parse(path)
    return _config(meta, infos, data, Path(path))


class GGUFSource(TensorSource):
    """A GGUF file's parameter tensors under HF names, read from its memory map a block of rows at
    a time: dequantised (`gguf.quants.dequantize`) to float32, llama's q/k rows un-permuted."""

    def __init__(self, path: Path, infos, data, config: dict[str, Any]):
        self.path, self._data = path, data
        self._heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
        permute = config["model_type"] in _PERMUTED_QK
        self._infos, self._permuted = {}, set()
        for t in infos:
            if t.name in _NON_PARAMETER_TENSORS:
                continue
            hf = _hf_name(t.name, config["num_hidden_layers"])
            if hf is None:
                raise ValueError(f"{path}: unexpected tensor {t.name!r} for architecture {config['model_type']!r}")
            self._infos[hf] = t
            if permute and (".attn_q." in t.name or ".attn_k." in t.name):
                self._permuted.add(hf)

    def names(self) -> list[str]:
        """The parameter tensors' HF names (from the header)."""
        return list(self._infos)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in HF order (from the header)."""
        return self._infos[name].shape

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of axis 0 as float32 (only their bytes read)."""
        t = self._infos[name]
        which = None
        if name in self._permuted:
            which = _permuted_rows(t.shape[0], self._heads["q" if ".q_proj." in name else "k"])[start:stop]
        return _tensor_rows(t, self._data, start, stop, which)


def load_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], GGUFSource]:
    """Open a llama/qwen2/qwen3 GGUF: (HF config.json-style dict, a `GGUFSource`: HF names ->
    float32 tensors, each read from the memory map when asked for).

    Quantized tensors are dequantized with `gguf.quants.dequantize`; llama q/k rows are un-permuted.
    `lm_head.weight` is present only when the file has its own output matrix (`tie_word_embeddings`
    is False). Raises ValueError for a corrupt or truncated file, an unsupported architecture or a
    missing tensor, before any tensor data is read.
    """
    path = Path(path)
    meta, infos, data = _parse(path)
    config = _config(meta, infos, data, path)
    tensors = GGUFSource(path, infos, data, config)
    missing = sorted(_expected_names(config) - set(tensors))
    if missing:
        raise ValueError(f"{path}: GGUF lacks tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    return config, tensors
