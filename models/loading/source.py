"""A checkpoint's tensors read one at a time: the Mapping every loader returns.

`load_hf_folder` and `load_gguf` return a `TensorSource`: HF names -> tensors, where nothing is
read until a tensor is asked for, and then only that tensor (or a range of its rows) comes off the
file's memory map as float32. `ssd_jax.models.params.params_from_hf` converts a tensor a block of
rows at a time into its target dtype, so a load holds a few tensors on the host, never the model.
A plain dict of arrays is a source too (`as_source`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import numpy as np

__all__ = ["TensorSource", "DictSource", "as_source"]


class TensorSource(Mapping):
    """HF-named tensors, read lazily. Subclasses give `names()`, `shape(name)` and
    `rows(name, start, stop)`; `source[name]` is the whole tensor as float32 (floating
    checkpoints) through `rows`."""

    def names(self) -> list[str]:
        """The tensors' HF names, from the file's header (nothing read)."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in HF order, from the file's header (nothing read)."""
        raise NotImplementedError

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of axis 0 (elements of a 1-D tensor) as float32."""
        raise NotImplementedError

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._index():
            raise KeyError(name)
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name) -> bool:
        return name in self._index()

    def _index(self) -> set[str]:
        if getattr(self, "_names", None) is None:
            self._names = set(self.names())
        return self._names


class DictSource(TensorSource):
    """A dict of arrays (already in memory) as a source."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = tensors

    def names(self) -> list[str]:
        """The dict's keys."""
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """The array's shape."""
        return tuple(np.shape(self.tensors[name]))

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of the array, as float32."""
        a = np.asarray(self.tensors[name])
        return (a.reshape(1) if a.ndim == 0 else a[start:stop]).astype(np.float32, copy=False)


def as_source(tensors: Mapping[str, np.ndarray] | TensorSource) -> TensorSource:
    """`tensors` as a TensorSource (a source as is, a dict wrapped)."""
    return tensors if isinstance(tensors, TensorSource) else DictSource(tensors)
