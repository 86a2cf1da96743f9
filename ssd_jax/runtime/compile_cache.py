"""JAX's persistent compilation cache, on by default so a second run skips most compiles."""
from __future__ import annotations

import os
from pathlib import Path

import jax

_enabled: str | None = None


def default_dir() -> Path:
    """`$SSD_JAX_HOME/jax_compilation_cache`, or `~/.cache/ssd_jax/jax_compilation_cache`."""
    root = os.environ.get("SSD_JAX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "ssd_jax")
    return Path(root) / "jax_compilation_cache"


def enable_compilation_cache(setting: bool | str = True) -> str | None:
    """Point JAX's persistent compilation cache at a directory (created if needed), caching every
    compile of at least 1 s.

    setting: True: the default dir (env SSD_JAX_COMPILE_CACHE overrides: a dir, or "", "0",
    "false", "off" to turn it off); a str: that dir; False: leave JAX's settings alone. Returns the
    directory this module set, if any (None when it never set one).
    """
    global _enabled
    env = os.environ.get("SSD_JAX_COMPILE_CACHE")
    if setting is True and env is not None:
        setting = False if env in ("", "0", "false", "off") else env
    if setting is False:
        return _enabled
    path = str(default_dir() if setting is True else setting)
    if _enabled != path:
        Path(path).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        _enabled = path
    return _enabled
