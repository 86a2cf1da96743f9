"""JAX's persistent compilation cache, on by default so a second run skips most compiles.

What it saves and what it does not (benchmarks/README.md, "compile time"): a hit skips XLA's
backend compile, but JAX still traces and lowers every jitted step in each new process, and
XLA:CPU still rebuilds an executable's thunk graph when it loads one, so a second process pays
part of the first one's compile time again. The step store (`ssd_jax.algorithm.aot`, off by
default, on in the CLI) takes the trace and lowering away too: it keeps each step's exported
module in `<cache dir>/steps`.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax

# compiles shorter than this are not written (JAX's own default is 1 s; the small ones add up)
DEFAULT_MIN_COMPILE_SECS = 0.0
_enabled: str | None = None


def default_dir() -> Path:
    """`$SSD_JAX_HOME/jax_compilation_cache`, or `~/.cache/ssd_jax/jax_compilation_cache`."""
    root = os.environ.get("SSD_JAX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "ssd_jax")
    return Path(root) / "jax_compilation_cache"


def min_compile_secs() -> float:
    """The shortest compile the cache keeps: env SSD_JAX_COMPILE_CACHE_MIN_SECS (seconds, >= 0),
    else `DEFAULT_MIN_COMPILE_SECS`."""
    env = os.environ.get("SSD_JAX_COMPILE_CACHE_MIN_SECS")
    if env is None or env.strip() == "":
        return DEFAULT_MIN_COMPILE_SECS
    try:
        secs = float(env)
    except ValueError:
        secs = -1.0
    if not secs >= 0:
        raise ValueError(f"SSD_JAX_COMPILE_CACHE_MIN_SECS must be a number of seconds >= 0, "
                         f"got {env!r}")
    return secs


STEP_STORE_ENV = "SSD_JAX_STEP_STORE"
_OFF = ("", "0", "false", "off")  # what turns either switch off through its variable


def step_store_wanted(setting: bool | None = None) -> bool:
    """The step store's switch: `setting` when it is a bool, else env SSD_JAX_STEP_STORE ("1" /
    "on" to turn it on; default off, see `ssd_jax.algorithm.aot` on why)."""
    if setting is not None:
        return bool(setting)
    return os.environ.get(STEP_STORE_ENV, "").strip().lower() not in _OFF


def enable_compilation_cache(setting: bool | str = True, step_store: bool | None = None) -> str | None:
    """Point JAX's persistent compilation cache at a directory (created if needed), caching every
    compile of at least `min_compile_secs()` seconds.

    setting: True: the default dir (env SSD_JAX_COMPILE_CACHE overrides: a dir, or "", "0",
    "false", "off" to turn it off); a str: that dir; False: leave JAX's settings alone. Returns the
    directory this module set, if any (None when it never set one). Pointing it at another
    directory later in the same process takes effect (JAX's cache object is reset).

    step_store (`step_store_wanted`: env SSD_JAX_STEP_STORE when None): also keep the steps'
    exported modules in `<dir>/steps`, so a later process neither traces nor lowers them; with
    `setting` False (or the env turning the cache off) the store is off too.
    """
    from ssd_jax.algorithm import aot
    global _enabled
    env = os.environ.get("SSD_JAX_COMPILE_CACHE")
    if setting is True and env is not None:
        setting = False if env in _OFF else env
    if setting is False:
        aot.set_store(None)
        return _enabled
    path = str(default_dir() if setting is True else setting)
    if _enabled != path:
        secs = min_compile_secs()
        Path(path).mkdir(parents=True, exist_ok=True)
        if _enabled is not None:
            # JAX opens its cache once per process, at the first compile after a directory is
            # set: without a reset it would keep writing to the first directory
            from jax.experimental.compilation_cache import compilation_cache
            compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", secs)
        _enabled = path
    aot.set_store(Path(path) / "steps" if step_store_wanted(step_store) else None)
    return _enabled
