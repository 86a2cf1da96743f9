"""A process's memory mappings against the kernel's limit: XLA:CPU's compiled programs hold them.

XLA:CPU's JIT maps three pages (code, read-only data, data) for each kernel of a program it
compiles or loads from a cache, and JAX's caches keep every program a process has compiled. Linux
allows a process `vm.max_map_count` mappings (65,530 by default); past it LLVM's JIT linker
cannot map a new section and the process aborts inside the compiler (`LLVM ERROR` from
`RuntimeDyldImpl::emitSection`) or segfaults, with nothing that names the cause. A long notebook
session that builds many engines (every K, fan-out, batch and sampling shape is its own set of
programs) can get there; the test suite did, after some dozens of compile-heavy tests.

`watch_mappings()` (the Engine calls it) warns once a process holds `WARN_AT` of the limit and
again at `LAST_WARNING`, so the remedy comes before the crash: `jax.clear_caches()` drops the
programs (and their mappings) that nothing holds, or a larger `vm.max_map_count`. It reads
/proc after a compile only, so a call that compiles nothing pays nothing, and not after every
one: the kernel writes /proc/self/maps out line by line (~45 ms at 50,000 mappings here), while
XLA:CPU compiles a few hundred kernels a second (three mappings each), so a check every
`RECHECK_S` seconds (every `RECHECK_FAR_S` while under half the limit) comes a few percent of
the limit past a threshold at most.
"""
from __future__ import annotations

import functools
import threading
import time
import warnings

WARN_AT = 0.8
LAST_WARNING = 0.95
RECHECK_S = 1.0
RECHECK_FAR_S = 10.0
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile or a cache load
_lock = threading.Lock()
_state = {"watching": False, "warned": set(), "next": 0.0}  # next: monotonic s of the next check


class MappingLimitWarning(RuntimeWarning):
    """The process nears `vm.max_map_count`: the next compiles may abort it (module docstring)."""


def map_count() -> int:
    """Memory mappings this process holds (0 where /proc has no maps)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


@functools.lru_cache(maxsize=None)  # a kernel setting; read once
def map_limit() -> int:
    """The kernel's limit on a process's mappings, `vm.max_map_count` (0 where unknown)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def check_mappings() -> float | None:
    """Warn (`MappingLimitWarning`, once per threshold and process) if this process holds
    `WARN_AT` or `LAST_WARNING` of `vm.max_map_count`; returns the share held (None where
    unknown)."""
    limit = map_limit()
    if not limit:
        return None
    count = map_count()
    share = count / limit
    crossed = [t for t in (WARN_AT, LAST_WARNING) if share >= t]
    with _lock:
        new = [t for t in crossed if t not in _state["warned"]]
        _state["warned"].update(new)
    if new:
        warnings.warn(MappingLimitWarning(
            f"this process holds {count:,} memory mappings of the kernel's limit of {limit:,} "
            f"(vm.max_map_count, {share:.0%}): XLA:CPU maps pages for every program it compiles "
            f"and JAX keeps them all, so more compiles may abort the process inside the compiler. "
            f"Call jax.clear_caches() to release the programs nothing holds (the next call of "
            f"each recompiles), or raise vm.max_map_count (sysctl -w vm.max_map_count=262144)."),
            stacklevel=2)
    return share


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event != _COMPILE_EVENT:
        return
    now = time.monotonic()
    if now < _state["next"]:
        return
    share = check_mappings()
    _state["next"] = now + (RECHECK_FAR_S if share is not None and share < 0.5 else RECHECK_S)


def watch_mappings() -> bool:
    """Check the mappings after compiles (and persistent-cache loads) in this process from now on
    (`check_mappings`, at most every `RECHECK_S` seconds); idempotent. False where the limit is
    unknown (not Linux): nothing to watch."""
    if not map_limit():
        return False
    with _lock:
        if _state["watching"]:
            return True
        _state["watching"] = True
    from jax import monitoring
    monitoring.register_event_duration_secs_listener(_on_event)
    return True


__all__ = ["LAST_WARNING", "MappingLimitWarning", "RECHECK_FAR_S", "RECHECK_S", "WARN_AT",
           "check_mappings", "map_count", "map_limit", "watch_mappings"]
