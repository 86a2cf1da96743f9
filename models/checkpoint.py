"""Converted params saved and restored with orbax-checkpoint, so a second load skips dequantising.

A checkpoint lives in a directory keyed by the source file's identity (path, size, mtime) and the
dtype, beside a `config.json` holding the ModelConfig. A partial or stale directory is ignored.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import LayerParams, Params


FORMAT = 2  # bump when what a checkpoint holds changes (2: ModelConfig without cpu_kernels)


def checkpoint_dir(source: Path, dtype: str, root: Path) -> Path:
    """The directory under `root / "converted"` for `source` converted to `dtype`: its name hashes
    the source's resolved path, size and mtime with the dtype and `FORMAT`, so an edited source,
    or another version of this package, gets a new one."""
    st = source.stat()
    ident = f"{source.resolve()}|{st.st_size}|{int(st.st_mtime)}|{dtype}|v{FORMAT}"
    return root / "converted" / f"{source.stem}-{dtype}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _to_tree(params: Params) -> dict:
    def layer(lp: LayerParams):
        return {k: v for k, v in dataclasses.asdict(lp).items() if v is not None}
    out = {"embed": params.embed, "final_norm": params.final_norm,
           "layers": {str(i): layer(lp) for i, lp in enumerate(params.layers)}}
    if params.lm_head is not None:
        out["lm_head"] = params.lm_head
    return out


def _from_tree(tree: dict, cfg: ModelConfig) -> Params:
    names = [f.name for f in dataclasses.fields(LayerParams)]
    layers = tuple(LayerParams(**{n: tree["layers"][str(i)].get(n) for n in names})
                   for i in range(cfg.num_layers))
    return Params(embed=tree["embed"], layers=layers, final_norm=tree["final_norm"],
                  lm_head=tree.get("lm_head"))


def save(path: Path, params: Params, cfg: ModelConfig) -> None:
    """Write params (orbax) and cfg (config.json) to `path`, replacing it: written beside it first,
    then renamed into place, so a crash never leaves a partial directory at `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp / "params", _to_tree(params))
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def restore(path: Path) -> tuple[Params, ModelConfig] | None:
    """(params, cfg) saved at `path` by `save`, or None when it holds no complete checkpoint."""
    path = Path(path)
    if not (path / "config.json").exists() or not (path / "params").exists():
        return None
    raw = json.loads((path / "config.json").read_text())
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = tuple(raw["rope_scaling"])
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if set(raw) != fields:  # saved by another version of ModelConfig: convert again
        return None
    cfg = ModelConfig(**raw)
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(path / "params")
    tree = jax.tree_util.tree_map(lambda x: jax.numpy.asarray(np.asarray(x)), tree)
    return _from_tree(tree, cfg), cfg
