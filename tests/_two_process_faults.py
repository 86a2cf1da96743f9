"""Faults planted in a draft, for tests/faults/test_faults_draft.py (in this process or a draft process).

A fault is armed by writing "KIND M" to a file: the M-th draft tree dispatched from then on
(KIND "raise" or "hang") passes through a device callback that raises, or sleeps for an hour, when
the tree executes on the draft's device, so the error surfaces where a real one would (the next
lookup); KIND "malformed": the M-th "resolved" reply of a draft process goes out as a frame that
claims dtype "object" for its rows and carries a pickle. The file is removed when the fault fires,
so each arming fires once. `install_slow_compile`: with SSD_JAX_TEST_SLOW_COMPILE=S set, every
XLA compile of the draft's chain or tree takes S seconds longer (a big draft on a slow machine).
"""
import json
import os
import pickle
import struct
import time

import jax
import numpy as np
from jax.experimental import io_callback

import ssd_jax.runtime.draft_worker as draft_worker

PLANTED = "planted fault: the draft's device failed"


def arm(path, kind: str, m: int = 1) -> None:
    """Arm the fault `kind` ("raise", "hang", "malformed") to fire at the m-th occasion."""
    with open(path, "w") as fh:
        fh.write(f"{kind} {m}")


def _due(path, kinds) -> str | None:
    """The armed kind if this occasion fires it (counts the occasion down), else None."""
    try:
        with open(path) as fh:
            kind, m = fh.read().split()
    except (FileNotFoundError, ValueError):
        return None
    if kind not in kinds:
        return None
    if int(m) > 1:
        arm(path, kind, int(m) - 1)
        return None
    os.remove(path)
    return kind


def install_tree_fault(path) -> callable:
    """Wrap the draft worker's tree so an armed "raise" / "hang" fires on the device; returns the
    function that undoes it."""
    real = draft_worker.draft_tree

    def planted(kind):
        def cb(x):
            if kind == "raise":
                raise RuntimeError(PLANTED)
            time.sleep(3600)
            return np.asarray(x)
        return jax.jit(lambda keys: io_callback(cb, jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                                                keys))

    def faulty(*args, **kwargs):
        tree, cache = real(*args, **kwargs)
        kind = _due(path, ("raise", "hang"))
        if kind is not None:
            tree = tree.replace(keys=planted(kind)(tree.keys))
        return tree, cache

    draft_worker.draft_tree = faulty
    return lambda: setattr(draft_worker, "draft_tree", real)


def install_malformed_reply(path) -> None:
    """In a draft process: an armed "malformed" replaces a "resolved" reply by a pickle frame."""
    from ssd_jax.runtime import wire

    real = wire.Channel.send

    def send(self, msg, timeout=None):
        if msg.kind == "resolved" and _due(path, ("malformed",)):
            payload = pickle.dumps({"rows": msg.arrays["rows"]})
            a = msg.arrays
            counts = ("lookups_by_accept", "hits_by_accept", "backups")
            header = json.dumps({"kind": "resolved", "fields": {"times": {}}, "arrays": [
                ["spec", "int32", list(a["spec"].shape)], ["rows", "object", [len(payload)]],
                ["hit", "bool", list(a["hit"].shape)],
                *[[n, "int32", list(a[n].shape)] for n in counts]]}).encode()
            self.sock.sendall(struct.pack("!4sBI", wire.MAGIC, wire.VERSION, len(header)) + header
                              + a["spec"].tobytes() + payload + a["hit"].tobytes()
                              + b"".join(a[n].tobytes() for n in counts))
            return
        return real(self, msg, timeout)

    wire.Channel.send = send


def install_slow_compile() -> None:
    """In a draft process: every backend compile of a module named like the draft's chain or
    tree sleeps $SSD_JAX_TEST_SLOW_COMPILE seconds first (nothing without it)."""
    seconds = float(os.environ.get("SSD_JAX_TEST_SLOW_COMPILE", "0"))
    if not seconds:
        return
    from jax._src import compiler

    real = compiler.backend_compile_and_load

    def slow(backend, module, *args, **kwargs):
        name = str(module.operation.attributes["sym_name"])
        if "draft_chain" in name or "draft_tree" in name:
            time.sleep(seconds)
        return real(backend, module, *args, **kwargs)

    compiler.backend_compile_and_load = slow
