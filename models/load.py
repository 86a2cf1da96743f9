"""`load_model(name_or_path)`: a fetched default, a GGUF file, an HF folder or a Hub id in the
local HF cache -> Model.

The first load dequantises / converts and saves the params with orbax; later loads restore them.
Each step is logged on the "ssd_jax.load" logger (INFO), which `ssd-jax --progress` shows.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from ssd_jax.models import checkpoint, hub, registry
from ssd_jax.models.config import ModelConfig, canonical_dtype
from ssd_jax.models.draft_head import prepare_draft
from ssd_jax.models.model import Model
from ssd_jax.models.params import params_from_hf
from ssd_jax.models.tp import mesh_degree, placer


def _read(path: Path):
    if path.is_dir():
        from ssd_jax.models.loading.hf import load_hf_folder
        return load_hf_folder(path)
    from ssd_jax.models.loading.gguf import load_gguf
    return load_gguf(path)


def _read_config(path: Path) -> dict:
    """The HF-style config alone (no weights read), as `_read` would return it."""
    if path.is_dir():
        from ssd_jax.models.loading.hf import read_config
        return read_config(path)
    from ssd_jax.models.loading.gguf import load_gguf_config
    return load_gguf_config(path)


def check_source(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The model's path (`hub.resolve`) once its files' headers are read: the config, the tensor
    table and each tensor's bytes against the file's size, no weights. A missing, empty,
    truncated or foreign file is an error naming it (FileNotFoundError, ValueError), in the time a
    header takes to read: what a command checks before it starts a process or loads a model."""
    path = hub.resolve(name_or_path, cache_dir)
    _read(path)
    return path


def _tokenizer(path: Path):
    from ssd_jax.models.tokenizer import Tokenizer
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


def load_tokenizer(name_or_path: str | Path, cache_dir: str | Path | None = None):
    """The model's tokenizer alone (no weights read), as `load_model` attaches it: what a
    command needs to plan a call before the model loads (`ssd_jax.runtime.warmup`)."""
    return _tokenizer(hub.resolve(name_or_path, cache_dir))


def read_config(name_or_path: str | Path, dtype: str = "float32",
                cache_dir: str | Path | None = None) -> ModelConfig:
    """The model's `ModelConfig` from its file's header (no weights read): its shapes before it
    loads (`load_model`'s for `sharding=None`)."""
    return ModelConfig.from_hf(_read_config(hub.resolve(name_or_path, cache_dir)),
                               canonical_dtype(dtype))


log = logging.getLogger("ssd_jax.load")


def auto_dtype() -> str:
    """The dtype `ssd-jax generate --dtype auto` runs on this machine: the fastest of the "auto"
    backend table (`backends.defaults`), "bfloat16" where its kernels serve bf16 fast (a GPU, the
    CPU kernels with AVX-512 BF16), else "float32" (`ssd_jax.runtime.defaults.choose` agrees)."""
    from ssd_jax.models import backends
    return backends.defaults(backends.select("auto"))["dtype"]


def load_model(name_or_path: str | Path, dtype: str = "auto", *, sharding=None,
               use_cache: bool = True, cache_dir: str | Path | None = None,
               with_tokenizer: bool = True) -> Model:
    """The model with logical params (models/weights.py): a backend lays them out for its kernels
    with its own `prepare` (`ssd_jax.models.ops.Ops`), once they are placed.

    Each parameter is built straight onto its devices in its final dtype (`sharding`: None, the
    default device; a `jax.sharding.Sharding` for every leaf, e.g. `placement.target`; a `Mesh`
    with a `model` axis, e.g. `placement.target_mesh`: the tensor-parallel layout, each device
    receiving only its shard, `ssd_jax.models.tp`). A first load streams the file: one tensor
    at a time off its memory map, converted a block of rows at a time, so the host holds a few
    tensors, never the model; a later load restores the conversion cache the same way (orbax
    reads each device's shard).

    name_or_path: a default model name (`ssd-jax fetch`), a .gguf file, an HF folder, or a Hub id
    "Org/Name" found in the local HF cache (models/hub.py; never downloaded). dtype: "float32",
    "bfloat16" (aliases fp32 / bf16), or "auto" (default): the CLI's `--dtype auto`
    (`auto_dtype`), bf16 where this machine runs it fast, else fp32.

    With `use_cache` the converted params are saved under `cache_dir` (models/checkpoint.py) and
    restored by later loads; a cache that is half-written or corrupt is converted again (one
    warning). Too little disk for the cache raises `checkpoint.CacheSpaceError` (naming the
    directory and the bytes needed) before converting, or if the disk fills up while writing,
    leaving no partial cache; `use_cache=False` converts without writing anything."""
    dtype = dtype if dtype == "auto" else canonical_dtype(dtype)
    path = hub.resolve(name_or_path, cache_dir)  # a missing model fails before JAX starts
    if dtype == "auto":
        dtype = auto_dtype()
    import jax
    if jax.process_count() > 1:
        # orbax synchronises save/restore across every process of a jax.distributed runtime; a
        # model loaded by one process only (the two-process transport) converts from source.
        use_cache = False
    t0 = time.perf_counter()
    root = Path(cache_dir) if cache_dir is not None else registry.cache_dir()
    tp = mesh_degree(sharding) if isinstance(sharding, jax.sharding.Mesh) else 1
    ckpt = checkpoint.checkpoint_dir(path, dtype, root, tp)
    restored = checkpoint.restore(ckpt, sharding) if use_cache else None
    if restored is not None:
        params, cfg = restored
        log.info("%s: restored the converted %s weights from %s", name_or_path, dtype, ckpt)
    else:
        log.info("%s: converting %s to %s (the first load; %s)", name_or_path, path, dtype,
                 "cached for later loads" if use_cache else "not cached")
        if use_cache:  # no room for the cache: say so before the slow conversion
            checkpoint.check_space(ckpt, checkpoint.param_bytes(
                ModelConfig.from_hf(_read_config(path), dtype)))
        config, tensors = _read(path)  # opened, not read: params_from_hf reads one at a time
        cfg = ModelConfig.from_hf(config, dtype)
        _, tcfg, _ = placer(sharding, cfg)  # a model that does not split fails here, unread
        params = params_from_hf(tensors, cfg, sharding)
        del tensors
        cfg = tcfg
        if use_cache:
            checkpoint.save(ckpt, params, cfg)
    tok = _tokenizer(path) if with_tokenizer else None
    log.info("%s: loaded in %.1f s", name_or_path, time.perf_counter() - t0)
    return Model(cfg=cfg, params=params, tokenizer=tok, name=str(name_or_path))


def load_draft(name_or_path: str | Path, dtype: str = "auto", quant: str = "none",
               head_vocab: int | None = None, **kw) -> Model:
    """A draft as a run asks for it: `load_model(name_or_path, dtype, **kw)`, its head cut to
    `head_vocab` ids, its weights quantized (`ssd_jax.models.draft_head.prepare_draft`): all
    logical, for a backend's `prepare` to lay out."""
    return prepare_draft(load_model(name_or_path, dtype, **kw), quant, head_vocab)
