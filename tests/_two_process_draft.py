"""An instrumented draft process for the overlap proof: every tree step appends a line to the
signal file (argv of the target script, passed through SSD_JAX_TEST_SIGNAL) while it runs."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

import ssd_jax.tree  # noqa: E402
from ssd_jax import draft_process  # noqa: E402
from ssd_jax.saguaro import propose  # noqa: E402

SIGNAL = os.environ["SSD_JAX_TEST_SIGNAL"]


def mark(x):
    with open(SIGNAL, "a") as f:
        f.write("tree step\n")
    return np.float32(0)


def signalling_propose(logits, *a, **kw):
    zero = io_callback(mark, jax.ShapeDtypeStruct((), jnp.float32), logits.reshape(-1)[0])
    return propose(logits + zero, *a, **kw)


ssd_jax.tree.propose = signalling_propose
if __name__ == "__main__":
    draft_process.main()
