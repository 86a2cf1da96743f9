"""Hugging Face Hub ids ("Org/Name") resolved from the local HF cache, offline.

`huggingface_hub` keeps a downloaded model at `$HF_HUB_CACHE/models--Org--Name/snapshots/<rev>/`
(`$HF_HUB_CACHE` defaults to `$HF_HOME/hub`, `$HF_HOME` to `~/.cache/huggingface`), with
`refs/<branch>` holding the commit a branch points at. We read that layout and never download:
a model that is not there is one `HubCacheError` saying where we looked and how to get it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ssd_jax.models import registry

__all__ = ["HubCacheError", "hub_cache_dir", "is_hub_id", "resolve", "resolve_hub_id"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class HubCacheError(registry.FetchError):
    """A Hub id that is not in the local Hugging Face cache; the message says where we looked."""


def hub_cache_dir(env: dict | None = None) -> Path:
    """The folder holding `models--Org--Name`: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    `~/.cache/huggingface/hub` (huggingface_hub's own rule)."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    return Path(env.get("HF_HOME") or "~/.cache/huggingface").expanduser() / "hub"


def is_hub_id(name: str | os.PathLike) -> bool:
    """Whether `name` is spelled like a Hub model id ("Org/Name": one slash, no path syntax)."""
    return isinstance(name, str) and _HUB_ID.fullmatch(name) is not None and ".." not in name


def resolve_hub_id(repo_id: str, revision: str = "main", env: dict | None = None) -> Path:
    """The snapshot folder of `repo_id` in the local HF cache: the commit `refs/<revision>`
    names (revision may also be a commit hash), else the only snapshot there is. The folder must
    hold config.json. Raises HubCacheError naming the folder looked in when it is not there."""
    org, name = repo_id.split("/")
    repo = hub_cache_dir(env) / f"models--{org}--{name}"
    snapshots = repo / "snapshots"
    hint = (f"download it with `huggingface-cli download {repo_id}` (or set HF_HOME / "
            f"HF_HUB_CACHE to the cache that has it); ssd_jax reads the cache offline")
    if not snapshots.is_dir():
        raise HubCacheError(f"{repo_id!r} is not a default model, a file or a folder, and not in "
                            f"the local Hugging Face cache: looked for {snapshots}; {hint}")
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif (snapshots / revision).is_dir():
        commit = revision
    else:
        found = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        if len(found) != 1:
            raise HubCacheError(f"{repo_id!r}: no {ref} and {len(found)} snapshots in {snapshots} "
                                f"({', '.join(found) or 'none'}); name one with revision=")
        commit = found[0]
    folder = snapshots / commit
    if not (folder / "config.json").is_file():
        raise HubCacheError(f"{repo_id!r}: the cached snapshot {folder} has no config.json (a "
                            f"partial download?); {hint}")
    return folder


def resolve(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """`registry.resolve` (a default model name, a .gguf file, an HF folder), then, for a name
    spelled "Org/Name" that is none of those, the local HF cache (`resolve_hub_id`)."""
    try:
        return registry.resolve(name_or_path, cache_dir)
    except registry.FetchError:
        if not is_hub_id(name_or_path) or Path(name_or_path).exists():
            raise
    return resolve_hub_id(str(name_or_path))
