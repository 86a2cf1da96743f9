"""The host loop (`ssd_jax.runtime.host_loop`) with an in-process draft, for the tests that hold
it to the device loop while both exist: it is the loop of a mesh over several processes, and
issue #57 folds it into the device loop. (`timeline=True`, a proposer and a draft in another
process ran it until the device loop served them.)"""
from __future__ import annotations

import contextlib

from ssd_jax.runtime.engine import Engine


@contextlib.contextmanager
def on_host_loop():
    """Within the block, every `Engine.generate` call runs the host loop."""
    real = Engine._on_device
    Engine._on_device = lambda self, mode: False
    try:
        yield
    finally:
        Engine._on_device = real
