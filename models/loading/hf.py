"""HF model folders (config.json + *.safetensors, sharded or not) -> (config dict, float32 numpy tensors).

Tensor names are the checkpoint's own, i.e. transformers' parameter names (`model.layers.0...`), in
HF shapes. Floating tensors come back as float32 (bf16 and fp16 included); integer tensors keep their
dtype. `lm_head.weight` is returned only when the embeddings are untied, as `load_gguf` does.

The safetensors container is read directly (an 8-byte header length, a JSON header, raw little-endian
data), so bf16 needs neither torch nor ml_dtypes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["load_hf_folder", "read_safetensors", "normalize_config", "read_config"]

_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}
_FLOATS = {"F64", "F32", "F16", "BF16"}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file; floating ones as float32."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path} is too short ({size} bytes) to be a safetensors file")
    with open(path, "rb") as f:
        header_len = int(np.frombuffer(f.read(8), dtype="<u8")[0])
        if header_len > size - 8:
            raise ValueError(f"{path} is corrupt or truncated: header of {header_len} bytes in a {size}-byte file")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is corrupt: unreadable safetensors header ({e})") from e
    header.pop("__metadata__", None)
    base = 8 + header_len
    data = np.memmap(path, dtype=np.uint8, mode="r") if size > base else np.zeros(0, np.uint8)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if base + end > size or begin > end:
            raise ValueError(f"{path} is truncated: tensor {name!r} needs bytes up to {base + end}, the file has {size}")
        arr = data[base + begin : base + end].view(_DTYPES[dtype])
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{path} is corrupt: tensor {name!r} has {arr.size} values for shape {shape}")
        if dtype == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        elif dtype in _FLOATS:
            arr = arr.astype(np.float32)
        else:
            arr = np.array(arr)
        out[name] = arr.reshape(shape)
    return out


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


def load_hf_folder(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json as a dict with defaults filled in, HF-named float32 tensors) of a HF model folder.

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

    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, arr in read_safetensors(file).items():
            if name in tensors:
                raise ValueError(f"{folder}: tensor {name!r} appears in more than one shard")
            tensors[name] = arr
    absent = sorted(set(weight_map) - tensors.keys())
    if absent:
        raise ValueError(f"{folder}: tensors listed in the index are absent from the shards: {absent[:6]}")

    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise ValueError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight")
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{folder}: no model.embed_tokens.weight among the tensors")
    config.setdefault("vocab_size", int(tensors["model.embed_tokens.weight"].shape[0]))
    return config, tensors
