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
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["load_gguf", "load_gguf_config", "read_gguf_metadata", "SUPPORTED_ARCHITECTURES"]

# GGUF general.architecture -> the HF class name written into the config's "architectures".
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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


# -------------------------------------------------------------------------------------------- reading
# Our own reader of the GGUF container (v2/v3, little-endian): a header of key/value metadata, then
# tensor infos, then aligned tensor data. It reads each numeric array with one `np.frombuffer`, where
# gguf.GGUFReader builds one numpy view per element (slow for a vocabulary's arrays), and it checks
# every bound so a truncated file gives a clear error.

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRUCT = {"<u1": "<B", "<i1": "<b", "<u2": "<H", "<i2": "<h", "<u4": "<I", "<i4": "<i", "<f4": "<f",
           "<u8": "<Q", "<i8": "<q", "<f8": "<d"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy (= HF) order, i.e. the file's dimensions reversed
    ggml_type: int
    offset: int  # absolute, in the file
    n_bytes: int


class _Truncated(Exception):
    pass


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(f"needs {n} bytes at offset {self.pos}, the file has {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        code = _STRUCT[fmt]
        return struct.unpack_from(code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        n = self.scalar("<u8")
        return bytes(self.take(n)).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<u4"), self.scalar("<u8")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt = _SCALARS.get(etype)
            if fmt is None:
                raise ValueError(f"unknown GGUF value type {etype}")
            arr = np.frombuffer(self.take(count * np.dtype(fmt).itemsize), dtype=fmt)
            return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        v = self.scalar(fmt)
        return bool(v) if vtype == _BOOL else v


def _parse(path: str | os.PathLike, with_tensors: bool = True):
    """(metadata dict, list of _TensorInfo, memmap of the file) or a ValueError naming the problem."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path} is too short ({size} bytes) to be a GGUF file")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    try:
        magic = bytes(cur.take(4))
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
        version = cur.scalar("<u4")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (expected 2 or 3; big-endian files are not supported)")
        n_tensors, n_kv = cur.scalar("<u8"), cur.scalar("<u8")
        if n_tensors > size or n_kv > size:
            raise ValueError(f"{path} is corrupt: header claims {n_tensors} tensors and {n_kv} metadata keys")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<u4"))
        infos: list[_TensorInfo] = []
        if with_tensors:
            raw = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.scalar("<u4")
                if n_dims > 8:
                    raise ValueError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
                dims = [cur.scalar("<u8") for _ in range(n_dims)]
                raw.append((name, dims, cur.scalar("<u4"), cur.scalar("<u8")))
            alignment = int(meta.get("general.alignment", 32))
            start = -(-cur.pos // alignment) * alignment
            for name, dims, ggml_type, offset in raw:
                try:
                    qtype = GGMLQuantizationType(ggml_type)
                    block, type_size = GGML_QUANT_SIZES[qtype]
                except (ValueError, KeyError):
                    raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
                n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
                if dims and dims[0] % block:
                    raise ValueError(f"{path} is corrupt: tensor {name!r} row of {dims[0]} is not whole {qtype.name} blocks")
                n_bytes = n_elements // block * type_size
                if start + offset + n_bytes > size:
                    raise ValueError(
                        f"{path} is truncated: tensor {name!r} needs bytes up to {start + offset + n_bytes}, "
                        f"the file has {size}"
                    )
                infos.append(_TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, start + offset, n_bytes))
    except _Truncated as e:
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: its header is cut off ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is corrupt: undecodable string in its header ({e})") from None
    return meta, infos, data


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value of a GGUF file's metadata as plain Python values (strings, numbers, lists)."""
    meta, _, _ = _parse(path, with_tensors=False)
    return meta


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


# -------------------------------------------------------------------------------------------- tensors


def _tensor_array(t: _TensorInfo, data: np.ndarray) -> np.ndarray:
    """One tensor as float32 numpy, in numpy (= HF) dimension order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(t.ggml_type)
    raw = data[t.offset : t.offset + t.n_bytes]
    if qtype == GGMLQuantizationType.F32:
        arr = raw.view("<f4").astype(np.float32)
    elif qtype == GGMLQuantizationType.F16:
        arr = raw.view("<f2").astype(np.float32)
    elif qtype == GGMLQuantizationType.F64:
        arr = raw.view("<f8").astype(np.float32)
    elif qtype == GGMLQuantizationType.BF16:
        arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = t.shape[:-1] if t.shape else ()
        cols = t.shape[-1] if t.shape else 1
        blocks = np.asarray(raw).reshape(*rows, cols // block * type_size)
        try:
            arr = quants.dequantize(blocks, qtype)
        except NotImplementedError as e:
            raise ValueError(f"tensor {t.name!r}: quantization {qtype.name} is not supported ({e})") from e
        arr = np.asarray(arr, dtype=np.float32)
    if arr.size != int(np.prod(t.shape, dtype=np.int64)):
        raise ValueError(f"tensor {t.name!r}: {arr.size} values for shape {t.shape}; the file is corrupt")
    return np.ascontiguousarray(arr.reshape(t.shape))


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row order (pairs interleaved) back to HF's halves order."""
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} q/k rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    # file row (h, i, j) with j the pair member  ->  HF row (h, j, i)
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _hf_name(name: str, n_layers: int) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_TENSORS and int(m.group(1)) < n_layers:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


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
