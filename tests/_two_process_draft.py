"""An instrumented draft process for the overlap proof: its tree steps answer a verify that is
running at the same time (files beside SSD_JAX_TEST_SIGNAL; see tests/_two_process_target.py)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

import ssd_jax.algorithm.tree  # noqa: E402
from ssd_jax.runtime import draft_process  # noqa: E402
from ssd_jax.algorithm.saguaro import propose  # noqa: E402

SIGNAL = os.environ["SSD_JAX_TEST_SIGNAL"]


def mark(x):
    """Runs inside every tree step: once the test is armed, wait briefly for a verify to be
    running (file V) and answer it (file T). A tree that runs while no verify runs answers nothing."""
    if os.path.exists(SIGNAL + ".armed"):
        deadline = time.time() + 2.0
        while time.time() < deadline:
            if os.path.exists(SIGNAL + ".V"):
                open(SIGNAL + ".T", "w").close()
                break
            time.sleep(0.002)
    return np.float32(0)


def signalling_propose(logits, *a, **kw):
    zero = io_callback(mark, jax.ShapeDtypeStruct((), jnp.float32), logits.reshape(-1)[0])
    return propose(logits + zero, *a, **kw)


ssd_jax.algorithm.tree.propose = signalling_propose
if __name__ == "__main__":
    draft_process.run()
