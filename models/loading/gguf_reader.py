"""The GGUF container: metadata, tensor infos, and a tensor's rows as float32 numpy (dequantised).

`read_gguf_metadata(path)` is the public entry; `_parse` and `_tensor_rows` serve the loader
(ssd_jax.models.loading.gguf).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["read_gguf_metadata"]


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

# ------------------------------------------------------------------------------------ dequantising


def _decode(raw: np.ndarray, qtype, name: str) -> np.ndarray:
    """Rows of raw bytes [R, row_bytes] of one ggml type -> float32 [R, row_elements]."""
    from gguf import GGMLQuantizationType, quants

    raw = np.ascontiguousarray(raw)
    if qtype == GGMLQuantizationType.F32:
        return raw.view("<f4").astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return raw.view("<f2").astype(np.float32)
    if qtype == GGMLQuantizationType.F64:
        return raw.view("<f8").astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    try:
        return np.asarray(quants.dequantize(raw, qtype), dtype=np.float32)
    except NotImplementedError as e:
        raise ValueError(f"tensor {name!r}: quantization {qtype.name} is not supported ({e})") from e


def _release(data: np.ndarray, offset: int, n: int) -> None:
    """Drop the pages of bytes offset:offset+n of the file's map from this process's RSS (they
    stay in the page cache), so reading a model through its map does not hold it resident."""
    mm = getattr(data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    page = mmap.PAGESIZE
    start = offset // page * page
    end = min(len(mm), -(-(offset + n) // page) * page)
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError, AttributeError):  # not on this platform: only RSS is at stake
        pass


def _tensor_rows(t: _TensorInfo, data: np.ndarray, start: int, stop: int,
                 which: np.ndarray | None = None) -> np.ndarray:
    """Rows start:stop of axis 0 (or the rows `which`, file row indices) of one tensor as float32,
    in numpy (= HF) dimension order: only those rows' bytes are read off the memory map."""
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType(t.ggml_type)
    shape = t.shape or (1,)
    raw = data[t.offset : t.offset + t.n_bytes]
    if len(shape) == 1:  # a vector: decoded whole (norms, biases: small)
        out = _decode(raw.reshape(1, -1), qtype, t.name).reshape(-1)
        if out.size != shape[0]:
            raise ValueError(f"tensor {t.name!r}: {out.size} values for shape {t.shape}; the file is corrupt")
        return out[start:stop] if which is None else out[which]
    rows = raw.reshape(shape[0], -1)  # ggml blocks run along the last (fastest) dimension
    sel = rows[start:stop] if which is None else rows[which]
    out = _decode(sel, qtype, t.name)
    _release(data, t.offset, t.n_bytes)
    n = int(np.prod(shape[1:], dtype=np.int64))
    if out.shape[-1] != n:
        raise ValueError(f"tensor {t.name!r}: {out.shape[-1]} values a row for shape {t.shape}; the file is corrupt")
    return out.reshape(sel.shape[0], *shape[1:])


def _tensor_array(t: _TensorInfo, data: np.ndarray) -> np.ndarray:
    """One whole tensor as float32 numpy, in numpy (= HF) dimension order."""
    shape = t.shape or (1,)
    return _tensor_rows(t, data, 0, shape[0]).reshape(t.shape)
