"""HF model folders (config.json + *.safetensors, sharded or not) -> (config dict, a TensorSource).

Tensor names are the checkpoint's own, i.e. transformers' parameter names (`model.layers.0...`), in
HF shapes. The files are read with the `safetensors` library (`safe_open`, memory-mapped): nothing
is read until a tensor is asked for, and then one tensor, or a range of its rows, as float32
(bf16 and fp16 included; `safetensors` hands bf16 to numpy as ml_dtypes.bfloat16). `lm_head.weight`
is listed only when the embeddings are untied, as `load_gguf` does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy: safetensors' numpy slices name it)
import numpy as np

from ssd_jax.models.loading.source import TensorSource

__all__ = ["load_hf_folder", "SafetensorsSource", "normalize_config", "read_config"]

_FLOATS = {"F64", "F32", "F16", "BF16"}


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{path} is corrupt or truncated: not a readable safetensors file ({e})") from None


class SafetensorsSource(TensorSource):
    """The tensors of one or more .safetensors files (`safe_open`, memory-mapped), each read on
    demand (the file mapped for that read only); names appearing in two files are a ValueError
    naming the tensor."""

    def __init__(self, files: list[Path], drop: tuple[str, ...] = ()):
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for file in files:
            with _open(file) as f:
                for name in f.keys():
                    if name in drop:
                        continue
                    if name in self._where:
                        raise ValueError(f"{file.parent}: tensor {name!r} appears in more than one shard")
                    sl = f.get_slice(name)
                    dtype, shape = sl.get_dtype(), tuple(int(d) for d in sl.get_shape())
                    if dtype not in _FLOATS:
                        raise ValueError(f"{file}: tensor {name!r} has dtype {dtype}; weights must "
                                         f"be floating ({', '.join(sorted(_FLOATS))})")
                    self._where[name] = file
                    self._meta[name] = (dtype, shape)

    def names(self) -> list[str]:
        """The parameter tensors' HF names (from the header)."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in HF order (from the header)."""
        return self._meta[name][1]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of axis 0 as float32 (only their bytes read)."""
        from safetensors import SafetensorError

        file, shape = self._where[name], self.shape(name)
        try:
            # opened per read: closing unmaps the file, so its pages leave this process's RSS
            with _open(file) as f:
                a = np.asarray(f.get_slice(name)[start:stop] if shape else f.get_tensor(name))
        except SafetensorError as e:
            raise ValueError(f"{file}: tensor {name!r} is unreadable (corrupt or truncated: {e})") from None
        return a.astype(np.float32, copy=False).reshape(-1, *shape[1:])


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill the keys the model code relies on when a config.json leaves them to class defaults."""
    c = dict(config)
    if "hidden_size" not in c or "num_attention_heads" not in c:
        raise ValueError("config.json lacks hidden_size or num_attention_heads")
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    rope_parameters = c.get("rope_parameters") or {}
    if "rope_theta" not in c:  # transformers 5 writes rope_theta/rope_scaling into rope_parameters
        c["rope_theta"] = rope_parameters.get("rope_theta", 10000.0)
    if "rope_scaling" not in c:
        kind = rope_parameters.get("rope_type", "default")
        c["rope_scaling"] = None if kind == "default" else {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    c.setdefault("rms_norm_eps", 1e-6)
    c.setdefault("tie_word_embeddings", False)
    c.setdefault("hidden_act", "silu")
    c.setdefault("attention_bias", c.get("model_type") == "qwen2")
    return c


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's config.json, normalized; a ValueError naming the file (by its absolute path)
    if it is not JSON or lacks the model's dimensions."""
    config_file = Path(folder).absolute() / "config.json"
    try:
        with open(config_file, encoding="utf-8") as f:
            return normalize_config(json.load(f))
    except ValueError as e:  # not JSON, not UTF-8, or lacking the model's dimensions
        raise ValueError(f"{config_file}: {e}") from e


def load_hf_folder(path: str | os.PathLike) -> tuple[dict[str, Any], SafetensorsSource]:
    """(config.json as a dict with defaults filled in, its tensors as a `SafetensorsSource`: HF
    names -> float32, each read when asked for) of a HF model folder.

    Reads `model.safetensors.index.json` when present (only the shards it names), otherwise every
    `*.safetensors` in the folder. Raises FileNotFoundError naming what is missing.
    """
    folder = Path(path).absolute()  # errors name the folder, even when given as "."
    if not folder.is_dir():
        raise FileNotFoundError(f"HF model folder not found: {folder}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; it is not a HF model folder")
    config = read_config(folder)

    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        with open(index_file, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards named in {index_file.name} are missing: {missing}")
        files = [folder / s for s in shards]
    else:
        weight_map = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in folder.glob("*.bin"))
            hint = f" (found {bins}: convert them to safetensors)" if bins else ""
            raise FileNotFoundError(f"{folder} has no *.safetensors weights{hint}")

    drop = ("lm_head.weight",) if config["tie_word_embeddings"] else ()
    tensors = SafetensorsSource(files, drop)
    absent = sorted(set(weight_map) - set(tensors) - set(drop))
    if absent:
        raise ValueError(f"{folder}: tensors listed in the index are absent from the shards: {absent[:6]}")
    if not config["tie_word_embeddings"] and "lm_head.weight" not in tensors:
        raise ValueError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight")
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{folder}: no model.embed_tokens.weight among the tensors")
    config.setdefault("vocab_size", int(tensors.shape("model.embed_tokens.weight")[0]))
    return config, tensors
