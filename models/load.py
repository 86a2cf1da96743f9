"""`load_model(name_or_path)`: a fetched default, a GGUF file or an HF folder -> Model.

The first load dequantises / converts and saves the params with orbax; later loads restore them.
"""
from __future__ import annotations

from pathlib import Path

from ssd_jax.models import checkpoint, registry
from ssd_jax.models.config import ModelConfig, canonical_dtype
from ssd_jax.models.draft_head import prepare_draft
from ssd_jax.models.model import Model
from ssd_jax.models.packed import pack_params
from ssd_jax.models.params import params_from_hf, untie_lm_head


def _read(path: Path):
    if path.is_dir():
        from ssd_jax.models.loading.hf import load_hf_folder
        return load_hf_folder(path)
    from ssd_jax.models.loading.gguf import load_gguf
    return load_gguf(path)


def _tokenizer(path: Path):
    from ssd_jax.models.tokenizer import Tokenizer
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


def cpu_kernel_head() -> bool:
    """Whether a loaded tied model gets its head as a [hidden, V] copy for the CPU kernel:
    on a CPU backend where the kernel builds (models/cpu_matmul.py)."""
    import jax
    from ssd_jax.models import cpu_matmul
    return jax.default_backend() == "cpu" and cpu_matmul.available()


def load_model(name_or_path: str | Path, dtype: str = "float32", *, use_cache: bool = True,
               cache_dir: str | Path | None = None, with_tokenizer: bool = True,
               pack: bool | None = None) -> Model:
    """`pack`: lay out bf16 dense weights for the CPU kernel (models/packed.py); default: for a
    bf16 model where `cpu_matmul.bf16_strips()`. The values, and every result, stay the same."""
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
        config, tensors = _read(path)
        cfg = ModelConfig.from_hf(config, dtype)
        params = params_from_hf(tensors, cfg)
        del tensors
        if use_cache:
            checkpoint.save(ckpt, params, cfg)
    if cfg.tie_embeddings and cpu_kernel_head():
        params = untie_lm_head(params)
    if pack is None:
        from ssd_jax.models import cpu_matmul
        pack = dtype == "bfloat16" and cpu_matmul.bf16_strips()
    if pack:
        params = pack_params(params)
    tok = _tokenizer(path) if with_tokenizer else None
    return Model(cfg=cfg, params=params, tokenizer=tok, name=str(name_or_path))


def load_draft(name_or_path: str | Path, dtype: str = "float32", quant: str = "none",
               head_vocab: int | None = None, **kw) -> Model:
    """A draft as a run asks for it: `load_model(name_or_path, dtype, **kw)`, its head cut to
    `head_vocab` ids, its weights quantized (`ssd_jax.models.draft_head.prepare_draft`). A draft bound for
    int8 or int4 is not packed first: quantizing would only unpack it again."""
    if quant != "none":
        kw.setdefault("pack", False)
    return prepare_draft(load_model(name_or_path, dtype, **kw), quant, head_vocab)
