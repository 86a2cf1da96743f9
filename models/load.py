"""`load_model(name_or_path)`: a fetched default, a GGUF file or an HF folder -> Model.

The first load dequantises / converts and saves the params with orbax; later loads restore them.
"""
from __future__ import annotations

from pathlib import Path

from ssd_jax.models import checkpoint, registry
from ssd_jax.models.config import ModelConfig, canonical_dtype
from ssd_jax.models.draft_head import prepare_draft
from ssd_jax.models.model import Model
from ssd_jax.models.params import params_from_hf


def _read(path: Path):
    if path.is_dir():
        from ssd_jax.models.loading.hf import load_hf_folder
        return load_hf_folder(path)
    from ssd_jax.models.loading.gguf import load_gguf
    return load_gguf(path)


def _read_config(path: Path) -> dict:
    """The HF-style config alone (no weights read), as `_read` would return it."""
    if path.is_dir():
        import json
        from ssd_jax.models.loading.hf import normalize_config
        return normalize_config(json.loads((path / "config.json").read_text()))
    from ssd_jax.models.loading.gguf import load_gguf_config
    return load_gguf_config(path)


def _tokenizer(path: Path):
    from ssd_jax.models.tokenizer import Tokenizer
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


def load_model(name_or_path: str | Path, dtype: str = "float32", *, use_cache: bool = True,
               cache_dir: str | Path | None = None, with_tokenizer: bool = True) -> Model:
    """The model with logical params (models/weights.py): a backend lays them out for its kernels
    with its own `prepare` (`ssd_jax.models.ops.Ops`), once they are placed.

    With `use_cache` the converted params are saved under `cache_dir` (models/checkpoint.py) and
    restored by later loads; a cache that is half-written or corrupt is converted again (one
    warning). Too little disk for the cache raises `checkpoint.CacheSpaceError` (naming the
    directory and the bytes needed) before converting, or if the disk fills up while writing,
    leaving no partial cache; `use_cache=False` converts without writing anything."""
    dtype = canonical_dtype(dtype)
    import jax
    if jax.process_count() > 1:
        # orbax synchronises save/restore across every process of a jax.distributed runtime; a
        # model loaded by one process only (the two-process transport) converts from source.
        use_cache = False
    path = registry.resolve(name_or_path, cache_dir)
    root = Path(cache_dir) if cache_dir is not None else registry.cache_dir()
    ckpt = checkpoint.checkpoint_dir(path, dtype, root)
    restored = checkpoint.restore(ckpt) if use_cache else None
    if restored is not None:
        params, cfg = restored
    else:
        if use_cache:  # no room for the cache: say so before the slow conversion
            checkpoint.check_space(ckpt, checkpoint.param_bytes(
                ModelConfig.from_hf(_read_config(path), dtype)))
        config, tensors = _read(path)
        cfg = ModelConfig.from_hf(config, dtype)
        params = params_from_hf(tensors, cfg)
        del tensors
        if use_cache:
            checkpoint.save(ckpt, params, cfg)
    tok = _tokenizer(path) if with_tokenizer else None
    return Model(cfg=cfg, params=params, tokenizer=tok, name=str(name_or_path))


def load_draft(name_or_path: str | Path, dtype: str = "float32", quant: str = "none",
               head_vocab: int | None = None, **kw) -> Model:
    """A draft as a run asks for it: `load_model(name_or_path, dtype, **kw)`, its head cut to
    `head_vocab` ids, its weights quantized (`ssd_jax.models.draft_head.prepare_draft`): all
    logical, for a backend's `prepare` to lay out."""
    return prepare_draft(load_model(name_or_path, dtype, **kw), quant, head_vocab)
