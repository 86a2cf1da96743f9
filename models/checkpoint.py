"""Converted params saved and restored with orbax-checkpoint, so a second load skips dequantising.

A checkpoint lives in a directory keyed by the source file's identity (path, size, mtime), the
dtype and `FORMAT`, holding `params/` (orbax: one item per group, the embedding, final norm and
head, then each layer), `config.json` (the ModelConfig) and, written last,
`MANIFEST.json`: every file's size and the SHA-256 of each of its `CHUNK`-byte chunks.

Trust nothing on disk: `save` writes into a fresh sibling `<dir>.tmp-<pid>-<hex>` (removed on any
failure, or by a later save once its process is gone), writes the manifest last, then renames the
directory into place; `restore` loads only a directory whose manifest matches every byte (chunks
hashed on a few threads), and otherwise warns once and returns None, so the caller converts
again and `save` replaces it. A full disk (ENOSPC, found before writing or while writing) is one
`CacheSpaceError` naming the directory and the bytes needed, and leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import secrets
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import LayerParams, Params, trim_host
from ssd_jax.models.tp import leaf_spec, mesh_degree


FORMAT = 3  # bump when what a checkpoint holds changes (2: ModelConfig without cpu_kernels;
# 3: params/ as one orbax item per group, `_groups`)
MANIFEST = "MANIFEST.json"
CHUNK = 64 << 20  # bytes per hashed chunk (chunks hash in parallel)
_SLACK = 1.05  # free space asked for: the params' bytes times this, plus 16 MiB of metadata


class CacheSpaceError(OSError):
    """No room to write a conversion cache: the message names the directory, the bytes needed
    and the bytes free. errno is ENOSPC."""

    def __str__(self) -> str:
        return str(self.strerror)


def checkpoint_dir(source: Path, dtype: str, root: Path, tp: int = 1) -> Path:
    """The directory under `root / "converted"` for `source` converted to `dtype` (in the
    tensor-parallel layout of degree `tp`, `ssd_jax.models.tp`, when tp > 1): its name hashes the
    source's resolved path, size and mtime with the dtype, the degree and `FORMAT`, so an edited
    source, or another version of this package, gets a new one."""
    st = source.stat()
    ident = f"{source.resolve()}|{st.st_size}|{int(st.st_mtime)}|{dtype}|v{FORMAT}"
    ident += f"|tp{tp}" if tp > 1 else ""
    name = f"{source.stem}-{dtype}{f'-tp{tp}' if tp > 1 else ''}"
    return root / "converted" / f"{name}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


_OUTER = ("embed", "final_norm", "lm_head")


def _groups(params: Params) -> dict[str, dict]:
    """The params as orbax items, one per group: the embedding, the final norm, the head (when
    untied), then "layer_0000".. (one layer each). Saved and restored a group at a time: orbax
    stages what it moves on the host (about 1.6x the item), so one item for the model held a
    second, host copy of it.

    The leaves are the params' own arrays, not copies: `dataclasses.asdict` would deep-copy each
    one (`jax.Array.__deepcopy__` copies its buffer), a second copy of every layer held for the
    whole save (+0.7x the weights on the first load's peak, issue 33)."""
    out = {n: {n: getattr(params, n)} for n in _OUTER if getattr(params, n) is not None}
    for i, lp in enumerate(params.layers):
        leaves = {f.name: getattr(lp, f.name) for f in dataclasses.fields(lp)}
        out[f"layer_{i:04d}"] = {k: v for k, v in leaves.items() if v is not None}
    return out


def _from_groups(groups: dict[str, dict], cfg: ModelConfig) -> Params:
    names = [f.name for f in dataclasses.fields(LayerParams)]
    layers = tuple(LayerParams(**{n: groups[f"layer_{i:04d}"].get(n) for n in names})
                   for i in range(cfg.num_layers))
    outer = {n: groups[n][n] for n in _OUTER if n in groups}
    return Params(layers=layers, lm_head=outer.pop("lm_head", None), **outer)


def _is_enospc(e: BaseException) -> bool:
    # tensorstore (orbax's writer) reports a full disk as a non-OSError with the C message
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def _space_error(path: Path, need: int, free: int | None) -> CacheSpaceError:
    have = f"{free / 2**20:.1f} MiB free" if free is not None else "the disk filled up"
    return CacheSpaceError(errno.ENOSPC, f"no space for the conversion cache at {path}: it needs "
                           f"about {need / 2**20:.1f} MiB, {have}; free some space, point "
                           f"SSD_JAX_HOME (or cache_dir / --cache-dir) at a larger disk, or load "
                           f"with use_cache=False", str(path))


def param_bytes(cfg: ModelConfig) -> int:
    """Bytes of the params `params_from_hf` makes for `cfg` (every tensor in cfg.dtype), from the
    config alone: what a conversion will write, known before converting."""
    E, V, H, KVH, D, I = (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads,
                          cfg.head_dim, cfg.intermediate_size)
    layer = 2 * E + E * (H + 2 * KVH) * D + H * D * E + 3 * E * I
    layer += (H + 2 * KVH) * D if cfg.qkv_bias else 0
    layer += 2 * D if cfg.qk_norm else 0
    n = V * E * (1 if cfg.tie_embeddings else 2) + E + cfg.num_layers * layer
    return n * np.dtype(cfg.dtype).itemsize


def check_space(path: Path, nbytes: int) -> None:
    """Raise `CacheSpaceError` unless the disk holding `path` (or its nearest existing parent) has
    room for a checkpoint of `nbytes` of arrays (with slack for metadata)."""
    path = Path(path)
    need = int(nbytes * _SLACK) + (16 << 20)
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free + (_tree_bytes(path) if path.exists() else 0)
    if free < need:
        raise _space_error(path, need, free)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _chunks(f: Path) -> list[tuple[Path, int, int]]:
    size = f.stat().st_size
    return [(f, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)] or [(f, 0, 0)]


def _digest(job: tuple[Path, int, int]) -> str:
    f, off, n = job
    with open(f, "rb") as fh:
        fh.seek(off)
        data = fh.read(n)
    if len(data) != n:
        raise OSError(f"{f} ended {n - len(data)} bytes early")
    return hashlib.sha256(data).hexdigest()


def _hash_files(root: Path, files: list[str]) -> dict[str, list[str]]:
    jobs = [(name, job) for name in files for job in _chunks(root / name)]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # hashlib drops the GIL
        digests = list(pool.map(_digest, [j for _, j in jobs]))
    out: dict[str, list[str]] = {name: [] for name in files}
    for (name, _), d in zip(jobs, digests):
        out[name].append(d)
    return out


def _write_config(root: Path, cfg: ModelConfig, tp_groups: int = 1) -> None:
    (root / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    (root / "layout.json").write_text(json.dumps({"tp_groups": int(tp_groups)}))


def _write_manifest(root: Path) -> None:
    files = sorted(str(f.relative_to(root)) for f in root.rglob("*")
                   if f.is_file() and f.name != MANIFEST)
    digests = _hash_files(root, files)
    body = {"format": FORMAT, "chunk": CHUNK,
            "files": {n: {"size": (root / n).stat().st_size, "sha256": digests[n]} for n in files}}
    with open(root / MANIFEST, "w") as fh:
        json.dump(body, fh)
        fh.flush()
        os.fsync(fh.fileno())


def problem(path: Path) -> str | None:
    """Why the directory `path` is not a complete checkpoint (no manifest: half-written or from
    an older version; a file missing, of another size, or whose bytes differ), or None."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("chunk") != CHUNK:
            return f"written by another checkpoint format ({manifest.get('format')})"
    except FileNotFoundError:
        return f"no {MANIFEST} (a save that did not finish, or an older version)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"an unreadable {MANIFEST} ({e})"
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["size"]:
            return f"{name} has {f.stat().st_size} bytes, {entry['size']} were written"
    try:
        got = _hash_files(path, list(files))
    except OSError as e:
        return f"unreadable ({e})"
    for name, entry in files.items():
        if got[name] != entry["sha256"]:
            return f"{name} differs from what was written (corrupt)"
    return None


def _remove(path: Path) -> None:
    """Delete the directory `path`: renamed aside first (atomic), so no reader sees it half gone."""
    if not path.exists():
        return
    trash = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _clear_stale(path: Path) -> None:
    """Remove temporary siblings of `path` left by processes that no longer run."""
    for tmp in path.parent.glob(f"{path.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue  # not ours to judge, or its process still runs


def save(path: Path, params: Params, cfg: ModelConfig) -> None:
    """Write params (orbax, from wherever they are placed: each shard from its device), cfg (the
    config of the params as laid out: config.json), their TP degree (layout.json) and the
    manifest (last) to `path`, replacing it:
    written into a fresh temporary sibling first, then renamed into place, so no crash, full
    disk or kill leaves anything at `path` that `restore` would load. Raises `CacheSpaceError`
    (before writing, when the free space is short; or when the disk fills up while writing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path)
    _remove(path)  # what is there failed `restore` (we are converting again): reclaim its space
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    check_space(path, nbytes)
    need = int(nbytes * _SLACK) + (16 << 20)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        with ocp.StandardCheckpointer() as ckpt:
            for name, item in _groups(params).items():
                ckpt.save(tmp / "params" / name, item)
                ckpt.wait_until_finished()  # one group's host copy at a time
                trim_host()
        _write_config(tmp, cfg, params.tp_groups)
        _write_manifest(tmp)
        try:
            os.replace(tmp, path)
        except OSError as e:
            # another process converted the same model at the same time and renamed first: its
            # cache is as good as ours (same source, dtype and FORMAT), keep it
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (path / MANIFEST).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_enospc(e):
            raise _space_error(path, need, None) from e
        raise


def restore(path: Path, sharding=None) -> tuple[Params, ModelConfig] | None:
    """(params, cfg) saved at `path` by `save`, each leaf restored by orbax straight into its
    place (`sharding` as `ssd_jax.models.tp.placer` takes it: None, the default device; a
    Sharding; a Mesh, the TP layout the checkpoint was saved in): each device reads only its
    shard, nothing passes through host numpy. None when `path` holds no complete checkpoint: none
    there (silently), or one that is half-written, corrupt, stale or unloadable (with one warning
    naming why; the caller converts again and `save` replaces it)."""
    path = Path(path)
    if not path.exists():
        return None
    why = problem(path)
    if why is None:
        try:
            return _load(path, sharding)
        except Exception as e:  # noqa: BLE001 - whatever orbax or the config make of it
            why = f"it did not load ({type(e).__name__}: {e})"
    warnings.warn(f"ssd_jax: the conversion cache at {path} is not usable ({why}); converting "
                  f"again", stacklevel=2)
    return None


def _load(path: Path, sharding=None) -> tuple[Params, ModelConfig] | None:
    raw = json.loads((path / "config.json").read_text())
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = tuple(raw["rope_scaling"])
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if set(raw) != fields:  # saved by another version of ModelConfig: convert again
        raise ValueError(f"config.json has the fields of another ModelConfig "
                         f"({sorted(set(raw) ^ fields)} differ)")
    cfg = ModelConfig(**raw)
    layout = path / "layout.json"
    saved_tp = json.loads(layout.read_text())["tp_groups"] if layout.exists() else 1
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tp = mesh_degree(sharding) if isinstance(sharding, jax.sharding.Mesh) else 1
    if tp != saved_tp:
        raise ValueError(f"saved in the tensor-parallel layout of degree {saved_tp}, asked for {tp}")

    def where(keypath, meta):
        field = str(getattr(keypath[-1], "key", keypath[-1]))
        s = (NamedSharding(sharding, leaf_spec(field, meta.shape, tp))
             if isinstance(sharding, jax.sharding.Mesh) else sharding)
        return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=s)

    names = [n for n in _OUTER if (path / "params" / n).is_dir()]
    names += [f"layer_{i:04d}" for i in range(cfg.num_layers)]
    groups = {}
    with ocp.StandardCheckpointer() as ckpt:
        for name in names:  # a group at a time (`_groups`)
            meta = ckpt.metadata(path / "params" / name).item_metadata
            abstract = jax.tree_util.tree_map_with_path(where, dict(getattr(meta, "tree", meta)))
            groups[name] = ckpt.restore(path / "params" / name, abstract)
            trim_host()
    return _from_groups(groups, cfg).replace(tp_groups=saved_tp), cfg
